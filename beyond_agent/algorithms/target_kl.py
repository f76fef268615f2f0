"""`beyond_agent.target_kl`: a step's actor updates stop once the policy has moved that far from the one that sampled
the batch (Stable-Baselines3's `target_kl`, Spinning Up's early stop of PPO's updates).

Why: PPO's clip bounds each token's ratio inside one update's objective, not how far several updates in a row take
the policy. On BabyAI at lr 1e-3 (issue #71) one seed of five ran away within a step (verl's `actor/ppo_kl` 0.21,
then 0.86, where the other seeds stayed at or below 0.021) and lost its lift; the healthy steps are left as they are.
What it does not do, measured on that env (docs/benchmarks.md, 2026-12-02): one update can take the policy far past
any target (0.05 -> 1.39 at lr 3e-3), so the stop bounds how many updates follow a runaway, not how far one goes, and
after one it can leave a step a single large update. Off by default.

How, in each actor worker (installed once by `install`, through Ray's `__ray_call__`):
- the actor's loss function is wrapped so that every micro-batch it trains on also measures the drift of its tokens,
  k3 = r - 1 - log r with r = π_θ / π_old (non-negative per token, unbiased for KL(π_old ‖ π_θ) over tokens sampled
  from π_old, as SB3's `approx_kl`; verl's `ppo_kl` is the k1 mean, whose signs cancel);
- its engine's `optimizer_step` takes the mini-batch's token mean of that drift, over every data-parallel rank (one
  all-reduce, so every rank decides alike), before the mini-batch's update: the drift of the updates before it. Past
  the target, that update and the step's remaining ones are skipped (their gradients zeroed, no optimizer step; the
  grad norm verl logs for a skipped update is 0). The forward and backward passes of the skipped mini-batches still
  run (verl's loop over mini-batches has no exit); the learning-rate schedule advances as before.
- after each actor update the trainer takes each step's figures (`take_step_figures`): `beyond_agent/target_kl/`
  `kl_max` (the largest drift measured before an update), `updates` and `updates_skipped`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from beyond_agent.seams import patch
from beyond_agent.weights.fingerprint import actor_training_worker

METRIC = "beyond_agent/target_kl/"


def check_target_kl(target_kl: float | None) -> None:
    """`beyond_agent.target_kl` is null (off) or a positive number."""
    if target_kl is not None and not (isinstance(target_kl, (int, float)) and not isinstance(target_kl, bool)
                                      and math.isfinite(target_kl) and target_kl > 0):
        raise ValueError(f"beyond_agent.target_kl={target_kl!r} is not valid; choose null (off) or a positive number, "
                         "e.g. 0.05 (the KL from the sampling policy past which a step's actor updates stop)")


TARGET_KL_STRATEGIES = ("fsdp", "fsdp2")
"""The actor strategies the stop is written for: every rank computes the loss of its own tokens, so one all-reduce
over the data-parallel group gives every rank the same drift (with pipeline stages only the last would)."""


def check_target_kl_strategy(target_kl: float | None, strategy: str) -> None:
    """`beyond_agent.target_kl` against the actor's strategy (`actor_rollout_ref.actor.strategy`)."""
    if target_kl is not None and strategy not in TARGET_KL_STRATEGIES:
        raise ValueError(f"beyond_agent.target_kl needs actor_rollout_ref.actor.strategy in "
                         f"{', '.join(TARGET_KL_STRATEGIES)}, got {strategy!r}: its stop decides from every "
                         "data-parallel rank's own loss tokens, which pipeline stages do not all see")


def drift_sum(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """The sum over the masked tokens of k3 = r - 1 - log r (r = exp(log_prob - old_log_prob)), and their count."""
    log_ratio = (log_prob.detach() - old_log_prob.detach()).to(torch.float64)[mask.to(torch.bool)]
    return float((torch.expm1(log_ratio) - log_ratio).sum()), int(log_ratio.numel())


class TargetKLStop:
    """The stop of one actor worker's updates (module docstring); `engine` is verl's training engine."""

    def __init__(self, engine: Any, target_kl: float):
        check_target_kl(target_kl)
        self.engine = engine
        self.target_kl = float(target_kl)
        self._drift = [0.0, 0]  # this mini-batch's k3 sum and tokens, on this rank, so far
        self._measured: list[float] = []  # the step's mini-batches' drifts, before each update
        self._skipped = 0

    @property
    def stopped(self) -> bool:
        """Whether this step's updates have stopped."""
        return self._skipped > 0

    def measure(self, loss_fn: Callable) -> Callable:
        """`loss_fn` (verl's actor loss) that also adds each trained micro-batch's drift to the mini-batch's."""
        def measured_loss(model_output: Any, data: Any, **kwargs: Any) -> Any:
            result = loss_fn(model_output=model_output, data=data, **kwargs)
            if torch.is_grad_enabled():  # a training forward: verl's log-prob passes run without gradients
                self._add(model_output, data)
            return result
        return measured_loss

    def _add(self, model_output: Any, data: Any) -> None:
        from verl.workers.utils.padding import no_padding_2_padding

        # The layout verl's own ppo_loss reads: log-probs of the response tokens against old_log_probs, masked.
        log_prob = no_padding_2_padding(model_output["log_probs"], data)
        fields = data.select("response_mask", "old_log_probs").to_padded_tensor()
        total, tokens = drift_sum(log_prob, fields["old_log_probs"], fields["response_mask"])
        self._drift[0] += total
        self._drift[1] += tokens

    def guard(self, optimizer_step: Callable[[], float]) -> Callable[[], float]:
        """The engine's `optimizer_step`, skipped once the drift before an update passes the target."""
        def guarded_step() -> float:
            drift = self._mini_batch_drift()
            self._measured.append(drift)
            if self.stopped or drift > self.target_kl:
                # Why: every further update would move the policy further from the one that sampled the batch
                # than the target allows; PPO's ratios are then no longer a trust region.
                self._skipped += 1
                self.engine.optimizer_zero_grad()
                return 0.0
            return optimizer_step()
        return guarded_step

    def _mini_batch_drift(self) -> float:
        """The token mean of k3 over the mini-batch on every data-parallel rank; resets the running sums."""
        drift_total, tokens = self._drift
        self._drift = [0.0, 0]
        if torch.distributed.is_initialized():
            totals = torch.tensor([drift_total, tokens], dtype=torch.float64, device=_collective_device())
            torch.distributed.all_reduce(totals, group=self.engine.get_data_parallel_group())
            drift_total, tokens = totals.tolist()
        return drift_total / tokens if tokens else 0.0

    def take(self) -> dict[str, float]:
        """The step's figures (metric names under METRIC); the next step starts afresh."""
        figures = {f"{METRIC}kl_max": max(self._measured, default=0.0), f"{METRIC}updates": float(len(self._measured)),
                   f"{METRIC}updates_skipped": float(self._skipped)}
        self._measured, self._skipped = [], 0
        return figures


def _collective_device() -> torch.device:
    """Where a tensor for the training engine's collectives lives (the accelerator; the CPU on a CPU run)."""
    from verl.utils.device import get_device_id, get_device_name

    name = get_device_name()
    return torch.device("cpu") if name == "cpu" else torch.device(name, get_device_id())


# ----- in each actor worker (Ray's `__ray_call__`) --------------------------------------------------------------------

_INSTALLED: list[TargetKLStop] = []
"""The stop of this process's actor (an actor worker process trains one actor)."""


def install(worker: Any, target_kl: float) -> None:
    """Put a TargetKLStop on this worker's actor: its loss measures, its engine's optimizer step is guarded."""
    if _INSTALLED:
        raise RuntimeError("the target-KL stop is installed on this actor worker already")
    actor = actor_training_worker(worker)
    stop = TargetKLStop(actor.engine, target_kl)
    actor.set_loss_fn(stop.measure(actor.loss_fn))
    patch(actor.engine, "optimizer_step", stop.guard(actor.engine.optimizer_step))
    _INSTALLED.append(stop)


def take_step_figures(_worker: Any = None) -> dict[str, float]:
    """This actor worker's figures of the step just trained (`TargetKLStop.take`; Ray's `__ray_call__` passes the
    worker, unused)."""
    if not _INSTALLED:
        raise RuntimeError("no target-KL stop on this actor worker (install it first)")
    return _INSTALLED[0].take()
