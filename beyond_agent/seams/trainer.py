"""verl's PPO trainer with its private helpers turned into named hooks: the only overrides of RayPPOTrainer's
private methods in BeyondAgent (each one a seam in `beyond_agent.seams.SEAMS`).

verl's `fit()` runs unchanged and calls, once per step and in this order, helpers that are not public API. A
trainer built on `TrainerSeams` overrides the public hooks below instead, with the meaning they have for us:

- `join_rows(batch, metrics)`: after `fit()` joined the rollout's rows with the input rows, before it reads
  rewards; rows may be added to the batch here (the one join point `fit()` offers: `_balance_batch`, which it
  calls only when `trainer.balance_batch` is on, so `open_join_point` turns it on and `reorders_rows` keeps the
  user's own choice of verl's reordering);
- `after_old_log_prob(batch, old_log_prob)`: verl recomputed π_old; may log or replace it;
- `before_actor_update(batch)`: advantages are final for verl; may change them in place; returns metrics to log;
- `step_metrics()`: our metrics of the step, which join its first update's (critic or actor) for `fit()` to log;
- `after_actor_update(output)`: the actor update's output, whose metrics `fit()` reduces after the weight sync;
- `validation_metrics()`: our metrics of a validation, added to verl's;
- `after_checkpoint_load()`: verl's resume has run (`global_steps` is the step resumed from, 0 if none).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omegaconf import open_dict
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from beyond_agent.seams import patch


def open_join_point(config: Any) -> None:
    """Turn `trainer.balance_batch` on so that `fit()` reaches `join_rows`. Whether verl still reorders rows across
    data-parallel ranks is the user's setting, which the trainer reads before this (`reorders_rows`)."""
    with open_dict(config):
        config.trainer.balance_batch = True


def wrap_update_weights(manager: Any, wrapper: Callable[[Callable], Callable]) -> None:
    """Replace verl's `checkpoint_manager.update_weights` (which `fit()` calls after each actor update) on this
    instance with `wrapper(original)`."""
    patch(manager, "update_weights", wrapper(manager.update_weights))


class TrainerSeams(RayPPOTrainer):
    """RayPPOTrainer whose per-step private helpers call the public hooks of this class (module docstring); the
    hooks do nothing here."""

    reorders_rows: bool = True
    """Whether the join point also runs verl's reordering of rows (the user's `trainer.balance_batch` before
    `open_join_point`)."""

    # ---- the hooks ---------------------------------------------------------------------------------------------
    def join_rows(self, batch: Any, metrics: dict) -> None:
        """Add rows of our own to the step's batch (and their counts to `metrics`)."""

    def after_old_log_prob(self, batch: Any, old_log_prob: Any) -> Any:
        """verl's recomputed π_old for `batch`; returns the one the update uses."""
        return old_log_prob

    def before_actor_update(self, batch: Any) -> dict[str, float]:
        """Change the batch's advantages in place before the actor update; returns metrics to log with it."""
        return {}

    def step_metrics(self) -> dict[str, float]:
        """Our metrics of the step, which join its first update's (taken once)."""
        return {}

    def after_actor_update(self, output: Any) -> None:
        """The actor update's output (its `meta_info["metrics"]` is reduced and logged by `fit()` later)."""

    def validation_metrics(self) -> dict[str, float]:
        """Our metrics of a validation, added to verl's (taken once per validation)."""
        return {}

    def after_checkpoint_load(self) -> None:
        """verl's resume has run: restore what it does not (`global_steps` is the step resumed from, 0 if none)."""

    # ---- the seams: verl's private helpers, each calling verl's own and then the hook -----------------------------
    def _balance_batch(self, batch: Any, metrics: dict, logging_prefix: str = "global_seqlen",
                       keep_minibatch: bool = False) -> None:
        self.join_rows(batch, metrics)
        if self.reorders_rows:
            super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)

    def _validate(self, merged: bool = False):
        metrics = super()._validate(merged)
        ours = self.validation_metrics()
        if not merged and metrics is not None:  # merged: verl's raw lists, for its own merging
            metrics.update(ours)
        return metrics

    def _load_checkpoint(self):
        resumed = super()._load_checkpoint()
        self.after_checkpoint_load()
        return resumed

    def _compute_old_log_prob(self, batch: Any):
        old_log_prob, mfu = super()._compute_old_log_prob(batch)
        return self.after_old_log_prob(batch, old_log_prob), mfu

    def _update_critic(self, batch: Any) -> Any:
        # During critic warm-up no actor update runs, and fit() logs the critic's metrics every step.
        output = super()._update_critic(batch)
        output.meta_info["metrics"].update(self.step_metrics())
        return output

    def _update_actor(self, batch: Any) -> Any:
        ours = self.before_actor_update(batch)
        output = super()._update_actor(batch)
        output.meta_info["metrics"].update({**self.step_metrics(), **ours})
        self.after_actor_update(output)
        return output
