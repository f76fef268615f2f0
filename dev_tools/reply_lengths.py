"""Long-tailed reply lengths for benchmarks: a vLLM logits processor that ends every assistant turn at a length drawn
from a distribution, so that a random-weight model's replies are as long-tailed as a reasoning agent's (issue #72's
generation bench, bench/async_cpu.py `--reply-lengths`).

    BEYOND_REPLY_LENGTHS=lognormal:median=24,sigma=1.2,max=320     # tokens; the forms of envservice/latency.py
    actor_rollout_ref.rollout.engine_kwargs.vllm.logits_processors=[dev_tools.reply_lengths:LongTailedReplies]

A turn's length is drawn from a generator seeded by the conversation before it (the prompt up to the turn's
`<|im_start|>`), and the position in the turn counts the prompt's tokens after that header too: a turn interrupted
at a weight sync and continued from its sampled tokens (partial rollout) ends where it would have uninterrupted.
Before that length the chat's end tokens are masked; at it, `<|im_end|>` is the only token left. The log-probs vLLM
returns are the model's own (vLLM's default `raw_logprobs`, taken before logits processors), so what the trainer
learns from is unchanged; only where replies end is set.
"""

from __future__ import annotations

import hashlib
import os
import random
from array import array
from typing import Any, Callable

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

from envservice.latency import LatencySpec, parse_latency_spec

VARIABLE = "BEYOND_REPLY_LENGTHS"
"""The length distribution (in tokens), read by each vLLM worker process."""
PROCESSOR = "dev_tools.reply_lengths:LongTailedReplies"
"""What `engine_kwargs.vllm.logits_processors` names."""


def turn_length(spec: LatencySpec, conversation: list[int]) -> int:
    """The length of the turn that follows `conversation` (at least one token), the same for the same conversation."""
    digest = hashlib.blake2b(array("q", conversation).tobytes(), digest_size=8).digest()
    return max(1, round(spec.draw(random.Random(int.from_bytes(digest, "little")))))


class LongTailedReplies(AdapterLogitsProcessor):
    """Ends each assistant turn at `turn_length` tokens (module docstring)."""

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        super().__init__(vllm_config, device, is_pin_memory)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(vllm_config.model_config.tokenizer)
        self.turn_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
        self.header = len(tokenizer.encode("<|im_start|>assistant\n"))
        self.turn_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.ends = sorted({self.turn_end, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])})
        self.spec = parse_latency_spec(os.environ[VARIABLE], VARIABLE)

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: Any) -> Callable[[list[int], list[int], torch.Tensor], torch.Tensor]:
        turn: list[int] = []  # [length, tokens of the turn already in the prompt], found on the first call

        def end_at_length(prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            if not turn:
                start = max((i for i, token in enumerate(prompt_ids) if token == self.turn_start), default=0)
                turn.extend([turn_length(self.spec, prompt_ids[:start]), len(prompt_ids) - start - self.header])
            if turn[1] + len(output_ids) + 1 >= turn[0]:  # the next token is the turn's last
                logits.fill_(float("-inf"))
                logits[self.turn_end] = 0.0
            else:
                logits[self.ends] = float("-inf")
            return logits

        return end_at_length
