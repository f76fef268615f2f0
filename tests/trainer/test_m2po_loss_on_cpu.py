"""The M2PO policy loss (beyond_agent/algorithms/m2po.py) against hand-worked numbers and real verl config.

Notation: lr = log r = log π_θ − log π_old per token, Δ = −lr, "harmful" = (A > 0, r > 1) or (A < 0, r < 1).
The loss is max(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high)) with the window solved from the budget.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import get_policy_loss_fn
from verl.utils.config import omega_conf_to_dataclass

from beyond_agent.algorithms.m2po import (
    DEFAULT_M2PO_BUDGET,
    M2PO_BUDGET_KEY,
    M2POPolicyLossConfig,
    harmful_token_mask,
    m2po_clip_ranges,
    solve_m2_threshold,
)

# The recipe YAML sets this _target_ (and m2po_budget: 0.04); the tests name it again to be explicit.
TARGET = "actor_rollout_ref.actor.policy_loss._target_=beyond_agent.algorithms.M2POPolicyLossConfig"
VERL_OWN_CONFIG = "actor_rollout_ref.actor.policy_loss._target_=verl.workers.config.PolicyLossConfig"
E = math.e


def build_actor_config(repo_root: Path, *overrides: str):
    """The actor config as verl's workers build it: hydra-compose our recipe config, then
    omega_conf_to_dataclass(config.actor_rollout_ref.actor) (verl/workers/engine_workers.py, init_model)."""
    with initialize_config_dir(config_dir=str(repo_root / "recipe/multiturn_rl/config"), version_base=None):
        config = compose(config_name="beyond_agent_trainer", overrides=[
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.actor.policy_loss.loss_mode=m2po", *overrides])
    return omega_conf_to_dataclass(config.actor_rollout_ref.actor)


@pytest.fixture(scope="module")
def actor_config(repo_root: Path):
    """verl's plain PolicyLossConfig with loss_mode=m2po: the default budget, 0.04."""
    return build_actor_config(repo_root)


def m2po(log_ratio, advantages, mask, config, loss_agg_mode="token-mean", old=None):
    """Run the registered loss on lr = log_prob − old_log_prob; returns (loss, metrics, log_prob leaf)."""
    log_ratio = torch.as_tensor(log_ratio, dtype=torch.float32)
    old = torch.full_like(log_ratio, -1.5) if old is None else old
    log_prob = (old + log_ratio).detach().requires_grad_()
    loss, metrics = get_policy_loss_fn("m2po")(
        old_log_prob=old, log_prob=log_prob, advantages=torch.as_tensor(advantages, dtype=torch.float32),
        response_mask=torch.as_tensor(mask), loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=None)
    return loss, metrics, log_prob


# One sequence with A = +1, one with A = −1; the last token of the second is padding.
ADV = [[1.0] * 4, [-1.0] * 4]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]


# --- (a) on-policy data ------------------------------------------------------------------------------------

@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean"])
def test_on_policy_data_gives_the_vanilla_policy_gradient_loss(actor_config, loss_agg_mode):
    advantages = torch.tensor([[0.5, 0.5, 0.5, 0.5], [-1.0, -1.0, -1.0, 0.0], [2.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0], [-0.1, -4.0, -1.0, -2.0], [-2.0, -1.0, -7.0, -9.0]])
    loss, metrics, log_prob = m2po(torch.zeros(3, 4), advantages, mask, actor_config, loss_agg_mode, old=old)
    vanilla, _ = get_policy_loss_fn("vanilla")(old, old.clone(), advantages, mask, loss_agg_mode, actor_config)
    # token-mean: −(4·0.5 − 3·1 + 2·2)/9 = −3/9; seq-mean-token-mean: −(0.5 − 1 + 2)/3 = −0.5.
    expected = -3 / 9 if loss_agg_mode == "token-mean" else -0.5
    assert loss.item() == pytest.approx(expected, abs=1e-7)
    assert loss.item() == pytest.approx(vanilla.item(), abs=1e-7)
    assert metrics["actor/m2po_masked_fraction"] == 0.0
    assert metrics["actor/pg_clipfrac"] == 0.0
    assert metrics["actor/m2po_m2_before"] == metrics["actor/m2po_m2_after"] == 0.0
    assert (metrics["actor/m2po_clip_low"], metrics["actor/m2po_clip_high"]) == (1.0, 100.0)  # no window (inf, logged capped)
    assert metrics["actor/m2po_budget_binding"] == 0.0
    loss.backward()
    # d/d log_prob of −A·r at r = 1 is −A / (token count) for token-mean.
    if loss_agg_mode == "token-mean":
        assert torch.allclose(log_prob.grad, -advantages * mask / 9)


# --- (b) hand-worked stale batches -------------------------------------------------------------------------

def test_default_budget_hand_worked_batch_where_the_floors_set_the_window(actor_config):
    # lr per token (A = +1 | A = −1):  [0.1, 0.2, −0.3, 0.6] | [−0.1, 0.5, −0.8, pad]
    # Harmful: A>0 & lr>0 -> 0.1, 0.2, 0.6;  A<0 & lr<0 -> −0.1, −0.8.   (−0.3 and 0.5 are not harmful.)
    # Δ² sorted: [0.01, 0.01, 0.04, 0.36, 0.64], n = 5, sum 1.06 -> M2_before = 0.212 > 0.04.
    # Target sum 0.04·5 = 0.2.  f(v_k) = Σ_{i≤k} v_i + (n−1−k)·v_k:
    #   f(0.01) = 0.01 + 4·0.01 = 0.05;  f(0.01) = 0.02 + 3·0.01 = 0.05;  f(0.04) = 0.06 + 2·0.04 = 0.14 < 0.2;
    #   f(0.36) = 0.42 + 0.36 = 0.78 >= 0.2  ->  τ² = 0.04, τ = 0.2, M2_after = 0.14/5 = 0.028.
    # clip_low = max(1 − e^−0.2 = 0.181, 0.3) = 0.3;  clip_high = max(e^0.2 − 1 = 0.221, 0.5) = 0.5 -> [0.7, 1.5].
    # Clipped: lr 0.6 (r 1.822 > 1.5, A>0) -> 1.5;  lr −0.8 (r 0.449 < 0.7, A<0) -> 0.7.   2 of 7 tokens.
    # lr 0.5 with A<0 has r 1.649 > 1.5 but PPO's max keeps −A·r there: not clipped.
    # Loss = [−(e^.1 + e^.2 + e^−.3 + 1.5) + (e^−.1 + e^.5 + 0.7)] / 7
    #      = [−(1.105171 + 1.221403 + 0.740818 + 1.5) + (0.904837 + 1.648721 + 0.7)] / 7 = −1.313834/7
    loss, metrics, log_prob = m2po([[0.1, 0.2, -0.3, 0.6], [-0.1, 0.5, -0.8, 0.0]], ADV, MASK, actor_config)
    expected = (-(E**0.1 + E**0.2 + E**-0.3 + 1.5) + (E**-0.1 + E**0.5 + 0.7)) / 7
    assert expected == pytest.approx(-0.187691, abs=1e-6)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["actor/m2po_m2_before"] == pytest.approx(0.212, abs=1e-6)
    assert metrics["actor/m2po_m2_after"] == pytest.approx(0.028, abs=1e-6)
    assert metrics["actor/m2po_clip_low"] == pytest.approx(0.3)
    assert metrics["actor/m2po_clip_high"] == pytest.approx(0.5)
    assert metrics["actor/m2po_masked_fraction"] == pytest.approx(2 / 7)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(2 / 7)
    assert metrics["actor/ppo_kl"] == pytest.approx(-(0.1 + 0.2 - 0.3 + 0.6 - 0.1 + 0.5 - 0.8) / 7, abs=1e-6)


def test_budget_from_config_hand_worked_batch_where_tau_sets_the_window(repo_root):
    config = build_actor_config(repo_root, TARGET, "actor_rollout_ref.actor.policy_loss.m2po_budget=0.5")
    # lr (A = +1 | A = −1):  [0.5, 0.5, 2.0, −1.0] | [−0.5, −2.0, 0.3, pad]
    # Harmful Δ²: 0.25, 0.25, 4 (A>0)  and  0.25, 4 (A<0)  -> sorted [0.25, 0.25, 0.25, 4, 4], n = 5,
    # sum 8.75, M2_before = 1.75 > 0.5.  Target 0.5·5 = 2.5.
    #   f(0.25) = 0.25·5 = 1.25 (k = 0, 1, 2: 0.25+1.0, 0.5+0.75, 0.75+0.5) < 2.5;  f(4) = 4.75 + 4 = 8.75 >= 2.5
    #   -> τ² = 0.25, τ = 0.5, M2_after = 1.25/5 = 0.25.
    # clip_low = 1 − e^−0.5 = 0.393469 (> 0.3), clip_high = e^0.5 − 1 = 0.648721 (> 0.5): window [e^−.5, e^.5].
    # Clipped: lr 2.0 -> e^0.5 and lr −2.0 -> e^−0.5 (2 of 7). The ±0.5 tokens sit exactly on the bound: kept.
    # Loss = [−(3e^.5 + e^−1) + (2e^−.5 + e^.3)] / 7 = [−(4.946164 + 0.367879) + (1.213061 + 1.349859)] / 7
    loss, metrics, log_prob = m2po([[0.5, 0.5, 2.0, -1.0], [-0.5, -2.0, 0.3, 0.0]], ADV, MASK, config)
    expected = (-(3 * E**0.5 + E**-1) + (2 * E**-0.5 + E**0.3)) / 7
    assert expected == pytest.approx(-0.393018, abs=1e-6)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["actor/m2po_m2_before"] == pytest.approx(1.75)
    assert metrics["actor/m2po_m2_after"] == pytest.approx(0.25)
    assert metrics["actor/m2po_clip_low"] == pytest.approx(1 - E**-0.5)
    assert metrics["actor/m2po_clip_high"] == pytest.approx(E**0.5 - 1)
    assert metrics["actor/m2po_masked_fraction"] == pytest.approx(2 / 7)
    loss.backward()
    # Gradient of −A·r/7 w.r.t. log_prob is −A·r/7 where unclipped, 0 where clipped; the bound tokens keep it.
    expected_grad = torch.tensor([[-E**0.5, -E**0.5, 0.0, -E**-1], [E**-0.5, 0.0, E**0.3, 0.0]]) / 7
    assert torch.allclose(log_prob.grad, expected_grad, atol=1e-7)


def test_harmful_tokens_are_those_pushed_further_the_advantages_way_inside_the_response():
    ratio = torch.tensor([[1.5, 0.5, 1.0, 2.0], [1.5, 0.5, 1.0, 0.1], [3.0, 0.2, 1.0, 1.0]])
    advantages = torch.tensor([[1.0] * 4, [-1.0] * 4, [0.0] * 4])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 1, 1]])
    # A>0: r 1.5 yes, 0.5 no, 1.0 no, 2.0 is padding.  A<0: 0.5 and 0.1 yes.  A = 0: never.
    expected = torch.tensor([[True, False, False, False], [False, True, False, True], [False] * 4])
    assert torch.equal(harmful_token_mask(ratio, advantages, mask), expected)


@pytest.mark.parametrize(("values", "budget", "expected"), [
    # Mean 0.25 > 0.04 and f(0.25) = 0.5 >= 0.08 already at the smallest value: τ = 0, capped mean 0.
    ([0.25, 0.25], 0.04, (0.0, 0.25, 0.0, 2)),
    # Mean 0.03 <= 0.04: nothing capped.
    ([0.01, 0.05], 0.04, (math.inf, 0.03, 0.03, 2)),
    ([], 0.04, (math.inf, 0.0, 0.0, 0)),
    # Unsorted input: sorted [0.0001, 0.0004, 0.09, 1.0], target 0.4; f(0.09) = 0.0905 + 0.09 = 0.1805 < 0.4,
    # f(1.0) = 1.0905 >= 0.4 -> τ = 0.3, capped mean 0.1805/4.
    ([1.0, 0.0004, 0.09, 0.0001], 0.1, (0.3, 1.0905 / 4, 0.1805 / 4, 4)),
])
def test_solve_m2_threshold_on_small_vectors(values, budget, expected):
    got = solve_m2_threshold(torch.tensor(values, dtype=torch.float64), budget)
    assert got.tau == pytest.approx(expected[0]) and got.num_harmful == expected[3]
    assert got.m2_before == pytest.approx(expected[1]) and got.m2_after == pytest.approx(expected[2])


def test_clip_ranges_map_tau_and_apply_both_floors():
    assert m2po_clip_ranges(math.inf) == (1.0, math.inf)
    assert m2po_clip_ranges(0.0) == (0.3, 0.5)
    assert m2po_clip_ranges(0.2) == pytest.approx((0.3, 0.5))  # 0.181 -> 0.3, 0.221 -> 0.5
    assert m2po_clip_ranges(1.0) == pytest.approx((1 - E**-1, E - 1))
    assert m2po_clip_ranges(0.38) == pytest.approx((1 - E**-0.38, 0.5))  # the low floor lets go first


# --- (c) the threshold's guarantee on random batches -------------------------------------------------------

def random_batch(seed: int, tau_binds: bool):
    """16 x 64 tokens, right padding, per-sequence advantages (some 0). Default: |lr| ~ 0.3 everywhere, so τ
    lands below the floors. tau_binds: |lr| ~ 0.01 except six harmful tokens at random places with
    |lr| = 1, 1.2, 1.5, 2, 2.5, 3: with ~200+ harmful tokens, capping at 1² or 1.2² (6 + 0.0x, or 8.2 + 0.0x
    against a target 0.04·n > 8) keeps the budget, so τ is wider than the [0.7, 1.5] floors."""
    g = torch.Generator().manual_seed(seed)
    batch, length = 16, 64
    lengths = torch.randint(4, length + 1, (batch,), generator=g)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    advantages = torch.randint(-2, 3, (batch, 1), generator=g).float().expand(batch, length) * mask
    old = -torch.rand(batch, length, generator=g) * 5
    if not tau_binds:
        return torch.randn(batch, length, generator=g) * 0.3, advantages, mask, old
    log_ratio = torch.randn(batch, length, generator=g) * 0.01
    candidates = torch.nonzero(advantages != 0)
    places = candidates[torch.randperm(len(candidates), generator=g)[:6]]
    for (row, column), size in zip(places.tolist(), [1.0, 1.2, 1.5, 2.0, 2.5, 3.0]):
        log_ratio[row, column] = size * float(torch.sign(advantages[row, column]))
    return log_ratio, advantages, mask, old


def expected_clipped(log_ratio, advantages, mask, clip_low, clip_high):
    """Independently, in float64: tokens where PPO's clipped term is the active, larger one."""
    r = torch.exp(log_ratio.double())
    a = advantages.double()
    clipped_term, plain_term = -a * torch.clamp(r, 1 - clip_low, 1 + clip_high), -a * r
    return mask & (clipped_term - plain_term > 1e-9 * plain_term.abs())  # the tolerance spares the bound token


@pytest.mark.parametrize("tau_binds", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_capped_second_moment_is_within_budget_and_masked_fraction_counts_clipped_tokens(actor_config, seed, tau_binds):
    log_ratio, advantages, mask, old = random_batch(seed, tau_binds)
    loss, metrics, _ = m2po(log_ratio, advantages, mask, actor_config, old=old)
    # The harmful tokens' Δ², found independently of the module.
    log_prob = old + log_ratio  # as m2po() builds it
    lr = (log_prob - old).double()
    harmful = mask & (((advantages > 0) & (lr > 0)) | ((advantages < 0) & (lr < 0)))
    delta_sq = lr[harmful] ** 2
    assert metrics["actor/m2po_m2_before"] == pytest.approx(delta_sq.mean().item(), abs=1e-9)
    assert delta_sq.mean().item() > DEFAULT_M2PO_BUDGET  # the budget is active in every case here
    threshold = solve_m2_threshold(delta_sq, DEFAULT_M2PO_BUDGET)
    capped = torch.clamp(delta_sq, max=threshold.tau**2).mean().item()
    assert capped <= DEFAULT_M2PO_BUDGET + 1e-6
    assert metrics["actor/m2po_m2_after"] == pytest.approx(capped, abs=1e-9)
    # τ is the largest breakpoint that keeps the budget: capping at the next larger Δ² would break it.
    next_value = delta_sq[delta_sq > threshold.tau**2 + 1e-15].min()
    assert torch.clamp(delta_sq, max=next_value).mean().item() >= DEFAULT_M2PO_BUDGET
    clip_low, clip_high = metrics["actor/m2po_clip_low"], metrics["actor/m2po_clip_high"]
    assert (clip_low, clip_high) == pytest.approx(m2po_clip_ranges(threshold.tau))
    assert (clip_high > 0.5) == tau_binds
    clipped = expected_clipped(lr, advantages, mask, clip_low, clip_high)
    assert int(clipped.sum()) > 0
    assert metrics["actor/m2po_masked_fraction"] == pytest.approx(int(clipped.sum()) / int(mask.sum()))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(metrics["actor/m2po_masked_fraction"])


# --- gradients --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tau_binds", [False, True])
def test_clipped_tokens_carry_zero_gradient_and_the_rest_the_plain_one(actor_config, tau_binds):
    log_ratio, advantages, mask, old = random_batch(7, tau_binds)
    loss, metrics, log_prob = m2po(log_ratio, advantages, mask, actor_config, old=old)
    loss.backward()
    lr = (log_prob - old).detach()
    clipped = expected_clipped(lr, advantages, mask, metrics["actor/m2po_clip_low"], metrics["actor/m2po_clip_high"])
    assert int(clipped.sum()) > 0
    assert torch.all(log_prob.grad[clipped] == 0)
    # Everywhere else: d(−A·r / N)/d log_prob = −A·r / N (0 on padding and where A = 0).
    plain = -advantages * torch.exp(lr) * mask / mask.sum()
    assert torch.allclose(log_prob.grad[~clipped], plain[~clipped], atol=1e-7)
    assert torch.count_nonzero(log_prob.grad[~clipped & (advantages != 0)]) == int((~clipped & (advantages != 0)).sum())


# --- (d) padding --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("loss_agg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("tau_binds", [False, True])
def test_padding_never_changes_the_result(actor_config, loss_agg_mode, tau_binds):
    log_ratio, advantages, mask, old = random_batch(3, tau_binds)
    loss, metrics, log_prob = m2po(log_ratio, advantages, mask, actor_config, loss_agg_mode, old=old)
    loss.backward()
    # Garbage under mask 0: in the existing padding, in 5 extra columns and in one all-padding row, with
    # huge "harmful-looking" ratios and advantages that would move the threshold if they counted.
    g = torch.Generator().manual_seed(99)
    batch, length = log_ratio.shape
    padded_shape = (batch + 1, length + 5)
    big_lr = torch.randn(padded_shape, generator=g) * 30
    big_adv = torch.sign(big_lr) * 1e3
    big_old = -torch.rand(padded_shape, generator=g) * 50
    padded_mask = torch.zeros(padded_shape, dtype=torch.bool)
    padded_mask[:batch, :length] = mask
    keep = padded_mask.clone()
    padded_lr = torch.where(keep, torch.nn.functional.pad(log_ratio, (0, 5, 0, 1)), big_lr)
    padded_adv = torch.where(keep, torch.nn.functional.pad(advantages, (0, 5, 0, 1)), big_adv)
    padded_old = torch.where(keep, torch.nn.functional.pad(old, (0, 5, 0, 1)), big_old)
    loss2, metrics2, log_prob2 = m2po(padded_lr, padded_adv, padded_mask, actor_config, loss_agg_mode, old=padded_old)
    loss2.backward()
    assert loss2.item() == pytest.approx(loss.item(), abs=1e-7)
    assert metrics2 == pytest.approx(metrics, abs=1e-7)
    assert torch.equal(log_prob2.grad[:batch, :length], log_prob.grad)
    assert torch.count_nonzero(log_prob2.grad[~padded_mask]) == 0


# --- (e) the config route ---------------------------------------------------------------------------------

def test_an_extra_key_on_verls_own_policy_loss_config_does_not_survive(repo_root):
    # Why the _target_ override exists: verl instantiates policy_loss as PolicyLossConfig(**node).
    with pytest.raises(Exception, match="unexpected keyword argument 'm2po_budget'"):
        build_actor_config(repo_root, VERL_OWN_CONFIG, "actor_rollout_ref.actor.policy_loss.m2po_budget=0.05")


def test_the_budget_reaches_the_registered_loss_through_the_actor_config(repo_root, actor_config):
    config = build_actor_config(repo_root, TARGET, "actor_rollout_ref.actor.policy_loss.m2po_budget=0.05")
    assert isinstance(config.policy_loss, M2POPolicyLossConfig)
    assert config.policy_loss.m2po_budget == 0.05 and config.policy_loss.loss_mode == "m2po"
    # Harmful Δ² [0.01, 0.04, 0.09] (lr 0.1, 0.2, 0.3, A = +1): mean 0.04667 is over 0.04, under 0.05.
    batch = ([[0.1, 0.2, 0.3]], [[1.0, 1.0, 1.0]], [[1, 1, 1]])
    assert m2po(*batch, config)[1]["actor/m2po_budget_binding"] == 0.0  # 0.05: within budget, no window
    assert m2po(*batch, actor_config)[1]["actor/m2po_clip_high"] == 0.5  # default 0.04: clipped to the floors
    recipe_default = build_actor_config(repo_root)
    assert isinstance(recipe_default.policy_loss, M2POPolicyLossConfig)
    assert recipe_default.policy_loss.m2po_budget == DEFAULT_M2PO_BUDGET == 0.04


@pytest.mark.parametrize(("override", "value"), [
    ("0", 0), ("-0.1", -0.1), ("abc", "abc"), ("nan", math.nan), ("inf", math.inf), ("true", True), ("null", None)])
def test_a_bad_budget_fails_naming_the_key(repo_root, override, value):
    with pytest.raises(Exception, match=M2PO_BUDGET_KEY):  # at worker start-up, from the config's __post_init__
        build_actor_config(repo_root, TARGET, f"actor_rollout_ref.actor.policy_loss.m2po_budget={override}")
    # The loss checks too, whatever config object it is handed.
    config = OmegaConf.create({"policy_loss": {"loss_mode": "m2po", "m2po_budget": value}})
    with pytest.raises(ValueError, match=M2PO_BUDGET_KEY):
        m2po([[0.1]], [[1.0]], [[1]], config)


# --- (f) registration in a fresh process ------------------------------------------------------------------

@pytest.mark.startup  # a fresh process importing verl: the full run only
def test_import_verl_registers_m2po_through_the_entry_point(tmp_path):
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="verl.plugins")}
    assert names.get("beyond_agent_algos") == "beyond_agent.algorithms", (
        "entry point missing: run `.venv/bin/python -m uv pip install --python .venv/bin/python --no-deps -e .`")
    code = ("import sys, verl\n"
            "assert 'beyond_agent.algorithms.m2po' in sys.modules, 'plugin not imported by import verl'\n"
            "from verl.trainer.ppo.core_algos import get_policy_loss_fn\n"
            "print(get_policy_loss_fn('m2po').__module__)\n")
    env = {key: value for key, value in os.environ.items() if key not in ("VERL_USE_EXTERNAL_PLUGINS", "PYTHONPATH")}
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "beyond_agent.algorithms.m2po"
