"""dev_tools/reply_lengths.py, the generation bench's logits processor (issue #72): each assistant turn ends at a
length drawn from the conversation before it, whether or not it was interrupted and continued; with the tiny model's
real tokenizer and chat template. (The bench runs it inside vLLM: bench/async_cpu.py --reply-lengths.)"""

from __future__ import annotations

import random
import statistics
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoTokenizer

from dev_tools.reply_lengths import VARIABLE, LongTailedReplies, turn_length
from envservice.latency import parse_latency_spec


def processor(model_dir, monkeypatch, spec: str) -> LongTailedReplies:
    monkeypatch.setenv(VARIABLE, spec)
    config = SimpleNamespace(model_config=SimpleNamespace(tokenizer=str(model_dir)))
    return LongTailedReplies(config, torch.device("cpu"), False)


def allowed(step, prompt: list[int], output: list[int], size: int) -> torch.Tensor:
    return torch.isfinite(step(prompt, output, torch.zeros(size)))


def test_a_turn_ends_at_its_length_and_a_continued_turn_at_the_same(tiny_model_dir, monkeypatch):
    lengths = processor(tiny_model_dir, monkeypatch, "fixed:5")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    prompt = list(tokenizer.apply_chat_template([{"role": "user", "content": "go to the red ball"}], tokenize=True,
                                                add_generation_prompt=True)["input_ids"])
    size, end = len(tokenizer) + 8, lengths.turn_end
    step = lengths.new_req_logits_processor(None)
    sampled = [11, 12, 13, 14]
    for count in range(4):  # tokens 1-4: anything but an end token
        mask = allowed(step, prompt, sampled[:count], size)
        assert not mask[end] and mask.sum() == size - len(lengths.ends)
    mask = allowed(step, prompt, sampled, size)  # token 5, the turn's last: <|im_end|> alone
    assert mask[end] and mask.sum() == 1
    # Interrupted after 2 tokens and continued from them (the new request's prompt holds them): 3 more, the same end.
    continued = lengths.new_req_logits_processor(None)
    assert not allowed(continued, prompt + sampled[:2], [], size)[end]
    assert not allowed(continued, prompt + sampled[:2], sampled[2:3], size)[end]
    assert allowed(continued, prompt + sampled[:2], sampled[2:4], size).sum() == 1


def test_lengths_follow_the_spec_and_repeat_for_a_conversation():
    spec = parse_latency_spec("lognormal:median=24,sigma=1.2,max=320", "--reply-lengths")
    rng = random.Random(0)
    conversations = [[rng.randrange(1000) for _ in range(rng.randrange(5, 60))] for _ in range(3000)]
    lengths = [turn_length(spec, conversation) for conversation in conversations]
    assert [turn_length(spec, conversations[0]) for _ in range(3)] == [lengths[0]] * 3
    assert statistics.median(lengths) == pytest.approx(24, rel=0.1)
    assert max(lengths) == 320 and min(lengths) >= 1
    assert sum(length >= 5 * 24 for length in lengths) / len(lengths) == pytest.approx(0.09, abs=0.02)  # the tail
