"""The vectorised collate equals the previous per-row implementation (kept here as the reference) on random
batches: every tensor with its dtype, and the non-tensor fields."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from beyond_agent.rollout.batch import collate
from beyond_agent.rollout.handler import TERMINATION_REASONS, Episode

PAD = 7


def reference_tensors(rows: list[Episode], pad_id: int, prompt_len: int, response_len: int) -> dict:
    """The per-row implementation collate had before it was vectorised."""
    prompts = reference_pad([r.prompt_ids for r in rows], prompt_len, pad_id, left=True)
    prompt_attention = reference_pad([[1] * len(r.prompt_ids) for r in rows], prompt_len, 0, left=True)
    responses = reference_pad([r.response_ids for r in rows], response_len, pad_id, left=False)
    response_attention = reference_pad([[1] * len(r.response_ids) for r in rows], response_len, 0, left=False)
    attention_mask = torch.cat([prompt_attention, response_attention], dim=1)
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": reference_pad([r.response_mask for r in rows], response_len, 0, left=False),
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(dim=1) - 1).clamp(min=0),
        "rm_scores": reference_rewards(rows, response_len),
        "step_rewards": reference_step_rewards(rows, response_len),
    }
    if all(r.response_logprobs is not None for r in rows):
        tensors["rollout_log_probs"] = reference_pad(
            [r.response_logprobs for r in rows], response_len, 0.0, left=False, dtype=torch.float32)
    return tensors


def reference_rewards(rows: list[Episode], response_len: int) -> torch.Tensor:
    scores = torch.zeros(len(rows), response_len, dtype=torch.float32)
    for i, row in enumerate(rows):
        policy_positions = [t for t, m in enumerate(row.response_mask) if m == 1]
        if policy_positions:
            scores[i, policy_positions[-1]] = float(row.reward)
        elif row.response_ids:
            scores[i, len(row.response_ids) - 1] = float(row.reward)
    return scores


def reference_step_rewards(rows: list[Episode], response_len: int) -> torch.Tensor:
    scores = torch.zeros(len(rows), response_len, dtype=torch.float32)
    for i, row in enumerate(rows):
        for end, reward in zip(row.turn_ends, row.step_rewards):
            if end >= 0:
                scores[i, end] += reward
    return scores


def reference_pad(rows, width, value, left, dtype=torch.long) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=dtype)
    for i, row in enumerate(rows):
        if row:
            values = torch.tensor(row, dtype=dtype)
            if left:
                out[i, width - len(row):] = values
            else:
                out[i, : len(row)] = values
    return out


def random_episode(rng: random.Random, prompt_len: int, response_len: int, with_logprobs: bool) -> Episode:
    """Any lengths within the limits (empty included); masks all-0, all-1 or mixed; awkward rewards."""
    n = rng.choice([0, response_len, rng.randrange(response_len + 1)])
    mask_kind = rng.choice(["mixed", "zeros", "ones"])
    mask = [rng.randrange(2) if mask_kind == "mixed" else int(mask_kind == "ones") for _ in range(n)]
    return Episode(
        prompt_ids=[rng.randrange(1000) for _ in range(rng.choice([0, prompt_len, rng.randrange(prompt_len + 1)]))],
        response_ids=[rng.randrange(1000) for _ in range(n)],
        response_mask=mask,
        response_logprobs=[-rng.random() * 3 if m else 0.0 for m in mask] if with_logprobs else None,
        reward=rng.choice([0.1, -1.7, 1, 0.0, 1e-9, rng.uniform(-5, 5)]),
        termination=rng.choice(TERMINATION_REASONS),
        num_turns=rng.randrange(5),
        prompt_truncated=rng.random() < 0.3,
        turn_ends=(ends := sorted(rng.sample(range(n), rng.randrange(min(n, 4) + 1))) + [-1] * rng.randrange(2)),
        step_rewards=[rng.choice([0.0, 0.5, -1.0, rng.uniform(-2, 2)]) for _ in ends],
    )


@pytest.mark.parametrize("seed", range(40))
def test_collate_equals_the_per_row_reference(seed):
    rng = random.Random(seed)
    prompt_len, response_len = rng.randrange(1, 12), rng.randrange(1, 20)
    all_logprobs = rng.random() < 0.7
    rows = [random_episode(rng, prompt_len, response_len, all_logprobs or rng.random() < 0.5)
            for _ in range(rng.randrange(1, 10))]

    data = collate(rows, PAD, prompt_len, response_len)
    expected = reference_tensors(rows, PAD, prompt_len, response_len)

    assert sorted(data.batch.keys()) == sorted(expected)
    for name, tensor in expected.items():
        got = data.batch[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        assert torch.equal(got, tensor), name
    assert data.non_tensor_batch["termination"].tolist() == [r.termination for r in rows]
    assert np.array_equal(data.non_tensor_batch["__num_turns__"], np.array([r.num_turns for r in rows], np.int32))
    assert data.non_tensor_batch["prompt_truncated"].tolist() == [r.prompt_truncated for r in rows]
