"""GiGPO's advantages (beyond_agent.algorithms.gigpo) on a batch worked by hand: two groups that share an
observation text (never one anchor group across groups), shared and unshared anchor states, a turn cut by
length (the env did not step: reward 0), an episode whose env never stepped (no turns), gamma and omega; and a
cut episode's forfeit, counted whole at every turn, so that stalling never beats losing (#69)."""

from __future__ import annotations

import math

import pytest
import torch

from beyond_agent.algorithms.gigpo import (EpisodeSteps, GiGPOConfig, discounted_returns, gigpo_advantages,
                                           spread_over_turns, step_advantages)

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


# ---- a limit cut is a forfeit (issue #69) --------------------------------------------------------------------
# One group from state s0: W wins in 3 turns, L loses in 3 (through s1), S stalls at s0 for 4 turns until the limit
# and T plays L's first move, then stalls at s1. The rollout added the forfeit F = -1 to each cut episode's last
# step reward (rollout/episode_loop.py) and says so in `forfeit`.
WIN = EpisodeSteps("g", 1.0, (0.0, 0.0, 1.0), ("s0", "w1", "w2"))
LOSS = EpisodeSteps("g", 0.0, (0.0, 0.0, -1.0), ("s0", "s1", "l2"))
STALL = EpisodeSteps("g", 0.0, (0.0, 0.0, 0.0, -1.0), ("s0",) * 4, forfeit=-1.0)
LATE_STALL = EpisodeSteps("g", 0.0, (0.0, 0.0, 0.0, -1.0), ("s0", "s1", "s1", "s1"), forfeit=-1.0)


def test_a_cut_episodes_forfeit_counts_whole_at_every_turn_hand_worked():
    found = gigpo_advantages([WIN, LOSS, STALL, LATE_STALL], GiGPOConfig(gamma=0.95, omega=1.0), "mean")
    # A^E (mean only): rewards 1, 0, 0, 0 (mean 0.25) -> 0.75, -0.25, -0.25, -0.25.
    # Returns: W 0.9025, 0.95, 1; L -0.9025, -0.95, -1; S and T -1 at every turn (real rewards 0, plus F whole).
    # (g, s0): W 0.9025, L -0.9025, S -1 x 4, T -1: mean -5/7 -> A^S 1.6167857, -0.1882143, -0.2857143.
    # (g, s1): L -0.95, T -1 x 3: mean -0.9875 -> +0.0375, -0.0125. w1, w2, l2 alone -> 0.
    assert found.turns[0] == pytest.approx([0.75 + 1.6167857, 0.75, 0.75])
    assert found.turns[1] == pytest.approx([-0.25 - 0.1882143, -0.25 + 0.0375, -0.25])
    assert found.turns[2] == pytest.approx([-0.25 - 0.2857143] * 4)
    assert found.turns[3] == pytest.approx([-0.25 - 0.2857143] + [-0.25 - 0.0125] * 3)
    # Discounted like a step reward (the seated path before #69), stalling at s0 was worth -0.95^3 = -0.857375 there,
    # above the loss's -0.9025: F counted whole is what closes that.
    discounted = gigpo_advantages([WIN, LOSS, EpisodeSteps("g", 0.0, STALL.step_rewards, STALL.anchors)],
                                  GiGPOConfig(gamma=0.95), "mean")
    assert discounted.step[2][0] > discounted.step[1][0]


@pytest.mark.parametrize("gamma", [0.95, 1.0])
@pytest.mark.parametrize("norm", ["std", "mean"])
def test_from_any_state_stalling_never_beats_losing(gamma, norm):
    """Every turn of S and T ranks at or below L's turn from the same state; with gamma 1 the loss's returns are -1,
    equal to the forfeit's (not above)."""
    found = gigpo_advantages([WIN, LOSS, STALL, LATE_STALL], GiGPOConfig(gamma=gamma), norm)
    loss = dict(zip(LOSS.anchors, found.turns[1]))
    for stalled, episode in ((found.turns[2], STALL), (found.turns[3], LATE_STALL)):
        for value, anchor in zip(stalled, episode.anchors):
            assert value <= loss[anchor] + 1e-9


def test_a_per_call_segments_returns_run_on_to_the_forfeit_and_count_it_whole():
    """A per_call episode cut after two segments: the first (turn from s0, reward 0) runs on through the second's
    turn (0 + F = -1); with the episode's forfeit both turns' returns are 0 + (-1) = -1, not 0.95 * -1."""
    first = EpisodeSteps("g", 0.0, (0.0,), ("s0",), later_rewards=(-1.0,), forfeit=-1.0)
    last = EpisodeSteps("g", 0.0, (-1.0,), ("s0",), forfeit=-1.0)
    lost = EpisodeSteps("g", 0.0, (0.0, -1.0), ("s0", "s1"))  # R_0 = -0.95
    step, _ = step_advantages([first, last, lost], 0.95, "mean")
    # (g, s0): -1, -1, -0.95 -> mean -0.983333: -0.016667, -0.016667, +0.033333.
    assert [step[0][0], step[1][0], step[2][0]] == pytest.approx([-1 / 60, -1 / 60, 1 / 30])
