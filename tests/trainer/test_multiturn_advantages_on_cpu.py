"""verl's advantage estimators on multi-turn masks, against hand-worked numbers.

A multi-turn response interleaves policy tokens (mask 1) and environment tokens (mask 0):

    response:  a0  a1  o   o   a2  a3        (a = assistant turn, o = observation)
    mask:      1   1   0   0   1   1

What must hold for every estimator our configs use (grpo by default; gae, rloo, reinforce_plus_plus
are one key away): observation tokens get no advantage that reaches the loss, and the policy tokens get
what the same estimator gives on the sequence with the observation tokens removed. verl 0.9.0 passes;
these tests pin that down so an upgrade that breaks it fails here. The last test shows why collate puts
the reward on the last *policy* token.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo.core_algos import (
    agg_loss,
    compute_gae_advantage_return,
    compute_grpo_outcome_advantage,
    compute_reinforce_plus_plus_outcome_advantage,
    compute_rloo_outcome_advantage,
)

MASK = torch.tensor([[1, 1, 0, 0, 1, 1]], dtype=torch.float32)  # [1, response]
POLICY = MASK.bool()[0]


def outcome(reward: float, position: int = 5) -> torch.Tensor:
    scores = torch.zeros(1, 6)
    scores[0, position] = reward
    return scores


def test_grpo_gives_every_policy_token_its_groups_normalised_score_and_observations_zero():
    # Group "g" has scores 1, 0, 0, 1 -> mean 0.5, unbiased std 0.57735: advantages +-0.8660.
    rewards = torch.cat([outcome(r) for r in (1.0, 0.0, 0.0, 1.0)])
    mask = MASK.repeat(4, 1)
    advantages, _ = compute_grpo_outcome_advantage(rewards, mask, np.array(["g"] * 4))
    expected = torch.tensor([0.8660254, -0.8660254, -0.8660254, 0.8660254])
    assert torch.allclose(advantages[:, POLICY], expected[:, None].expand(4, 4), atol=1e-4)
    assert torch.count_nonzero(advantages[:, ~POLICY]) == 0


def test_rloo_uses_the_leave_one_out_mean_on_policy_tokens_only():
    # Scores 1, 0, 0 in one group: baselines are the other two's mean -> 1 - 0 = 1, 0 - 0.5 = -0.5 (twice).
    rewards = torch.cat([outcome(r) for r in (1.0, 0.0, 0.0)])
    mask = MASK.repeat(3, 1)
    advantages, _ = compute_rloo_outcome_advantage(rewards, mask, np.array(["g"] * 3))
    assert torch.allclose(advantages[:, POLICY], torch.tensor([1.0, -0.5, -0.5])[:, None].expand(3, 4))
    assert torch.count_nonzero(advantages[:, ~POLICY]) == 0


def test_reinforce_plus_plus_discounts_over_policy_tokens_only():
    # gamma 0.5, reward 1 on a3: returns a3=1, a2=0.5, a1=0.25, a0=0.125 (observations are not time steps).
    advantages, returns = compute_reinforce_plus_plus_outcome_advantage(outcome(1.0), MASK, config=AlgoConfig(gamma=0.5))
    assert torch.allclose(returns[0, POLICY], torch.tensor([0.125, 0.25, 0.5, 1.0]))
    assert torch.count_nonzero(returns[0, ~POLICY]) == 0 and torch.count_nonzero(advantages[0, ~POLICY]) == 0


def test_gae_skips_observation_values_and_equals_gae_on_the_policy_tokens_alone():
    # gamma = lam = 1, reward 1 on a3: raw advantage of each policy token is 1 - V(token) = 0.5, 0.75, 0.25, 0.5;
    # the observation tokens' values (9.0) must play no part. Whitened over the mask: mean 0.5, unbiased
    # std 0.2041 -> 0, 1.2247, -1.2247, 0.
    values = torch.tensor([[0.5, 0.25, 9.0, 9.0, 0.75, 0.5]])
    advantages, returns = compute_gae_advantage_return(outcome(1.0), values, MASK, gamma=1.0, lam=1.0)
    assert torch.allclose(advantages[0, POLICY], torch.tensor([0.0, 1.2247449, -1.2247449, 0.0]), atol=1e-4)
    assert torch.allclose(returns[0, POLICY], torch.ones(4))
    compact, _ = compute_gae_advantage_return(outcome(1.0, 3)[:, :4], values[:, POLICY], torch.ones(1, 4),
                                              gamma=1.0, lam=1.0)
    assert torch.allclose(advantages[0, POLICY], compact[0], atol=1e-5)


@pytest.mark.parametrize("estimator", ["gae", "reinforce_plus_plus"])
def test_a_reward_on_an_observation_token_would_be_lost(estimator):
    # Why collate puts the reward on the last policy token: an episode cut inside an observation ends on
    # a mask-0 token, and these estimators never read rewards at mask-0 positions.
    mask = torch.tensor([[1, 1, 0, 0, 1, 0]], dtype=torch.float32)
    on_observation, on_policy = outcome(1.0, position=5), outcome(1.0, position=4)
    if estimator == "gae":
        values = torch.zeros(1, 6)
        _, lost = compute_gae_advantage_return(on_observation, values, mask, gamma=1.0, lam=1.0)
        _, kept = compute_gae_advantage_return(on_policy, values, mask, gamma=1.0, lam=1.0)
    else:
        config = AlgoConfig(gamma=1.0)
        _, lost = compute_reinforce_plus_plus_outcome_advantage(on_observation, mask, config=config)
        _, kept = compute_reinforce_plus_plus_outcome_advantage(on_policy, mask, config=config)
    policy = mask.bool()[0]
    assert torch.count_nonzero(lost[0, policy]) == 0
    assert torch.allclose(kept[0, policy], torch.ones(3))


def shared_prefix_gradient(loss_agg_mode: str) -> float:
    """d loss / d delta at delta = 0, where delta raises the log-prob of the first turn every episode of one GRPO
    group took (the same action in the same state), through verl's own advantage and loss aggregation.

    The group: three successes of two turns (mask 1 1 0 0 1 1) and a failure that ended after its first turn
    (mask 1 1 0 0 0 0), as an episode that steps into a hole ends early."""
    success, failure = [1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 0]
    mask = torch.tensor([success, success, success, failure], dtype=torch.float32)
    rewards = torch.zeros(4, 6)
    rewards[:3, 5], rewards[3, 1] = 1.0, 0.0
    advantages, _ = compute_grpo_outcome_advantage(rewards, mask, np.array(["g"] * 4))
    delta = torch.zeros((), requires_grad=True)
    shared = torch.zeros(4, 6)
    shared[:, :2] = 1.0
    ratio = torch.exp(delta * shared)  # PPO's ratio at the sampling policy, moved only on the shared turn
    agg_loss(-advantages * ratio, mask, loss_agg_mode).backward()
    return float(delta.grad)


def test_seq_mean_token_mean_pushes_down_the_turn_a_whole_group_shared_when_its_failures_are_shorter():
    # What the loss aggregation (the recipe's `loss_agg_mode`) does to a turn a whole group shared: GRPO's
    # advantages sum to zero over a group (scores 1, 1, 1, 0 -> mean 0.75, unbiased std 0.5 -> +0.5, +0.5, +0.5,
    # -1.5), so that turn gets no net push when every token weighs the same (token-mean, or Dr. GRPO's constant
    # norm). seq-mean-token-mean divides each episode by its own length instead: the short failure's shared turn
    # weighs 2/2 of it, a success's 2/4: d loss / d delta = (3 * -0.5 * 2/4 + 1.5 * 2/2) / 4 = +0.1875, so every
    # update lowers the action the whole group agreed on when failures are the shorter episodes (FrozenLake's step
    # into a hole) and raises it when they are the longer ones (BabyAI's round-limit cuts): docs/benchmarks.md.
    assert shared_prefix_gradient("token-mean") == pytest.approx(0.0, abs=1e-7)
    assert shared_prefix_gradient("seq-mean-token-sum-norm") == pytest.approx(0.0, abs=1e-7)
    assert shared_prefix_gradient("seq-mean-token-mean") == pytest.approx(0.1875, abs=1e-5)
