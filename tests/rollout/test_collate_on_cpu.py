"""Hand-worked collation: padding sides, positions, reward placement, log-probs, verl's DataProto."""

from __future__ import annotations

import pytest
import torch
from verl import DataProto
from verl.utils.model import compute_position_id_with_mask

from beyond_agent.rollout.batch import collate
from beyond_agent.rollout.handler import Episode, RolloutHandler

PAD = 0


@pytest.fixture
def episodes() -> list[Episode]:
    """Two episodes sized for max_prompt_length=4, max_response_length=4."""
    short = Episode(
        prompt_ids=[11, 12, 13],
        response_ids=[21, 22, 23],
        response_mask=[1, 1, 0],  # ends on an observation token
        response_logprobs=[-0.5, -0.25, 0.0],
        reward=1.0,
        termination="done",
        num_turns=1,
    )
    full = Episode(
        prompt_ids=[14],
        response_ids=[24, 25, 26, 27],
        response_mask=[1, 0, 1, 1],
        response_logprobs=[-1.0, 0.0, -2.0, -0.5],
        reward=0.5,
        termination="length",
        num_turns=2,
        prompt_truncated=True,
    )
    return [short, full]


def test_padding_masks_and_positions(episodes):
    batch = collate(episodes, PAD, max_prompt_length=4, max_response_length=4).batch

    assert batch["prompts"].tolist() == [[0, 11, 12, 13], [0, 0, 0, 14]]
    assert batch["responses"].tolist() == [[21, 22, 23, 0], [24, 25, 26, 27]]
    assert batch["input_ids"][0].tolist() == [0, 11, 12, 13, 21, 22, 23, 0]
    assert batch["attention_mask"][0].tolist() == [0, 1, 1, 1, 1, 1, 1, 0]
    assert batch["attention_mask"][1].tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert batch["position_ids"][0].tolist() == [0, 0, 1, 2, 3, 4, 5, 5]
    assert batch["position_ids"][1].tolist() == [0, 0, 0, 0, 1, 2, 3, 4]
    assert batch["response_mask"].tolist() == [[1, 1, 0, 0], [1, 0, 1, 1]]
    assert torch.equal(batch["position_ids"], compute_position_id_with_mask(batch["attention_mask"]))


def test_reward_sits_on_the_last_policy_token(episodes):
    batch = collate(episodes, PAD, max_prompt_length=4, max_response_length=4).batch
    # Row 0 ends on an observation token (mask 0): its reward goes on the last mask-1 token before it,
    # where verl's GAE / REINFORCE++ (which skip mask-0 positions) still see it.
    assert batch["rm_scores"].tolist() == [[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.5]]
    assert batch["rm_scores"].dtype == torch.float32


def test_rollout_log_probs_are_right_padded_float32(episodes):
    batch = collate(episodes, PAD, max_prompt_length=4, max_response_length=4).batch
    assert batch["rollout_log_probs"].dtype == torch.float32
    assert batch["rollout_log_probs"].tolist() == [[-0.5, -0.25, 0.0, 0.0], [-1.0, 0.0, -2.0, -0.5]]


def test_shapes_and_non_tensor_fields(episodes):
    data = collate(episodes, PAD, max_prompt_length=4, max_response_length=6)
    assert isinstance(data, DataProto)
    assert data.batch["prompts"].shape == (2, 4)
    assert data.batch["responses"].shape == (2, 6)
    assert data.batch["input_ids"].shape == (2, 10)
    assert data.non_tensor_batch["termination"].tolist() == ["done", "length"]
    assert data.non_tensor_batch["__num_turns__"].tolist() == [1, 2]
    assert data.non_tensor_batch["prompt_truncated"].tolist() == [False, True]


def test_log_probs_are_left_out_when_an_episode_has_none(episodes):
    episodes[1].response_logprobs = None
    assert "rollout_log_probs" not in collate(episodes, PAD, 4, 4).batch.keys()


def test_empty_response_gets_no_reward_and_no_attention():
    empty = Episode(prompt_ids=[5, 6], response_ids=[], response_mask=[], response_logprobs=[],
                    reward=1.0, termination="llm_error")
    batch = collate([empty], PAD, max_prompt_length=2, max_response_length=3).batch
    assert batch["rm_scores"].tolist() == [[0.0, 0.0, 0.0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 1, 1, 1]]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"termination": None}, r"episode 1 has termination=None; call finish\(\) with one of"),
        ({"prompt_ids": [1, 2, 3, 4, 5]}, "episode 1: prompt_ids has 5 tokens > max_prompt_length=4"),
        ({"response_mask": [1, 0]}, "episode 1: response_mask has 2 values but response_ids has 4"),
        ({"response_logprobs": [0.0]}, "episode 1: response_logprobs has 1 values but response_ids has 4"),
    ],
)
def test_bad_episodes_are_named(episodes, change, message):
    for name, value in change.items():
        setattr(episodes[1], name, value)
    with pytest.raises(ValueError, match=message):
        collate(episodes, PAD, max_prompt_length=4, max_response_length=4)


def test_handlers_collate_to_their_own_sequences(tokenizer, sample):
    handlers = []
    for texts in (["go left"], ["go right", "pick up the key"]):
        handler = RolloutHandler(tokenizer, [{"role": "user", "content": "Find the key."}], 64, 128)
        for i, text in enumerate(texts):
            if i:
                handler.add_observation("You see a key.")
            ids = sample(tokenizer, text)
            handler.add_assistant(ids, [-0.1] * len(ids))
        handler.finish("done")
        handler.reward = float(len(texts))
        handlers.append(handler)

    batch = collate(handlers, tokenizer.pad_token_id, 64, 128).batch
    for row, handler in enumerate(handlers):
        real = batch["attention_mask"][row].bool()
        assert batch["input_ids"][row][real].tolist() == handler.prompt_ids_for_next_turn()
        last = len(handler.response_ids) - 1
        assert batch["rm_scores"][row].nonzero().flatten().tolist() == [last]
        assert batch["rm_scores"][row, last].item() == handler.reward
