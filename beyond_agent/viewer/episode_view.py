"""One episode as the page shows it: turns, and every token with its id, text, mask, log-prob and turn.

Token texts come from the run's own tokenizer (the model folder of its training config, or `--tokenizer`),
each id decoded on its own; without a tokenizer the page shows the ids alone and says why.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Any

from beyond_agent.trajectories import TrajectoryRecord

logger = logging.getLogger(__name__)


class TokenTexts:
    """Decodes token ids one by one with the run's tokenizer (loaded once, from a local folder only)."""

    def __init__(self, path: str | None):
        self.path = path
        self.problem: str | None = None
        self._tokenizer = None
        if not path:
            self.problem = "no tokenizer: the run's config names no model; pass --tokenizer PATH"
            return
        try:
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as error:  # any failure leaves the ids readable
            self.problem = f"tokenizer {path!r} could not be loaded ({type(error).__name__}); showing ids only"
            logger.warning(self.problem)
        self._decode_one = lru_cache(maxsize=200_000)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def texts(self, ids: list[int]) -> list[str] | None:
        """The text of each id, or None without a tokenizer."""
        if self._tokenizer is None:
            return None
        return [self._decode_one(token_id) for token_id in ids]


def turn_of_each_token(turn_ends: list[int], length: int) -> list[int]:
    """For each response position, the assistant turn it belongs to or follows (0-based).

    Why: the observation tokens after turn k's last token belong to the exchange that turn k started,
    so a token is in turn k until turn k's end has passed.
    """
    turns, turn = [], 0
    ends = sorted(end for end in turn_ends if end >= 0)
    for position in range(length):
        while turn < len(ends) and position > ends[turn]:
            turn += 1
        turns.append(turn)
    return turns


def episode_view(record: TrajectoryRecord, texts: TokenTexts) -> dict[str, Any]:
    """The JSON the episode page renders."""
    response_texts = texts.texts(record.response_ids)
    prompt_texts = texts.texts(record.prompt_ids)
    logprobs = record.response_logprobs or [None] * len(record.response_ids)
    turns = turn_of_each_token(record.turn_ends, len(record.response_ids))
    response = [{"id": token_id, "text": response_texts[i] if response_texts else None,
                 "mask": record.response_mask[i], "logprob": logprobs[i], "turn": turns[i]}
                for i, token_id in enumerate(record.response_ids)]
    prompt = [{"id": token_id, "text": prompt_texts[i] if prompt_texts else None}
              for i, token_id in enumerate(record.prompt_ids)]
    summary = {key: value for key, value in record.to_json().items()
               if key not in ("prompt_ids", "response_ids", "response_mask", "response_logprobs")}
    return {**summary, "tokens": {"prompt": prompt, "response": response}, "tokenizer": texts.path,
            "tokenizer_problem": texts.problem}
