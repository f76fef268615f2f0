"""BeyondAgentTrainer: verl's RayPPOTrainer with BeyondAgent's multi-turn environment rollout.

verl's `fit()` runs unchanged. The trainer only fills verl's rollout-manager seam
(`actor_rollout_ref.rollout.agent.agent_loop_manager_class`) with `BeyondAgentLoopManager`, which plays
every episode against envservice with the round limit `RoundScheduler.max_rounds(global_step)`, returns
each row's task reward as `rm_scores`, and reports its figures through verl's tracker. Our config is
validated by `BeyondAgentSettings`, in the driver before Ray starts and where the rollout manager uses it.
When `fit()` returns or fails, the run's main curves are drawn into `curves.png` beside its metrics.jsonl
(recipe/beyond_agent/viewer/curves.py), for people who never open the viewer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from omegaconf import open_dict
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from recipe.beyond_agent.verl_pin import ensure_pinned_verl
from recipe.beyond_agent.viewer.run_folder import CURVES_FILE, METRICS_PATH_VARIABLE, MetricsLog

MANAGER_CLASS = "recipe.beyond_agent.rollout_manager.BeyondAgentLoopManager"



def use_beyond_agent_rollout(config: Any) -> None:
    """Point verl's rollout-manager seam at our manager unless the user named another one."""
    with open_dict(config):
        agent = config.actor_rollout_ref.rollout.agent
        if not agent.get("agent_loop_manager_class"):
            agent.agent_loop_manager_class = MANAGER_CLASS


class BeyondAgentTrainer(RayPPOTrainer):
    """RayPPOTrainer whose rollout is BeyondAgent's ParallelEnvManager (see the module docstring)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        ensure_pinned_verl()
        use_beyond_agent_rollout(config)
        super().__init__(config, *args, **kwargs)
        notice = align_total_epochs(self.config, len(self.train_dataloader), self.total_training_steps)
        if notice:
            print(notice, flush=True)

    def fit(self) -> None:
        """verl's fit(), then the curves PNG (also after a failure: the steps that ran are worth a look)."""
        try:
            super().fit()
        finally:
            write_curves_beside_metrics(os.environ.get(METRICS_PATH_VARIABLE))


def write_curves_beside_metrics(metrics_file: str | None) -> Path | None:
    """Draw curves.png next to the run's metrics file; a drawing failure is reported, never raised."""
    if not metrics_file:
        print("[beyond_agent] no curves.png: trainer.logger has no `file` tracker", flush=True)
        return None
    from recipe.beyond_agent.viewer.curves import write_curves_png  # matplotlib: only when drawing

    folder = Path(metrics_file).parent
    try:
        written = write_curves_png(MetricsLog(folder), folder / CURVES_FILE)
    except Exception as error:  # a plot must never turn a finished run into a failed one
        print(f"[beyond_agent] curves.png not written: {type(error).__name__}: {error}", flush=True)
        return None
    print(f"[beyond_agent] curves: {written}" if written else "[beyond_agent] no curves.png: no metrics logged",
          flush=True)
    return written


def align_total_epochs(config: Any, batches_per_epoch: int, total_training_steps: int) -> str | None:
    """Raise `trainer.total_epochs` so that verl's `fit()` reaches `total_training_steps`; the notice, or None.

    Why: verl 0.9's `fit()` loops over `total_epochs` epochs and stops at whichever comes first, that or
    `total_training_steps`, while printing only "Total training steps: N". A run asked for 300 steps over
    a 4-batch dataset with the default 30 epochs would stop at step 120 without a word. The explicit step
    count is the more specific wish, so the epochs follow it.
    """
    needed = -(-total_training_steps // batches_per_epoch)  # ceil: the last epoch may be cut short
    current = config.trainer.total_epochs
    if current >= needed:
        return None
    with open_dict(config):
        config.trainer.total_epochs = needed
    return (f"trainer.total_training_steps={total_training_steps} needs {needed} epochs of {batches_per_epoch} "
            f"batches; trainer.total_epochs raised from {current} to {needed} (verl stops at whichever ends first)")
