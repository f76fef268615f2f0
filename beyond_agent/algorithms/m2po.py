r"""M2PO: a second-moment trust region for stale (off-policy) data, as a verl policy loss.

Zheng, Zhao, Chen, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?"
(arXiv 2510.01161). With r_t = π_θ(y_t | ·) / π_old(y_t | ·) per response token (π_old: the policy whose
log-probs verl stores as ``old_log_probs``), the paper bounds the second moment of the log-ratio

    M̂₂ = (1/N) Σ_t (log r_t)²  ≤  τ_M2

by masking the most extreme tokens until the tokens kept satisfy it. The authors' code
(Infini-AI-Lab/M2PO, ``compute_m2po_policy_loss``) does this as a PPO clip whose range is solved per batch;
that is the semantics implemented here:

1. Harmful tokens H: response tokens with (A > 0 and r > 1) or (A < 0 and r < 1).
2. With Δ_t = log π_old − log π_θ = −log r_t and n = |H|: M2_before = (1/n) Σ_{t∈H} Δ_t². If
   M2_before ≤ budget nothing is clipped (τ = ∞). Otherwise τ² is the largest breakpoint Δ_j² (j ∈ H)
   with (1/n) Σ_{t∈H} min(Δ_t², Δ_j²) < budget (τ = 0 if there is none); M2_after is that capped mean.
3. clip_low = max(1 − e^{−τ}, 0.3), clip_high = max(e^{τ} − 1, 0.5): the ratio window
   [1 − clip_low, 1 + clip_high] = [min(e^{−τ}, 0.7), max(e^{τ}, 1.5)].
4. L = agg_loss(max(−A·r, −A·clip(r, 1 − clip_low, 1 + clip_high))), with the actor's ``loss_agg_mode``.

log r is first clamped to ±20, as verl's vanilla loss does. On-policy data (r = 1) clips nothing, so the
loss is the plain policy gradient loss, −mean(A) for token-mean. The budget is
``actor_rollout_ref.actor.policy_loss.m2po_budget`` (default 0.04, the authors' ``M2_budget``); see
``M2POPolicyLossConfig`` for how it reaches the loss.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import torch
from omegaconf import DictConfig

import verl.utils.torch_functional as verl_F
from verl.trainer.ppo.core_algos import agg_loss, register_policy_loss
from verl.workers.config import ActorConfig, PolicyLossConfig

__all__ = [
    "DEFAULT_M2PO_BUDGET",
    "M2PO_BUDGET_KEY",
    "MIN_CLIP_LOW",
    "MIN_CLIP_HIGH",
    "M2POPolicyLossConfig",
    "M2Threshold",
    "compute_policy_loss_m2po",
    "harmful_token_mask",
    "m2po_budget_from_config",
    "m2po_clip_ranges",
    "m2po_log_ratio_bounds",
    "solve_m2_threshold",
    "validate_m2po_budget",
]

DEFAULT_M2PO_BUDGET = 0.04  # the authors' M2_budget
M2PO_BUDGET_KEY = "actor_rollout_ref.actor.policy_loss.m2po_budget"
# The reference's `miniclip_low` / `miniclip_high`: the window is never narrower than [0.7, 1.5].
MIN_CLIP_LOW = 0.3
LOGGED_CLIP_HIGH_CAP = 100.0  # the logged stand-in for "no upper bound" (inf)
MIN_CLIP_HIGH = 0.5
# Same stability clamp on log r as verl's vanilla loss, so exp() stays finite.
_LOG_RATIO_LIMIT = 20.0


def validate_m2po_budget(value: Any) -> float:
    """Return ``value`` as a float if it is a usable M2 budget (a finite number > 0); else raise ValueError.

    The error names the config key, ``actor_rollout_ref.actor.policy_loss.m2po_budget``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{M2PO_BUDGET_KEY} must be a number > 0 (the M2PO second-moment budget, "
                         f"default {DEFAULT_M2PO_BUDGET}); got {value!r} ({type(value).__name__})")
    budget = float(value)
    if not math.isfinite(budget) or budget <= 0:
        raise ValueError(f"{M2PO_BUDGET_KEY} must be a finite number > 0 (the M2PO second-moment budget, "
                         f"default {DEFAULT_M2PO_BUDGET}); got {value!r}")
    return budget


@dataclass
class M2POPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus ``m2po_budget``, the M2PO second-moment budget.

    verl's workers build the actor config with hydra's ``instantiate`` from each node's ``_target_``, so
    an unknown key such as ``m2po_budget`` makes ``PolicyLossConfig.__init__`` fail. Pointing the
    policy_loss node at this class lets the key through::

        actor_rollout_ref.actor.policy_loss.loss_mode=m2po
        actor_rollout_ref.actor.policy_loss._target_=beyond_agent.algorithms.M2POPolicyLossConfig
        +actor_rollout_ref.actor.policy_loss.m2po_budget=0.04

    Without the last two lines the loss uses the default budget, 0.04.
    """

    m2po_budget: float = DEFAULT_M2PO_BUDGET

    def __post_init__(self):
        """Reject an unusable budget when the worker builds its config, not at the first update."""
        parent_post_init = getattr(super(), "__post_init__", None)
        if parent_post_init is not None:
            parent_post_init()
        validate_m2po_budget(self.m2po_budget)


def m2po_budget_from_config(config: Optional[DictConfig | ActorConfig]) -> float:
    """The budget at ``config.policy_loss.m2po_budget`` (an ActorConfig or its DictConfig), validated.

    A policy_loss without the key (verl's plain ``PolicyLossConfig``) gives ``DEFAULT_M2PO_BUDGET``;
    a key that is present must hold a finite number > 0 (ValueError naming the key otherwise).
    """
    if config is None:
        raise ValueError("the m2po policy loss needs the actor config (config=None was passed)")
    policy_loss = config.get("policy_loss", None)
    absent = object()  # `in` does not work on verl's BaseConfig (its __getitem__ raises AttributeError)
    value = absent if policy_loss is None else policy_loss.get("m2po_budget", absent)
    return DEFAULT_M2PO_BUDGET if value is absent else validate_m2po_budget(value)


def harmful_token_mask(ratio: torch.Tensor, advantages: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Boolean mask of the response tokens whose ratio moved in the direction the update rewards.

    Harmful = (A > 0 and r > 1) or (A < 0 and r < 1), within ``response_mask``. Only these tokens enter
    the second moment: PPO's max(−A·r, −A·clip(r)) only ever clips on these sides, so they are the ones
    the threshold can act on. The reference takes each sequence's advantage sign from its first response
    token; this uses each token's own sign, which is the same for per-sequence (GRPO-style) advantages
    and right for per-token ones.
    """
    # Why A > 0 with r > 1: the update already pushed the probability up; more push is the risk.
    pushed_up = (advantages > 0) & (ratio > 1.0)
    # Why A < 0 with r < 1: the update already pushed the probability down; more push is the risk.
    pushed_down = (advantages < 0) & (ratio < 1.0)
    # Why the response mask: padding and environment tokens are no part of the policy's step.
    return (pushed_up | pushed_down) & response_mask.bool()


class M2Threshold(NamedTuple):
    """The solved cap: |Δ| ≤ tau keeps a harmful token (tau = inf: nothing capped)."""

    tau: float
    m2_before: float  # mean Δ² over the harmful tokens (0.0 when there are none)
    m2_after: float  # mean min(Δ², tau²) over the harmful tokens
    num_harmful: int


def solve_m2_threshold(delta_sq: torch.Tensor, budget: float) -> M2Threshold:
    """Solve the M2PO cap τ for the harmful tokens' squared log-ratios ``delta_sq`` (any shape).

    With v sorted ascending and n values, f(t) = Σ_i min(v_i, t) is piecewise linear in t with breakpoints
    at the v_k: f(v_k) = Σ_{i≤k} v_i + (n − 1 − k)·v_k, one cumulative sum for all k. As in the reference,
    τ² is the breakpoint just below the first k with f(v_k) ≥ budget·n, so the capped mean stays below the
    budget and τ is some token's own |Δ|; τ = 0 when even the smallest value is too large, and τ = inf when
    the mean is already within budget. Solved on the CPU in float64: no Python loop over tokens, and the
    result depends only on the values, not on the accelerator's kernels.
    """
    values = delta_sq.detach().reshape(-1).to(device="cpu", dtype=torch.float64)
    n = values.numel()
    if n == 0:
        return M2Threshold(math.inf, 0.0, 0.0, 0)
    values, _ = torch.sort(values)
    prefix = torch.cumsum(values, dim=0)
    total = float(prefix[-1])
    m2_before = total / n
    target = budget * n
    if total <= target:
        return M2Threshold(math.inf, m2_before, m2_before, n)
    capped_sums = prefix + values * torch.arange(n - 1, -1, -1, dtype=torch.float64)  # f(v_k)
    # First k with f(v_k) >= target; it exists because f(v_{n-1}) = total > target.
    first = int(torch.argmax((capped_sums >= target).to(torch.uint8)))
    if first == 0:
        return M2Threshold(0.0, m2_before, 0.0, n)
    return M2Threshold(math.sqrt(float(values[first - 1])), m2_before, float(capped_sums[first - 1]) / n, n)


def _exp(x: float) -> float:
    return math.inf if x > 700.0 else math.exp(x)


def m2po_clip_ranges(tau: float, min_clip_low: float = MIN_CLIP_LOW,
                     min_clip_high: float = MIN_CLIP_HIGH) -> tuple[float, float]:
    """PPO clip ranges (clip_low, clip_high) for the cap τ: the window is [1 − clip_low, 1 + clip_high].

    |Δ| ≤ τ maps to e^{−τ} ≤ r ≤ e^{τ}: clip_low = 1 − e^{−τ} and clip_high = e^{τ} − 1; then both are
    floored, at 0.3 and 0.5, as the reference does, so the window is never narrower than [0.7, 1.5].
    τ = inf gives (1.0, inf): no clipping at all.
    """
    # Why floors: the reference never lets the trust region get tighter than PPO-like [0.7, 1.5].
    clip_low = max(1.0 - _exp(-tau), min_clip_low)
    clip_high = max(_exp(tau) - 1.0, min_clip_high)
    return clip_low, clip_high


def m2po_log_ratio_bounds(tau: float, min_clip_low: float = MIN_CLIP_LOW,
                          min_clip_high: float = MIN_CLIP_HIGH) -> tuple[float, float]:
    """The window of ``m2po_clip_ranges`` as bounds on log r: (min(−τ, log 0.7), max(τ, log 1.5)).

    The loss clamps log r against these, so a token whose |Δ| is exactly τ (there is always one when τ
    is set by the budget) stays unclipped and keeps its gradient, with no exp/log rounding in the way.
    """
    return min(-tau, math.log1p(-min_clip_low)), max(tau, math.log1p(min_clip_high))


@register_policy_loss("m2po")
def compute_policy_loss_m2po(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Optional[DictConfig | ActorConfig] = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """M2PO policy loss (module docstring), with verl 0.9's registered-loss signature and return value.

    Args:
        old_log_prob: log π_old per token, (batch, response_length).
        log_prob: log π_θ per token, same shape; the gradient flows through it.
        advantages: A per token, same shape.
        response_mask: 1 for the policy's tokens, 0 for padding and environment tokens.
        loss_agg_mode: verl's ``agg_loss`` mode (the actor's ``loss_agg_mode``).
        config: the actor config; ``config.policy_loss.m2po_budget`` is the budget and
            ``config.global_batch_info`` goes to ``agg_loss`` as in verl's vanilla loss.
        rollout_is_weights: verl's rollout-correction weights, multiplied into the per-token loss.

    Returns:
        (pg_loss, metrics): the scalar loss, and floats ``actor/pg_clipfrac``, ``actor/ppo_kl``,
        ``actor/m2po_m2_before``, ``actor/m2po_m2_after``, ``actor/m2po_masked_fraction`` (clipped response
        tokens / response tokens), ``actor/m2po_clip_low``, ``actor/m2po_clip_high`` (logged capped at
        ``LOGGED_CLIP_HIGH_CAP``: it is inf when nothing needed clipping) and ``actor/m2po_budget_binding``
        (1.0 when the budget set the window, 0.0 when the data was within it).

    τ is solved per call, i.e. per micro-batch on each data-parallel rank, as in the reference; ranks with
    different data get different windows.
    """
    budget = m2po_budget_from_config(config)
    mask = response_mask.bool()
    # Padded log-probs may hold anything (even inf/nan); a zero log-ratio there keeps them out of sums and grads.
    log_ratio = torch.where(mask, log_prob - old_log_prob, torch.zeros_like(log_prob))
    log_ratio = torch.clamp(log_ratio, min=-_LOG_RATIO_LIMIT, max=_LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)

    with torch.no_grad():
        harmful = harmful_token_mask(ratio, advantages, mask)
        # Squared in float64, where a float32 value's square is exact, so τ is exactly some token's |Δ|.
        threshold = solve_m2_threshold(log_ratio[harmful].to(torch.float64).square(), budget)
    clip_low, clip_high = m2po_clip_ranges(threshold.tau)
    log_lower, log_upper = m2po_log_ratio_bounds(threshold.tau)

    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.exp(torch.clamp(log_ratio, min=log_lower, max=log_upper))
    pg_losses = torch.maximum(pg_losses1, pg_losses2)
    if rollout_is_weights is not None:
        pg_losses = pg_losses * rollout_is_weights
    global_batch_info = (config.get("global_batch_info", None) if config is not None else None) or {}
    pg_loss = agg_loss(loss_mat=pg_losses, loss_mask=response_mask, loss_agg_mode=loss_agg_mode, **global_batch_info)

    with torch.no_grad():
        # Clipped = a harmful token outside the window: its loss term is the constant bound (zero gradient).
        clipped = harmful & ((log_ratio > log_upper) | (log_ratio < log_lower))
        num_response_tokens = int(mask.sum())
        masked_fraction = int(clipped.sum()) / num_response_tokens if num_response_tokens else 0.0
        pg_clipfrac = verl_F.masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
        ppo_kl = verl_F.masked_mean(-log_ratio, response_mask)

    metrics = {
        "actor/pg_clipfrac": pg_clipfrac.item(),
        "actor/ppo_kl": ppo_kl.item(),
        "actor/m2po_m2_before": threshold.m2_before,
        "actor/m2po_m2_after": threshold.m2_after,
        "actor/m2po_masked_fraction": masked_fraction,
        "actor/m2po_clip_low": clip_low,
        # Logged capped: "no upper bound" is inf, and one inf micro-batch would make the step's mean inf.
        "actor/m2po_clip_high": min(clip_high, LOGGED_CLIP_HIGH_CAP),
        "actor/m2po_budget_binding": float(math.isfinite(threshold.tau)),
    }
    return pg_loss, metrics
