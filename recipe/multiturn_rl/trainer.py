"""BeyondAgentTrainer: verl's RayPPOTrainer with BeyondAgent's multi-turn environment rollout.

verl's `fit()` runs unchanged. The trainer only fills verl's rollout-manager seam
(`actor_rollout_ref.rollout.agent.agent_loop_manager_class`) with `BeyondAgentLoopManager`, which plays
every episode against envservice with the round limit `RoundScheduler.max_rounds(global_step)`, returns
each row's task reward as `rm_scores`; its figures of the step (`beyond_agent/...`) join the metrics of the
step's critic or actor update, which `fit()` logs with verl's tracker. Our config is
validated by `BeyondAgentSettings`, in the driver before Ray starts and where the rollout manager uses it.
When `fit()` returns or fails, the run's main curves are drawn into `curves.png` beside its metrics.jsonl
(beyond_agent/curves.py), for people who never open the viewer.

With `algorithm.adv_estimator=gigpo`, `_update_actor` first adds GiGPO's step-level advantages from the
rollout's per-turn anchor states (beyond_agent/algorithms/gigpo.py; verl's estimator seam computed the
episode-level part). Multi-task runs (`beyond_agent.multitask`, beyond_agent/multitask.py) take two more
helpers of `fit()`: `_update_actor` normalises advantages within each task (`task_advantage_norm`), and
`_validate` adds each task's rollout figures to verl's per-data_source validation metrics. The weighted
task sampler is the `train_sampler` our TaskRunner hands verl.

Asynchronous rollout (`beyond_agent.rollout_mode: async`) also runs on verl's unchanged `fit()`, through
three seams of the legacy trainer instead of a copy of `fit()`:
- the train dataloader `fit()` iterates is wrapped (`PlayedRowLoader`): each batch it yields is made of rows
  whose episodes the rollout manager already finished in the background, keyed so that
  `generate_sequences` returns exactly those episodes (dynamic sampling uses the same loader in sync mode:
  the manager plays each batch when the loader asks, replacing groups without signal);
- the checkpoint manager's `update_weights` (verl's weight sync, called by `fit()` after each actor update)
  runs inside the manager's version gate, so that a sync happens between generation requests and every
  generated turn records the version that produced it;
- `_compute_old_log_prob` and `_update_actor` (helpers `fit()` calls): with `old_log_probs: behaviour` the
  policy loss's π_old is the rollout's sampling log-probs, and the gap between those and the trainer's own
  recomputation is logged (`beyond_agent/async/logprob_gap_*`) with the actor's metrics of that step.

On GPUs: the legacy trainer builds rollout inside the actor's workers (hybrid engine), so async episodes
overlap training only while the rollout engine keeps its memory (`free_cache_engine=false`, checked by the
settings) and on the same GPUs. Rollout on separate GPUs (the AgentBench recipes' 4 + 4) needs what verl's
`experimental/separation` and `fully_async_policy` code does: an `init_workers` that starts an actor-only
role and standalone rollout replicas, and a weight sync across the two pools (a non-naive checkpoint
engine; our delta backend would then receive on the rollout side's `CheckpointEngineWorker`).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import ray
import torch
from omegaconf import open_dict
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from beyond_agent.algorithms.gigpo import RECOUNTED_ESTIMATORS, add_step_advantages, count_each_episode_once, norm_of
from beyond_agent.multitask import apply_task_advantage_norm
from beyond_agent.rollout.batch import add_segment_rows
from beyond_agent.rollout_manager import ROW_KEY
from beyond_agent.settings import BeyondAgentSettings
from beyond_agent.verl_pin import ensure_pinned_verl
from beyond_agent.run_folder import CURVES_FILE, METRICS_PATH_VARIABLE, MetricsLog
from beyond_agent.weights.host_lock import weight_sync_lock
from beyond_agent.weights.delta import METRIC_PREFIX
from beyond_agent.weights.lora import LoraPlan, configure_lora
from beyond_agent.weights.verl_backend import configure_weight_sync

MANAGER_CLASS = "beyond_agent.rollout_manager.BeyondAgentLoopManager"



def prepare_verl_config(config: Any, settings: BeyondAgentSettings) -> LoraPlan | None:
    """Every change BeyondAgent makes to verl's config before verl reads it, in one place:

    - verl's rollout-manager seam (`actor_rollout_ref.rollout.agent.agent_loop_manager_class`) names our
      manager, unless the user named another one;
    - with LoRA (`actor_rollout_ref.model.lora_rank > 0`), vLLM's worker extension seam names ours
      (`configure_lora`, which refuses with the key to change a LoRA run this path does not serve);
    - with `weight_sync.mode: delta`, verl's checkpoint-engine seams name our delta backend
      (`configure_weight_sync`, which refuses with the key to change a run the delta path cannot serve);
    - with a user's agent (`beyond_agent.agent.function` or `command`), `trainer.balance_batch` is turned on,
      because `fit()` calls `_balance_batch` only then and that is where the per_call episodes' earlier samples
      join the batch (`BeyondAgentTrainer._balance_batch`, which reorders rows only if the user had asked for it).

    The one change made later is `align_total_epochs`, which needs verl's dataloader. Returns the LoRA adapter
    the run trains (None: full fine-tuning). Raises ValueError.
    """
    with open_dict(config):
        agent = config.actor_rollout_ref.rollout.agent
        if not agent.get("agent_loop_manager_class"):
            agent.agent_loop_manager_class = MANAGER_CLASS
        if settings.agent.active or settings.self_play.active:  # fit() calls _balance_batch only when it is on:
            config.trainer.balance_batch = True  # our segment and seat rows join there
    lora = configure_lora(config, settings.weight_sync.mode)
    configure_weight_sync(config, settings.weight_sync)
    return lora


class BeyondAgentTrainer(RayPPOTrainer):
    """RayPPOTrainer whose rollout is BeyondAgent's ParallelEnvManager (see the module docstring)."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any):
        ensure_pinned_verl()
        self.beyond_settings = BeyondAgentSettings.from_config(config)
        """Our validated `beyond_agent:` section."""
        self.reorders_rows = bool(config.trainer.get("balance_batch", True))
        """The user's `trainer.balance_batch` (verl reorders rows for the DP ranks), before agent mode turns it on."""
        self.lora_plan = prepare_verl_config(config, self.beyond_settings)
        """The LoRA adapter this run trains (None: full fine-tuning)."""
        if self.lora_plan is not None:
            plan = self.lora_plan
            size = (f"{plan.adapter_parameters} adapter parameters, {plan.adapter_bytes} bytes per weight sync"
                    if plan.adapter_parameters is not None else "adapter size unknown (no local config.json)")
            print(f"[beyond_agent] LoRA: rank {plan.rank}, alpha {plan.alpha}, {size}", flush=True)
        super().__init__(config, *args, **kwargs)
        notice = align_total_epochs(self.config, len(self.train_dataloader), self.total_training_steps)
        if notice:
            print(notice, flush=True)
        self._async_actor_metrics: dict[str, float] = {}
        self._last_actor_output = None  # the actor update whose metrics the next weight sync's figures join

    def init_workers(self) -> None:
        """verl's workers, then the one wrapper around its weight sync (`wrap_weight_sync`)."""
        super().init_workers()
        wrap_weight_sync(self)

    def fit(self) -> None:
        """verl's fit(), then the curves PNG (also after a failure: the steps that ran are worth a look)."""
        try:
            if self.beyond_settings.rows_played_by_loader:
                self.train_dataloader = PlayedRowLoader(self.train_dataloader, self)
            super().fit()
        finally:
            if self.beyond_settings.is_async:
                self.async_rollout_manager.close_async()
            write_curves_beside_metrics(os.environ.get(METRICS_PATH_VARIABLE))

    def _validate(self, merged: bool = False):
        """verl's validation, which reports each data_source (= task) itself (`val-core/<task>/reward/mean@N`,
        `val-aux/<task>/success/mean@N`), plus our per-task rollout figures (`val-aux/beyond_agent/task/<task>/...`:
        rounds, terminations, episodes)."""
        metrics = super()._validate(merged)
        take = getattr(self.async_rollout_manager, "take_validation_figures", None)  # another manager: none
        figures = take() if take is not None else {}
        if not merged and metrics is not None:  # merged: verl's raw lists, for its own merging
            metrics.update(figures)
        return metrics

    def _balance_batch(self, batch: Any, metrics: dict, logging_prefix: str = "global_seqlen",
                       keep_minibatch: bool = False) -> None:
        """Where `fit()` hands over the batch right after joining the rollout's rows with the input rows (and
        before it reads rewards): the per_call agent episodes' earlier samples are added here, with pad rows up
        to a whole number of mini-batches (`rollout.batch.add_segment_rows`; their counts are logged as
        `beyond_agent/agent/segment_rows` and `pad_rows`); then verl's reordering if the user asked for it."""
        take = getattr(self.async_rollout_manager, "take_segment_rows", None)  # another manager: none
        settings = self.beyond_settings
        if (settings.agent.active or settings.self_play.active) and take is not None:
            added = add_segment_rows(batch, take(), self._mini_batch_rows(), self.tokenizer.pad_token_id)
            section = "agent" if settings.agent.active else "self_play"
            metrics.update({f"beyond_agent/{section}/{key}": float(value) for key, value in added.items()})
        if self.reorders_rows:
            super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)

    def _mini_batch_rows(self) -> int:
        """Rows of one actor mini-batch (and the critic's, when there is one): a training batch must hold a whole
        number of them (verl's `_update_actor` and `_update_critic` split it so)."""
        n = self.config.actor_rollout_ref.rollout.n
        rows = self.config.actor_rollout_ref.actor.ppo_mini_batch_size * n
        if self.use_critic:
            rows = math.lcm(rows, self.config.critic.ppo_mini_batch_size * n)
        return rows

    def _compute_old_log_prob(self, batch: Any):
        """verl's recomputation; in async mode also the rollout/trainer gap, and π_old = the behaviour policy
        when `old_log_probs: behaviour`."""
        old_log_prob, mfu = super()._compute_old_log_prob(batch)
        if not self.beyond_settings.is_async:
            return old_log_prob, mfu
        if "rollout_log_probs" not in batch.batch:
            raise RuntimeError("async rollout needs the rollout's sampling log-probs (rollout_log_probs), and this "
                               "batch has none: the LLM server must return log-probs")
        recomputed = old_log_prob.batch["old_log_probs"]
        behaviour = batch.batch["rollout_log_probs"].to(recomputed.dtype)
        self._async_actor_metrics = log_prob_gap_metrics(recomputed, behaviour, batch.batch["response_mask"])
        if self.beyond_settings.async_rollout.old_log_probs == "behaviour":
            old_log_prob.batch["old_log_probs"] = behaviour
        return old_log_prob, mfu

    def _take_rollout_figures(self) -> dict[str, float]:
        """The step's rollout figures (`beyond_agent/...`), from our rollout manager (another one has none)."""
        take = getattr(self.async_rollout_manager, "take_step_figures", None)
        return take() if take is not None else {}

    def _update_critic(self, batch: Any) -> Any:
        """verl's critic update; the step's rollout figures join its metrics (during critic warm-up no actor
        update runs, and fit() logs the critic's metrics every step)."""
        output = super()._update_critic(batch)
        output.meta_info["metrics"].update(self._take_rollout_figures())
        return output

    def _update_actor(self, batch: Any) -> Any:
        """verl's actor update; with `adv_estimator=gigpo` first GiGPO's step-level advantages are added (they need
        each turn's anchor state, which verl's estimator seam does not pass), and with gigpo, grpo or rloo a per_call
        agent's episode counts once in its group (`count_each_episode_once`); on advantages normalised within
        each task when `multitask.task_advantage_norm`
        (before the batch reaches the workers); the normalisation's per-task figures and the step's
        rollout/trainer log-prob gap join its metrics (fit() reduces and logs `meta_info["metrics"]`), and the
        step's rollout figures unless the critic's update took them first."""
        step_figures = {}
        if self.config.algorithm.adv_estimator == "gigpo":  # verl computed A^E; the step part needs our turns
            step_figures = add_step_advantages(batch, self.beyond_settings.gigpo, norm_of(self.config.algorithm))
        elif self.config.algorithm.adv_estimator in RECOUNTED_ESTIMATORS:  # a per_call agent's segments: each episode once
            count_each_episode_once(batch, norm_of(self.config.algorithm), estimator=self.config.algorithm.adv_estimator)
        task_figures = apply_task_advantage_norm(batch) if self.beyond_settings.multitask.task_advantage_norm else {}
        output = super()._update_actor(batch)
        output.meta_info["metrics"].update(self._take_rollout_figures())
        output.meta_info["metrics"].update(step_figures)
        output.meta_info["metrics"].update(task_figures)
        output.meta_info["metrics"].update(self._async_actor_metrics)
        self._async_actor_metrics = {}
        self._last_actor_output = output
        return output


class PlayedRowLoader:
    """The train dataloader `fit()` iterates in async mode and with dynamic sampling: batches of rows whose
    episodes already finished.

    On the first iteration it hands the rollout manager the wrapped dataloader's rows (epoch after epoch):
    in async mode its background pool draws them as far ahead as the staleness bound allows; in sync mode
    each batch is played when `fit()` asks for it, after the previous step's weight sync. Each batch it
    yields is verl's collated rows plus `ROW_KEY`. Its length and checkpoint state are the wrapped loader's
    (the state is the reading position: a resumed run skips the rows that were in flight or dropped).
    """

    def __init__(self, dataloader: Any, trainer: "BeyondAgentTrainer"):
        self.dataloader = dataloader
        self.trainer = trainer
        self._started = False

    def __len__(self) -> int:
        return len(self.dataloader)

    def state_dict(self) -> dict:
        """The wrapped loader's state (for verl's checkpoints)."""
        return self.dataloader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore the wrapped loader's state (verl's resume)."""
        self.dataloader.load_state_dict(state)

    def __iter__(self):
        from verl.utils.dataset.rl_dataset import collate_fn

        manager = self.trainer.async_rollout_manager
        if not self._started:
            config = self.trainer.config
            manager.start_rows(endless_rows(self.dataloader), batch_size=config.data.train_batch_size,
                                samples_per_row=config.actor_rollout_ref.rollout.n,
                                trained_steps=self.trainer.global_steps - 1,
                                total_steps=self.trainer.total_training_steps)
            self._started = True
        for _ in range(len(self.dataloader)):
            yield collate_fn([{**row.row, ROW_KEY: row.key} for row in manager.take_rows()])


def endless_rows(dataloader: Any):
    """The dataloader's rows one by one, epoch after epoch (each row one element of every batch field)."""
    while True:
        for batch in dataloader:
            size = len(next(iter(batch.values())))
            for index in range(size):
                yield {key: values[index] for key, values in batch.items()}


def wrap_weight_sync(trainer: "BeyondAgentTrainer") -> None:
    """Wrap verl's `checkpoint_manager.update_weights` (which `fit()` calls after each actor update) once:

    - every sync holds this host's lock of the Ray job id (`beyond_agent.weights.host_lock`): verl names the
      weight-sync sockets of every run that starts its own Ray cluster alike, and two such syncs at once hang;
    - async rollout: the sync waits in the rollout's version gate (for generation requests in flight, or whole
      episodes without partial rollout) and then publishes the new policy version;
    - the sync's figures (delta mode's `weight_sync/*`; in full mode the sync's seconds, `transfer_s`, and with
      LoRA the adapter's `bytes_sent`) join the actor metrics of the step whose update it carries. verl's
      `fit()` discards update_weights' return value but reduces the actor output's metrics after the call; the
      syncs with no actor update before them (the first one, critic warm-up) are printed by the delta backend
      only.
    """
    manager = trainer.checkpoint_manager
    sync = manager.update_weights
    rollout = trainer.async_rollout_manager if trainer.beyond_settings.is_async else None
    job_id = ray.get_runtime_context().get_job_id()

    def locked_sync(global_steps: int | None):
        with weight_sync_lock(job_id):
            started = time.perf_counter()
            result = sync(global_steps)
        if not result:  # verl's own (full) sync returns nothing: its seconds, and with LoRA the adapter's bytes
            result = {METRIC_PREFIX + "transfer_s": time.perf_counter() - started}
            if trainer.lora_plan is not None and trainer.lora_plan.adapter_bytes is not None:
                result[METRIC_PREFIX + "bytes_sent"] = float(trainer.lora_plan.adapter_bytes)
        return result

    def update_weights(global_steps: int | None = None):
        if rollout is None:
            result = locked_sync(global_steps)
        else:
            with rollout.gate.updating(int(global_steps or 0)):
                result = locked_sync(global_steps)
            rollout.version_changed()
        output, trainer._last_actor_output = trainer._last_actor_output, None
        if isinstance(result, dict) and result and output is not None:
            output.meta_info["metrics"].update(result)
        return result

    manager.update_weights = update_weights


def log_prob_gap_metrics(trainer: torch.Tensor, rollout: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout's sampling log-probs are from the trainer's recomputation, over response tokens.

    Non-zero even at zero staleness (different kernels and precision); with stale tokens it also holds the
    policy's drift. `ratio_mean` is the mean importance ratio π_trainer / π_rollout.
    """
    mask = response_mask.bool()
    if not mask.any():
        return {}
    gap = (trainer - rollout)[mask]
    return {"beyond_agent/async/logprob_gap_abs_mean": gap.abs().mean().item(),
            "beyond_agent/async/logprob_gap_abs_max": gap.abs().max().item(),
            "beyond_agent/async/logprob_gap_mean": gap.mean().item(),
            "beyond_agent/async/ratio_mean": gap.exp().mean().item()}


def write_curves_beside_metrics(metrics_file: str | None) -> Path | None:
    """Draw curves.png next to the run's metrics file; a drawing failure is reported, never raised."""
    if not metrics_file:
        print("[beyond_agent] no curves.png: trainer.logger has no `file` tracker", flush=True)
        return None
    from beyond_agent.curves import write_curves_png  # matplotlib: only when drawing

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
