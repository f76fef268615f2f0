"""The reward of the CPU smoke run: no download, no model, just a deterministic check of the answer."""

from __future__ import annotations

import re
from typing import Any, Optional

_INTEGER = re.compile(r"-?\d+")
# Partial credit when the answer appears anywhere in the response. Why: a random-weight model is never
# right, and GRPO gives all-equal rewards zero advantage, so without it the smoke run would train on
# zero gradients. (Any-number credit is not enough: random text nearly always contains a digit.)
MENTION_CREDIT = 0.5


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: Optional[dict] = None, **_: Any
) -> float:
    """1.0 when the last integer in the response is the answer, 0.5 when it appears elsewhere, else 0.

    Follows verl's ``custom_reward_function`` signature. The smoke run checks the pipeline, not learning.
    """
    answer = str(ground_truth).strip()
    numbers = _INTEGER.findall(solution_str)
    if numbers and numbers[-1] == answer:
        return 1.0
    return MENTION_CREDIT if answer in solution_str else 0.0
