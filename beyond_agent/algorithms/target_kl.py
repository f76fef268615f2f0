"""`beyond_agent.target_kl`: a step's actor updates stop once the policy has moved that far from the one that sampled
the batch (Stable-Baselines3's `target_kl`, Spinning Up's early stop of PPO's updates).

Why: PPO's clip bounds each token's ratio inside one update's objective, not how far several updates in a row take
the policy. On BabyAI at lr 1e-3 (issue #71) one seed of five ran away within a step (verl's `actor/ppo_kl` 0.21,
then 0.86, where the other seeds stayed at or below 0.021) and lost its lift; the healthy steps are left as they are.
What it does not do, measured on that env (docs/benchmarks.md, 2026-12-02): one update can take the policy far past
any target (0.05 -> 1.39 at lr 3e-3), so the stop bounds how many updates follow a runaway, not how far one goes, and
after one it can leave a step a single large update. Off by default.

`beyond_agent.target_kl_backtrack` bounds each update as well: every update taken is measured right after it, on its
own mini-batch (one forward pass without gradients), and an update that took the policy past the target is halved
until it is within it (a line search along the optimizer's step, as TRPO's along its own), at most
MAX_HALVINGS times, and undone if even that is too far; a step whose update had to be cut back takes no further
update. The optimizer's state (Adam's moments) keeps the gradient it saw: only the step it took is shortened. Its cost
is one forward pass per update, one more per halving, and one copy of the trained parameters (this rank's shards).

How, in each actor worker (installed once by `install`, through Ray's `__ray_call__`):
- the actor's loss function is wrapped so that every micro-batch it trains on also measures the drift of its tokens,
  k3 = r - 1 - log r with r = π_θ / π_old (non-negative per token, unbiased for KL(π_old ‖ π_θ) over tokens sampled
  from π_old, as SB3's `approx_kl`; verl's `ppo_kl` is the k1 mean, whose signs cancel);
- its engine's `optimizer_step` takes the mini-batch's token mean of that drift, over every data-parallel rank (one
  all-reduce, so every rank decides alike), before the mini-batch's update: the drift of the updates before it. Past
  the target, that update and the step's remaining ones are skipped (their gradients zeroed, no optimizer step; the
  grad norm verl logs for a skipped update is 0). The forward and backward passes of the skipped mini-batches still
  run (verl's loop over mini-batches has no exit); the learning-rate schedule advances as before.
- with backtracking, the engine's `train_batch` is wrapped: it copies the trained parameters before the update, and
  after it runs the mini-batch again through the engine's `infer_batch` with a loss that only measures;
- after each actor update the trainer takes each step's figures (`take_step_figures`): `beyond_agent/target_kl/`
  `kl_max` (the largest drift measured before an update), `updates` and `updates_skipped`; with backtracking also
  `kl_after_max` (the largest drift right after an update, before any halving), `kl_kept_max` (after it), `halvings`
  and `updates_undone`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from beyond_agent.seams import patch
from beyond_agent.weights.fingerprint import actor_training_worker

METRIC = "beyond_agent/target_kl/"

MAX_HALVINGS = 4
"""How many times backtracking halves an update past the target before it undoes it (1/16 is the least it keeps)."""


def check_target_kl(target_kl: float | None) -> None:
    """`beyond_agent.target_kl` is null (off) or a positive number."""
    if target_kl is not None and not (isinstance(target_kl, (int, float)) and not isinstance(target_kl, bool)
                                      and math.isfinite(target_kl) and target_kl > 0):
        raise ValueError(f"beyond_agent.target_kl={target_kl!r} is not valid; choose null (off) or a positive number, "
                         "e.g. 0.05 (the KL from the sampling policy past which a step's actor updates stop)")


TARGET_KL_STRATEGIES = ("fsdp", "fsdp2")
"""The actor strategies the stop is written for: every rank computes the loss of its own tokens, so one all-reduce
over the data-parallel group gives every rank the same drift (with pipeline stages only the last would)."""


def check_target_kl_backtrack(target_kl: float | None, backtrack: Any) -> None:
    """`beyond_agent.target_kl_backtrack` is a boolean, and true only beside a target."""
    if not isinstance(backtrack, bool):
        raise ValueError(f"beyond_agent.target_kl_backtrack={backtrack!r} is not valid; choose true or false")
    if backtrack and target_kl is None:
        raise ValueError("beyond_agent.target_kl_backtrack=true needs beyond_agent.target_kl (a positive number, e.g. "
                         "0.05): it halves an update until the drift is within that target")


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

    def __init__(self, engine: Any, target_kl: float, backtrack: bool = False):
        check_target_kl(target_kl)
        check_target_kl_backtrack(target_kl, backtrack)
        self.engine = engine
        self.target_kl = float(target_kl)
        self.backtrack = backtrack
        self._drift = [0.0, 0]  # this mini-batch's k3 sum and tokens, on this rank, so far
        self._measured: list[float] = []  # the step's mini-batches' drifts, before each update
        self._skipped = 0
        self.stopped = False  # whether this step's updates have stopped
        self._stepped = False  # whether the guarded optimizer step just ran
        self._after: list[float] = []  # backtracking: the drift right after each update, before any halving
        self._kept: list[float] = []  # ... and as kept
        self._halvings = 0
        self._undone = 0

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
                self.stopped = True
                self._skipped += 1
                self.engine.optimizer_zero_grad()
                return 0.0
            self._stepped = True
            return optimizer_step()
        return guarded_step

    def bounded(self, train_batch: Callable) -> Callable:
        """The engine's `train_batch` (one mini-batch's update), with backtracking (module docstring): an update that
        took the policy past the target on its own mini-batch is halved until within it, or undone."""
        def bounded_train_batch(data: Any, loss_function: Callable) -> Any:
            if self.stopped:  # the guard skips this update: nothing to copy or measure
                return train_batch(data=data, loss_function=loss_function)
            before = [value.detach().clone() for value in self._trained()]
            self._stepped = False
            outputs = train_batch(data=data, loss_function=loss_function)
            if self._stepped:
                self._bound_update(data, before)
            return outputs
        return bounded_train_batch

    def _bound_update(self, data: Any, before: list[torch.Tensor]) -> None:
        drift = self._drift_after(data)
        self._after.append(drift)
        halvings = 0
        while drift > self.target_kl and halvings < MAX_HALVINGS:
            # Why: the update's own data says it left the trust region; a shorter step along the same direction
            # keeps what it learnt within the target instead of throwing the step away.
            self._move_back(before, keep=0.5)
            halvings += 1
            drift = self._drift_after(data)
        if drift > self.target_kl:
            self._move_back(before, keep=0.0)
            self._undone += 1
            drift = self._measured[-1]  # back where the guard measured this mini-batch before the update
        self._kept.append(drift)
        self._halvings += halvings
        if halvings:
            self.stopped = True  # the policy stands at the target's edge: a further update would cross it

    def _trained(self) -> list[torch.Tensor]:
        """The parameters the engine's optimizer updates (this rank's shards)."""
        return [param for group in self.engine.optimizer.param_groups for param in group["params"]]

    @torch.no_grad()
    def _move_back(self, before: list[torch.Tensor], keep: float) -> None:
        """Each trained parameter to before + keep * (now - before): keep 0.5 halves the update, 0 undoes it."""
        for param, old in zip(self._trained(), before):
            if keep == 0.0:
                param.copy_(old)
            else:
                param.sub_(old).mul_(keep).add_(old)

    def _drift_after(self, data: Any) -> float:
        """The drift of the mini-batch at the parameters as they are now: a forward pass without gradients."""
        self.engine.infer_batch(data, loss_function=self._measure_only)
        return self._mini_batch_drift()

    def _measure_only(self, model_output: Any, data: Any, **_kwargs: Any) -> tuple[torch.Tensor, dict]:
        """A loss function for verl's forward passes that only adds the micro-batch's drift."""
        self._add(model_output, data)
        return torch.zeros(()), {}

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
        if self.backtrack:
            figures |= {f"{METRIC}kl_after_max": max(self._after, default=0.0),
                        f"{METRIC}kl_kept_max": max(self._kept, default=0.0),
                        f"{METRIC}halvings": float(self._halvings), f"{METRIC}updates_undone": float(self._undone)}
        self._measured, self._skipped, self.stopped = [], 0, False
        self._after, self._kept, self._halvings, self._undone = [], [], 0, 0
        return figures


def _collective_device() -> torch.device:
    """Where a tensor for the training engine's collectives lives (the accelerator; the CPU on a CPU run)."""
    from verl.utils.device import get_device_id, get_device_name

    name = get_device_name()
    return torch.device("cpu") if name == "cpu" else torch.device(name, get_device_id())


# ----- in each actor worker (Ray's `__ray_call__`) --------------------------------------------------------------------

_INSTALLED: list[TargetKLStop] = []
"""The stop of this process's actor (an actor worker process trains one actor)."""


def install(worker: Any, target_kl: float, backtrack: bool = False) -> None:
    """Put a TargetKLStop on this worker's actor: its loss measures, its engine's optimizer step is guarded, and with
    backtracking each mini-batch's update is bounded."""
    if _INSTALLED:
        raise RuntimeError("the target-KL stop is installed on this actor worker already")
    actor = actor_training_worker(worker)
    stop = TargetKLStop(actor.engine, target_kl, backtrack)
    actor.set_loss_fn(stop.measure(actor.loss_fn))
    patch(actor.engine, "optimizer_step", stop.guard(actor.engine.optimizer_step))
    if backtrack:
        patch(actor.engine, "train_batch", stop.bounded(actor.engine.train_batch))
    _INSTALLED.append(stop)


def take_step_figures(_worker: Any = None) -> dict[str, float]:
    """This actor worker's figures of the step just trained (`TargetKLStop.take`; Ray's `__ray_call__` passes the
    worker, unused)."""
    if not _INSTALLED:
        raise RuntimeError("no target-KL stop on this actor worker (install it first)")
    return _INSTALLED[0].take()
