"""GiGPO's advantages (beyond_agent.algorithms.gigpo) on a batch worked by hand: two groups that share an
observation text (never one anchor group across groups), shared and unshared anchor states, a turn cut by
length (the env did not step: reward 0), an episode whose env never stepped (no turns), gamma and omega."""

from __future__ import annotations

import math

import pytest
import torch

from beyond_agent.algorithms.gigpo import (EpisodeSteps, GiGPOConfig, discounted_returns, gigpo_advantages,
                                           spread_over_turns)

BATCH = [
    EpisodeSteps("a", 1.0, (0.0, 1.0), ("s0", "s1")),
    EpisodeSteps("a", 0.0, (0.0, 0.0), ("s0", "s2")),
    EpisodeSteps("a", 1.0, (0.0, 0.0, 1.0), ("s0", "s1", "s3")),  # reaches s1 one turn later than episode 0
    EpisodeSteps("b", 0.0, (0.0,), ("s0",)),  # same text as group a's first state: another task, another group
    EpisodeSteps("b", 0.0, (0.0,), ("s0",)),  # its only turn was cut by length: the env never stepped
    EpisodeSteps("c", 0.0, (), ()),  # an episode with no turn at all (e.g. its first generation failed)
]
ROOT3 = math.sqrt(1 / 3)  # group a's sample std of R = (1, 0, 1)


def test_hand_worked_batch_with_gamma_one_half():
    found = gigpo_advantages(BATCH, GiGPOConfig(gamma=0.5, omega=1.0), "std", epsilon=1e-12)
    # A^E: group a (R - 2/3) / sqrt(1/3); group b all equal; group c alone.
    assert found.episode == pytest.approx([1 / 3 / ROOT3, -2 / 3 / ROOT3, 1 / 3 / ROOT3, 0.0, 0.0, 0.0])
    # Step returns with gamma 1/2: episode 0 (0.5, 1), episode 1 (0, 0), episode 2 (0.25, 0.5, 1).
    # (a, s0): 0.5, 0, 0.25 -> mean 0.25, std 0.25 -> 1, -1, 0. (a, s1): 1, 0.5 -> +-1/sqrt(2).
    # (a, s2) and (a, s3) alone -> 0. (b, s0): 0, 0 -> 0 / epsilon = 0.
    assert found.step[0] == pytest.approx([1.0, 1 / math.sqrt(2)])
    assert found.step[1] == pytest.approx([-1.0, 0.0])
    assert found.step[2] == pytest.approx([0.0, -1 / math.sqrt(2), 0.0])
    assert found.turns[1] == pytest.approx([-2 / 3 / ROOT3 - 1.0, -2 / 3 / ROOT3])
    assert found.metrics == pytest.approx({"anchor_groups": 5.0, "mean_group_size": 9 / 5,
                                           "singleton_fraction": 2 / 9, "text_anchor_fraction": 0.0})


def test_equal_returns_give_zero_not_nan_with_the_default_epsilon():
    found = gigpo_advantages(BATCH, GiGPOConfig(gamma=0.5))
    assert found.step[3] == found.step[4] == [0.0] and found.episode[3:] == [0.0, 0.0, 0.0]
    assert found.turns[5] == []


def test_omega_weighs_the_step_part_and_mean_norm_only_centres():
    half = gigpo_advantages(BATCH, GiGPOConfig(gamma=0.5, omega=0.5), epsilon=1e-12)
    assert half.turns[0] == pytest.approx([1 / 3 / ROOT3 + 0.5, 1 / 3 / ROOT3 + 0.5 / math.sqrt(2)])
    mean = gigpo_advantages(BATCH, GiGPOConfig(gamma=0.5, omega=1.0), "mean")
    assert mean.episode[:3] == pytest.approx([1 / 3, -2 / 3, 1 / 3])
    assert [mean.step[i][0] for i in range(3)] == pytest.approx([0.25, -0.25, 0.0])
    assert mean.turns[0] == pytest.approx([1 / 3 + 0.25, 1 / 3 + 0.25])  # (a, s1): 1 - 0.75


def test_gamma_and_config_checks():
    assert discounted_returns([1.0, 0.0, 2.0], 0.9) == pytest.approx([1 + 0.81 * 2, 1.8, 2.0])
    assert discounted_returns([], 0.9) == []
    one = gigpo_advantages(BATCH, GiGPOConfig(gamma=1.0), epsilon=1e-12)  # undiscounted: (a, s0) returns 1, 0, 1
    assert [one.step[i][0] for i in range(3)] == pytest.approx([1 / 3 / ROOT3, -2 / 3 / ROOT3, 1 / 3 / ROOT3])
    with pytest.raises(ValueError, match=r"norm must be one of \['std', 'mean'\]"):
        gigpo_advantages(BATCH, GiGPOConfig(), "max")
    with pytest.raises(ValueError, match=r"gigpo.gamma must be a number in \[0, 1\]"):
        GiGPOConfig(gamma=1.5)
    with pytest.raises(ValueError, match="2 step rewards for 1 anchor states"):
        gigpo_advantages([EpisodeSteps("a", 0.0, (0.0, 0.0), ("s0",))], GiGPOConfig())


def test_each_turn_s_advantage_lands_on_its_own_trained_tokens_only():
    # turn 0: tokens 0-2; observation 3-5 (mask 0); turn 1: 6-7; observation 8-9; turn 2: 10-11, cut at 12
    mask = torch.tensor([1, 1, 1, 0, 0, 0, 1, 1, 0, 0, 1, 1, 0, 0])
    values = spread_over_turns(mask, [2, 7, 11], [0.5, -1.0, 2.0])
    assert values.tolist() == [0.5, 0.5, 0.5, 0, 0, 0, -1.0, -1.0, 0, 0, 2.0, 2.0, 0, 0]
    cut = spread_over_turns(mask[:11], [2, 7, 11], [0.5, -1.0, 2.0])  # the last turn cut at the response limit
    assert cut.tolist() == [0.5, 0.5, 0.5, 0, 0, 0, -1.0, -1.0, 0, 0, 2.0]
    with pytest.raises(ValueError, match="2 turn advantages for 3 turns"):
        spread_over_turns(mask, [2, 7, 11], [0.5, -1.0])


def test_an_env_s_state_key_names_the_state_instead_of_the_observation_text():
    from beyond_agent.rollout.episode_loop import STATE_KEY, TEXT_ANCHOR_PREFIX, state_anchor

    # Two texts of one state (e.g. the same room after different feedback) are one anchor when the env says so.
    assert state_anchor("You moved.\nSFFH", {STATE_KEY: "cell-4"}) == state_anchor("Nothing happens.\nSFFH",
                                                                                    {STATE_KEY: "cell-4"})
    assert state_anchor("SFFH", {STATE_KEY: "cell-4"}) != state_anchor("SFFH", {STATE_KEY: "cell-5"})
    assert state_anchor("SFFH", {}) == state_anchor("SFFH", None) != state_anchor("SFFG", {})
    assert state_anchor("cell-4", {}) != state_anchor("other", {STATE_KEY: "cell-4"})  # a key never equals a text
    assert state_anchor("SFFH", {}).startswith(TEXT_ANCHOR_PREFIX)  # GiGPO counts these turns
    assert not state_anchor("SFFH", {STATE_KEY: "cell-4"}).startswith(TEXT_ANCHOR_PREFIX)
