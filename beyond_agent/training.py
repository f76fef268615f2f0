"""What a trainer on verl's unchanged `fit()` needs around BeyondAgent's rollout manager, for any recipe.

- `prepare_verl_config`: every change we make to verl's config before verl reads it;
- `RolloutMetricsSource`: what the trainer asks of the rollout manager besides verl's `generate_sequences` (ours
  answers it; a manager a user names in `agent_loop_manager_class` may not);
- `PlayedRowLoader`: the train dataloader `fit()` iterates in async mode and with dynamic sampling;
- `wrap_weight_sync`: the host lock, the async version gate and the sync's metrics around verl's weight sync;
- `freeze_long_lived_heaps`: the garbage collector stops walking what the training processes hold for good;
- `install_target_kl`, `target_kl_figures`: the target-KL stop of the actor's updates, in every actor worker;
- `log_prob_gap_metrics`, `align_total_epochs`, `write_curves_beside_metrics`: metrics and fixes of the run.

The recipe's trainer (recipe/multiturn_rl/trainer.py) fills the hooks of `beyond_agent.seams.trainer.TrainerSeams`
with these; the seams themselves (verl's private helpers) are in `beyond_agent.seams`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import ray
import torch
from omegaconf import open_dict

from beyond_agent.algorithms import target_kl
from beyond_agent.integrity import ServedWeightsMonitor, ServedWeightsWatch, token_log_prob_gaps
from beyond_agent.rollout.async_pool import RowsInPlay
from beyond_agent.rollout.batch import SegmentRows
from beyond_agent.rollout.row_stream import RowStream
from beyond_agent.rollout_manager import ROW_KEY
from beyond_agent.run_folder import CURVES_FILE, MetricsLog
from beyond_agent.seams.trainer import open_join_point, wrap_update_weights
from beyond_agent.settings import BeyondAgentConfig
from beyond_agent.weights.delta import METRIC_PREFIX
from beyond_agent.weights.host_lock import weight_sync_lock
from beyond_agent.weights.lora import LoraPlan, configure_lora
from beyond_agent.weights.verl_backend import WORKER_EXTENSION_CLASS, configure_weight_sync

MANAGER_CLASS = "beyond_agent.rollout_manager.BeyondAgentLoopManager"
"""The rollout manager verl builds when the user names none (`agent_loop_manager_class`)."""


def prepare_verl_config(config: Any, beyond_config: BeyondAgentConfig) -> LoraPlan | None:
    """Every change BeyondAgent makes to verl's config before verl reads it, in one place:

    - verl's rollout-manager seam (`actor_rollout_ref.rollout.agent.agent_loop_manager_class`) names our
      manager, unless the user named another one;
    - with LoRA (`actor_rollout_ref.model.lora_rank > 0`), vLLM's worker extension seam names ours
      (`configure_lora`, which refuses with the key to change a LoRA run this path does not serve);
    - with `weight_sync.mode: delta`, verl's checkpoint-engine seams name our delta backend
      (`configure_weight_sync`, which refuses with the key to change a run the delta path cannot serve);
    - with the `served_weights` integrity monitor on (the default), vLLM's worker extension seam names ours in
      every mode (`configure_served_check`): the monitor asks vLLM's workers through it after each sync;
    - with a user's agent (`beyond_agent.agent`) or self-play, `trainer.balance_batch` is turned on,
      because `fit()` reaches our join point only then and that is where the per_call episodes' earlier samples
      join the batch (the trainer's `TrainerSeams.join_rows` hook; verl reorders rows only if the user had asked
      for it).

    The one change made later is `align_total_epochs`, which needs verl's dataloader. Returns the LoRA adapter
    the run trains (None: full fine-tuning). Raises ValueError.
    """
    with open_dict(config):
        agent = config.actor_rollout_ref.rollout.agent
        if not agent.get("agent_loop_manager_class"):
            agent.agent_loop_manager_class = MANAGER_CLASS
    if beyond_config.agent.active or beyond_config.self_play.active:  # our segment and seat rows join there
        open_join_point(config)
    lora = configure_lora(config, beyond_config.weight_sync.mode)
    configure_weight_sync(config, beyond_config.weight_sync)
    configure_served_check(config, beyond_config.integrity.served_weights)
    return lora


def configure_served_check(config: Any, watch: ServedWeightsWatch) -> None:
    """The `served_weights` monitor asks vLLM's workers through our worker extension: name it in vLLM's seam (verl's
    default extension, which ours extends, otherwise). Raises ValueError naming the key when another is named."""
    rollout = config.actor_rollout_ref.rollout
    if watch.action == "off" or rollout.name != "vllm":
        return
    vllm_kwargs = (rollout.get("engine_kwargs") or {}).get("vllm") or {}
    named = vllm_kwargs.get("worker_extension_cls")
    if named not in (None, "", WORKER_EXTENSION_CLASS):
        raise ValueError(f"actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls={named}: the "
                         f"served_weights integrity monitor needs ours ({WORKER_EXTENSION_CLASS}, which extends "
                         f"verl's); leave the key unset, or set beyond_agent.integrity.served_weights.action=off")
    with open_dict(config):
        rollout.engine_kwargs.vllm.worker_extension_cls = WORKER_EXTENSION_CLASS


@runtime_checkable
class RolloutMetricsSource(Protocol):
    """What the trainer takes from the rollout manager once per step, besides verl's `generate_sequences`
    (beyond_agent.rollout_manager.BeyondAgentLoopManager answers all of it; another manager: none of it)."""

    def take_step_metrics(self) -> dict[str, float]:
        """The step's rollout metrics (`beyond_agent/...`), taken once."""

    def take_validation_metrics(self) -> dict[str, float]:
        """The last validation's per-task rollout metrics, taken once."""

    def take_segment_rows(self) -> SegmentRows | None:
        """Rows of our own waiting to join the step's batch (per_call agent samples, self-play seats)."""


def metrics_source(manager: Any) -> RolloutMetricsSource | None:
    """`manager` when it answers `RolloutMetricsSource`, else None (a user's own manager)."""
    return manager if isinstance(manager, RolloutMetricsSource) else None


ROWS_IN_PLAY_FORMAT = "beyond_agent.rows_in_play/1"
"""The format of `PlayedRowLoader.state_dict()` (what verl saves as a checkpoint's data.pt); a data.pt without it is a
plain dataloader state (a run checkpointed without the loader, or before the record existed)."""


class PlayedRowLoader:
    """The train dataloader `fit()` iterates in async mode and with dynamic sampling: batches of rows whose
    episodes already finished.

    On the first iteration it hands the rollout manager the wrapped dataloader's rows (a `RowStream`, epoch after
    epoch): in async mode its background pool draws them as far ahead as the staleness bound allows; in sync mode
    each batch is played when `fit()` asks for it, after the previous step's weight sync. Each batch it yields is
    verl's collated rows plus `ROW_KEY`. Its length is the wrapped loader's.

    Its checkpoint state (verl saves it as data.pt) is the wrapped loader's reading position plus every row read and
    not trained yet (in play in the pool, or read in a batch and not drawn) and the pool's accounting; a resumed run
    draws those rows again first and goes on counting (rollout/async_pool.py), so no row is lost at a resume.
    """

    def __init__(self, dataloader: Any, trainer: Any):
        self.dataloader = dataloader
        self.trainer = trainer
        self._stream = RowStream(dataloader)
        self._resumed: RowsInPlay | None = None
        self._started = False
        self.restored = False
        """A checkpoint's state was loaded (by verl, or by the trainer where verl skipped it)."""

    def __len__(self) -> int:
        return len(self.dataloader)

    def state_dict(self) -> dict:
        """The reading position, the rows in play and the accounting (for verl's checkpoints, between steps)."""
        manager = self.trainer.async_rollout_manager
        if not self._started:  # nothing drawn: what a restore handed over is still to replay
            position, unread = self._stream.read_position()
            in_play = (dataclasses.replace(self._resumed, rows=[], episodes=0) if self._resumed
                       else RowsInPlay([], 0, {}, 0))
        else:
            with manager.drawing_paused():
                in_play = manager.rows_in_play()
                position, unread = self._stream.read_position()
        return {"format": ROWS_IN_PLAY_FORMAT, "loader": position, "unread_rows": unread,
                "in_play": dataclasses.asdict(in_play)}

    def load_state_dict(self, state: dict) -> None:
        """Restore a checkpoint's state (verl's resume): the reading position, and the rows to draw again first."""
        self.restored = True
        if state.get("format") != ROWS_IN_PLAY_FORMAT:
            self.dataloader.load_state_dict(state)
            return
        self.dataloader.load_state_dict(state["loader"])
        self._resumed = RowsInPlay(**state["in_play"])
        self._stream.replay([*self._resumed.rows, *state["unread_rows"]])
        print(f"[beyond_agent] resumed rows: {len(self._resumed.rows)} in play at the checkpoint "
              f"({self._resumed.episodes} episodes, replayed) and {len(state['unread_rows'])} read but not drawn, "
              f"drawn first", flush=True)

    def restore_from(self, folder: Path) -> None:
        """Load the state verl saved in `folder`/data.pt, where verl's resume skipped it (at an epoch boundary verl
        assumes an exhausted loader; ours reads ahead, and the rows in play are in the record)."""
        path = folder / "data.pt"
        if path.exists():
            self.load_state_dict(torch.load(path, weights_only=False))

    def __iter__(self):
        from verl.utils.dataset.rl_dataset import collate_fn

        manager = self.trainer.async_rollout_manager
        if not self._started:
            config = self.trainer.config
            manager.start_rows(self._stream, batch_size=config.data.train_batch_size,
                               samples_per_row=config.actor_rollout_ref.rollout.n,
                               trained_steps=self.trainer.global_steps - 1,
                               total_steps=self.trainer.total_training_steps, resumed=self._resumed)
            self._started = True
        for _ in range(len(self.dataloader)):
            yield collate_fn([{**row.row, ROW_KEY: row.key} for row in manager.take_rows()])


def resumed_checkpoint_folder(trainer_config: Any, global_steps: int) -> Path:
    """The folder verl's `_load_checkpoint` resumed from at `global_steps`: `resume_from_path` in that mode, else the
    step's folder under `default_local_dir` (relative paths from the working directory, as verl reads them)."""
    if trainer_config.resume_mode == "resume_path":
        return Path(trainer_config.resume_from_path).absolute()
    return Path(trainer_config.default_local_dir, f"global_step_{global_steps}").absolute()


def rollout_servers(checkpoint_manager: Any) -> list[Any]:
    """verl's rollout server actors (every replica's), as its checkpoint manager holds them."""
    return [server for replica in checkpoint_manager.replicas for server in replica.servers]


def wrap_weight_sync(checkpoint_manager: Any, rollout: Any | None, lora_plan: LoraPlan | None,
                     take_actor_output: Callable[[], Any | None], served: ServedWeightsMonitor | None = None) -> None:
    """Wrap verl's `checkpoint_manager.update_weights` (which `fit()` calls after each actor update) once:

    - every sync holds this host's lock of the Ray job id (`beyond_agent.weights.host_lock`): verl names the
      weight-sync sockets of every run that starts its own Ray cluster alike, and two such syncs at once hang;
    - with an async `rollout` (our manager), the sync waits in the rollout's version gate (for generation requests
      in flight, or whole episodes without partial rollout) and then publishes the new policy version;
    - the sync's metrics (delta mode's `beyond_agent/weight_sync/*`; in full mode the sync's seconds, `transfer_s`, and with
      LoRA the adapter's `bytes_sent`) join the metrics of the actor update it carries (`take_actor_output()`:
      that update's output, or None). verl's `fit()` discards update_weights' return value but reduces the actor
      output's metrics after the call; the syncs with no actor update before them (the first one, critic
      warm-up) are printed by the delta backend only;
    - then `served` (the `served_weights` integrity monitor) compares what vLLM serves with the trained model.
    """
    job_id = ray.get_runtime_context().get_job_id()
    servers = rollout_servers(checkpoint_manager)
    if rollout is not None and rollout.gate.partial_rollout == "token":  # a sync interrupts the turns in flight
        rollout.gate.interrupt = lambda: interrupt_servers(servers)

    def around(sync: Callable) -> Callable:
        def locked_sync(global_steps: int | None):
            with weight_sync_lock(job_id):
                started = time.perf_counter()
                result = sync(global_steps)
            if not result:  # verl's own (full) sync returns nothing: its seconds, and with LoRA the adapter's bytes
                result = {METRIC_PREFIX + "transfer_s": time.perf_counter() - started}
                if lora_plan is not None and lora_plan.adapter_bytes is not None:
                    result[METRIC_PREFIX + "bytes_sent"] = float(lora_plan.adapter_bytes)
            return result

        def update_weights(global_steps: int | None = None):
            if rollout is None:
                result = locked_sync(global_steps)
            else:
                with rollout.gate.updating(int(global_steps or 0)):
                    result = locked_sync(global_steps)
                rollout.version_changed()
            if served is not None:
                result = {**(result or {}), **served.observe(int(global_steps or 0),
                                                             checkpoint_manager.actor_wg.workers, servers)}
            output = take_actor_output()
            if isinstance(result, dict) and result and output is not None:
                output.meta_info["metrics"].update(result)
            return result

        return update_weights

    wrap_update_weights(checkpoint_manager, around)


ABORT_TIMEOUT_S = 30.0
"""How long one server's abort may take before the interrupt fails (the update then waits for the requests)."""


def abort_generation(server: Any) -> int:
    """Run on one of verl's vLLM server actors (Ray's `__ray_call__`, which runs it on a thread of the actor): abort
    every request its engine is generating, as vLLM's own `/abort_requests` does, so that each answers at once with the
    tokens it sampled so far (stop reason "aborted"); returns how many. The abort runs on the engine's event loop, the
    one its output handler runs on. verl's `abort_all_requests` would also pause the engine (and its vLLM call fails on
    vLLM 0.32, which removed the keyword it passes)."""
    engine = getattr(server, "engine", None)
    handler = getattr(engine, "output_handler", None) if engine is not None else None
    if handler is None:  # no engine on this server (another node rank), or no request ever reached it
        return 0
    return asyncio.run_coroutine_threadsafe(abort_in_flight(engine), handler.get_loop()).result(ABORT_TIMEOUT_S)


async def abort_in_flight(engine: Any) -> int:
    """Abort every request a vLLM AsyncLLM is generating, by internal id, parallel-sampling parents included (on its
    loop, where those tables change); how many."""
    processor = engine.output_processor
    request_ids = [*processor.request_states, *processor.parent_requests]
    if request_ids:
        await engine.abort(request_ids, internal=True)
    return len(request_ids)


def freeze_heap(_actor: Any = None) -> int:
    """Collect this process's garbage once, then move every object still alive into the collector's permanent
    generation (`gc.freeze`); returns how many objects it holds. Runs in-process or on a Ray actor (`__ray_call__`
    passes the actor, unused). Why: verl calls `gc.collect()` at least three times in every weight sync of an actor
    worker (`aggressive_empty_cache` before and after, the bucket sender's cleanup) and more in each step, and each
    call walks every object the process holds: ~0.35 s with torch, verl and vLLM imported, ~0.5 s with the model in
    an actor worker (2 cores). What is alive once the workers are up (imports, the model, the engine) lives as long
    as the process; what is made later is collected as before. vLLM freezes its engine core's and workers' heaps
    itself."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def freeze_long_lived_heaps(checkpoint_manager: Any) -> dict[str, list[int]]:
    """`freeze_heap` in this process (the trainer), in every actor worker and in every vLLM server actor, once their
    models and engines are up (before the first weight sync); the objects frozen in each, printed and returned."""
    servers = rollout_servers(checkpoint_manager)
    workers = checkpoint_manager.actor_wg.workers
    frozen = {"trainer": [freeze_heap()],
              "actor workers": ray.get([worker.__ray_call__.remote(freeze_heap) for worker in workers]),
              "vLLM servers": ray.get([server.__ray_call__.remote(freeze_heap) for server in servers])}
    print("[beyond_agent] long-lived heaps frozen (gc.freeze; objects): "
          + ", ".join(f"{where} {counts}" for where, counts in frozen.items()), flush=True)
    return frozen


def install_target_kl(checkpoint_manager: Any, target: float, backtrack: bool) -> None:
    """`beyond_agent.target_kl`: the stop of a step's actor updates past that drift, in every actor worker
    (`beyond_agent.algorithms.target_kl`); with `target_kl_backtrack`, each update past it halved or undone."""
    workers = checkpoint_manager.actor_wg.workers
    ray.get([worker.__ray_call__.remote(target_kl.install, target, backtrack) for worker in workers])
    bound = "; each update past it halved until within it, or undone" if backtrack else ""
    print(f"[beyond_agent] target-KL stop: a step's actor updates stop past a drift of {target} from the sampling "
          f"policy{bound} ({len(workers)} actor workers)", flush=True)


def target_kl_figures(checkpoint_manager: Any) -> dict[str, float]:
    """The target-KL stop's figures of the step just trained, from every actor worker (each starts the next step
    afresh); the ranks decide alike, so the first rank's figures are the step's."""
    figures = ray.get([worker.__ray_call__.remote(target_kl.take_step_figures)
                       for worker in checkpoint_manager.actor_wg.workers])
    return figures[0]


def interrupt_servers(servers: list[Any]) -> None:
    """Abort the requests in flight at each of verl's vLLM servers (the version gate's token mode)."""
    ray.get([server.__ray_call__.remote(abort_generation) for server in servers])


def log_prob_gap_metrics(trainer: torch.Tensor, rollout: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout's sampling log-probs are from the trainer's recomputation, over response tokens.

    Non-zero even at zero staleness (different kernels and precision); with stale tokens it also holds the
    policy's drift. `ratio_mean` is the mean importance ratio π_trainer / π_rollout.
    """
    gap = token_log_prob_gaps(trainer, rollout, response_mask)
    if gap is None:
        return {}
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
