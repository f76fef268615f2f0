"""BeyondAgentTrainer: verl's RayPPOTrainer with BeyondAgent's multi-turn environment rollout.

verl's `fit()` runs unchanged. The trainer only fills verl's rollout-manager seam
(`actor_rollout_ref.rollout.agent.agent_loop_manager_class`) with `BeyondAgentLoopManager`, which plays
every episode against envservice with the round limit `RoundLimit.max_rounds(global_step)`, returns
each row's task reward as `rm_scores`; its metrics of the step (`beyond_agent/...`) join the metrics of the
step's critic or actor update, which `fit()` logs with verl's tracker. Our config is
validated by `BeyondAgentConfig`, in the driver before Ray starts and where the rollout manager uses it.
When `fit()` returns or fails, the run's main curves are drawn into `curves.png` beside its metrics.jsonl
(beyond_agent/curves.py), for people who never open the viewer.

The per-step helpers of `fit()` that are not verl's public API are overridden in one place only,
`beyond_agent.seams.trainer.TrainerSeams`, which turns them into named hooks; this trainer fills the hooks
(every seam and why upstream lacks it: `python -m beyond_agent.seams`). With `algorithm.adv_estimator=gigpo`,
`before_actor_update` first adds GiGPO's step-level advantages from the rollout's per-turn anchor states
(beyond_agent/algorithms/gigpo.py; verl's estimator seam computed the episode-level part). Multi-task runs
(`beyond_agent.multitask`, beyond_agent/multitask.py) take two more hooks: `before_actor_update` normalises
advantages within each task (`task_advantage_norm`), and `validation_metrics` adds each task's rollout metrics
to verl's per-data_source validation metrics. The weighted task sampler is the `train_sampler` our TaskRunner
hands verl.

Asynchronous rollout (`beyond_agent.rollout_mode: async`) also runs on verl's unchanged `fit()`, through
three seams of the legacy trainer instead of a copy of `fit()`:
- the train dataloader `fit()` iterates is wrapped (`PlayedRowLoader`): each batch it yields is made of rows
  whose episodes the rollout manager already finished in the background, keyed so that
  `generate_sequences` returns exactly those episodes (dynamic sampling uses the same loader in sync mode:
  the manager plays each batch when the loader asks, replacing groups without signal);
- the checkpoint manager's `update_weights` (verl's weight sync, called by `fit()` after each actor update)
  runs inside the manager's version gate, so that a sync happens between generation requests and every
  generated turn records the version that produced it;
- `after_old_log_prob` and `before_actor_update` (hooks on helpers `fit()` calls): with `old_log_probs: behaviour` the
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
from typing import Any

from beyond_agent.algorithms.gigpo import RECOUNTED_ESTIMATORS, add_step_advantages, count_each_episode_once, norm_of
from beyond_agent.integrity import LogProbDriftMonitor, PrefixMonitor, ServedWeightsMonitor
from beyond_agent.multitask import apply_task_advantage_norm
from beyond_agent.rollout.batch import add_segment_rows
from beyond_agent.run_folder import METRICS_PATH_VARIABLE
from beyond_agent.seams.trainer import TrainerSeams
from beyond_agent.settings import BeyondAgentConfig
from beyond_agent.training import (PlayedRowLoader, align_total_epochs, freeze_long_lived_heaps, install_target_kl,
                                   log_prob_gap_metrics, metrics_source, prepare_verl_config,
                                   resumed_checkpoint_folder, target_kl_figures, wrap_weight_sync,
                                   write_curves_beside_metrics)
from beyond_agent.verl_pin import ensure_pinned_verl


class BeyondAgentTrainer(TrainerSeams):
    """RayPPOTrainer whose rollout is BeyondAgent's ParallelEnvManager (see the module docstring); it fills the
    per-step hooks of `TrainerSeams`, which alone overrides verl's private helpers."""

    def __init__(self, config: Any, *args: Any, beyond_config: BeyondAgentConfig | None = None, **kwargs: Any):
        ensure_pinned_verl()
        self.beyond_config = beyond_config if beyond_config is not None else BeyondAgentConfig.from_config(config)
        """Our validated `beyond_agent:` section (read from `config` unless the caller read it already)."""
        self.reorders_rows = bool(config.trainer.get("balance_batch", True))  # the user's, before the join point
        self.lora_plan = prepare_verl_config(config, self.beyond_config)
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
        self.log_prob_drift = LogProbDriftMonitor(self.beyond_config.integrity.log_prob_drift)
        self.prefix = PrefixMonitor(self.beyond_config.integrity.prefix)
        self._log_prob_metrics: dict[str, float] = {}  # the old-log-prob step's, logged with the actor's
        self._last_actor_output = None  # the actor update whose metrics the next weight sync's join

    def init_workers(self) -> None:
        """verl's workers, their long-lived heaps frozen (`freeze_long_lived_heaps`), then the one wrapper around
        its weight sync (`wrap_weight_sync`)."""
        super().init_workers()
        freeze_long_lived_heaps(self.checkpoint_manager)
        if self.beyond_config.target_kl is not None:
            install_target_kl(self.checkpoint_manager, self.beyond_config.target_kl,
                              self.beyond_config.target_kl_backtrack)
        rollout = self.async_rollout_manager if self.beyond_config.is_async else None
        served = ServedWeightsMonitor(self.beyond_config.integrity.served_weights, self.config.actor_rollout_ref.rollout)
        wrap_weight_sync(self.checkpoint_manager, rollout, self.lora_plan, self._take_actor_output, served)

    def fit(self) -> None:
        """verl's fit(), then the curves PNG (also after a failure: the steps that ran are worth a look)."""
        try:
            if self.beyond_config.rows_played_by_loader:
                self.train_dataloader = PlayedRowLoader(self.train_dataloader, self)
            super().fit()
        finally:
            if self.beyond_config.is_async:
                self.async_rollout_manager.close_async()
            write_curves_beside_metrics(os.environ.get(METRICS_PATH_VARIABLE))

    def after_checkpoint_load(self) -> None:
        """Where verl resumed but skipped data.pt (at an epoch boundary), the played-row loader restores it itself: the
        rows in play at the checkpoint and the accounting are in it (`PlayedRowLoader`)."""
        loader = self.train_dataloader
        if isinstance(loader, PlayedRowLoader) and not loader.restored and self.global_steps > 0:
            loader.restore_from(resumed_checkpoint_folder(self.config.trainer, self.global_steps))

    def validation_metrics(self) -> dict[str, float]:
        """Our per-task rollout metrics (`val-aux/beyond_agent/task/<task>/...`: rounds, terminations, episodes),
        beside verl's own per-data_source (= task) validation metrics."""
        source = metrics_source(self.async_rollout_manager)  # another manager: none
        return source.take_validation_metrics() if source is not None else {}

    def join_rows(self, batch: Any, metrics: dict) -> None:
        """The per_call agent episodes' earlier samples (and self-play's other seats) join the batch, with pad rows
        up to a whole number of mini-batches (`rollout.batch.add_segment_rows`; their counts are logged as
        `beyond_agent/agent/segment_rows` and `pad_rows`)."""
        source = metrics_source(self.async_rollout_manager)  # another manager: none
        beyond_config = self.beyond_config
        if (beyond_config.agent.active or beyond_config.self_play.active) and source is not None:
            added = add_segment_rows(batch, source.take_segment_rows(), self._mini_batch_rows(),
                                     self.tokenizer.pad_token_id)
            section = "agent" if beyond_config.agent.active else "self_play"
            metrics.update({f"beyond_agent/{section}/{key}": float(value) for key, value in added.items()})

    def _mini_batch_rows(self) -> int:
        """Rows of one actor mini-batch (and the critic's, when there is one): a training batch must hold a whole
        number of them (verl's `_update_actor` and `_update_critic` split it so)."""
        n = self.config.actor_rollout_ref.rollout.n
        rows = self.config.actor_rollout_ref.actor.ppo_mini_batch_size * n
        if self.use_critic:
            rows = math.lcm(rows, self.config.critic.ppo_mini_batch_size * n)
        return rows

    def after_old_log_prob(self, batch: Any, old_log_prob: Any) -> Any:
        """The log-prob drift monitor judges the rollout's log-probs against the trainer's recomputation
        (`beyond_agent.integrity.log_prob_drift`); in async mode the gap is logged too, and π_old = the behaviour
        policy when `old_log_probs: behaviour`."""
        recomputed = old_log_prob.batch["old_log_probs"]
        if "rollout_log_probs" in batch.batch:
            self._log_prob_metrics = self.log_prob_drift.observe(
                self.global_steps, recomputed, batch.batch["rollout_log_probs"], batch.batch["response_mask"])
        if not self.beyond_config.is_async:
            return old_log_prob
        if "rollout_log_probs" not in batch.batch:
            raise RuntimeError("async rollout needs the rollout's sampling log-probs (rollout_log_probs), and this "
                               "batch has none: the LLM server must return log-probs")
        behaviour = batch.batch["rollout_log_probs"].to(recomputed.dtype)
        self._log_prob_metrics.update(log_prob_gap_metrics(recomputed, behaviour, batch.batch["response_mask"]))
        if self.beyond_config.async_rollout.old_log_probs == "behaviour":
            old_log_prob.batch["old_log_probs"] = behaviour
        return old_log_prob

    def step_metrics(self) -> dict[str, float]:
        """The step's rollout metrics (`beyond_agent/...`), from our rollout manager (another one has none)."""
        source = metrics_source(self.async_rollout_manager)
        return source.take_step_metrics() if source is not None else {}

    def before_actor_update(self, batch: Any) -> dict[str, float]:
        """With `adv_estimator=gigpo` GiGPO's step-level advantages are added (they need each turn's anchor state,
        which verl's estimator seam does not pass), and with gigpo, grpo or rloo a per_call agent's episode counts
        once in its group (`count_each_episode_once`); advantages are normalised within each task when
        `multitask.task_advantage_norm`. Returns those metrics, the step's rollout/trainer log-prob figures
        (`after_old_log_prob`) and the prefix monitor's check of the rows the update trains on."""
        metrics = {}
        if self.config.algorithm.adv_estimator == "gigpo":  # verl computed A^E; the step part needs our turns
            metrics.update(add_step_advantages(batch, self.beyond_config.gigpo, norm_of(self.config.algorithm)))
        elif self.config.algorithm.adv_estimator in RECOUNTED_ESTIMATORS:  # a per_call agent's segments: each episode once
            count_each_episode_once(batch, norm_of(self.config.algorithm), estimator=self.config.algorithm.adv_estimator)
        if self.beyond_config.multitask.task_advantage_norm:
            metrics.update(apply_task_advantage_norm(batch))
        metrics.update(self._log_prob_metrics)
        self._log_prob_metrics = {}
        contexts = batch.non_tensor_batch.get("turn_contexts")  # our rollout's rows (another manager: none)
        if contexts is not None:  # the rows the update trains on, each against the ids its turns were given
            metrics.update(self.prefix.observe(self.global_steps, batch.batch["input_ids"],
                                               batch.batch["attention_mask"], contexts))
        return metrics

    def after_actor_update(self, output: Any) -> None:
        """The target-KL stop's figures join this update's metrics (`beyond_agent.target_kl`), and the next weight
        sync's will (`wrap_weight_sync`)."""
        if self.beyond_config.target_kl is not None:
            output.meta_info["metrics"].update(target_kl_figures(self.checkpoint_manager))
        self._last_actor_output = output

    def _take_actor_output(self) -> Any | None:
        """The last actor update's output, once (the weight sync that carries it adds its metrics)."""
        output, self._last_actor_output = self._last_actor_output, None
        return output
