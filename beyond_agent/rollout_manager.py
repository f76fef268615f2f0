"""BeyondAgentLoopManager: verl's rollout manager seam, filled with our ParallelEnvManager.

verl 0.9's RayPPOTrainer builds its rollout manager as
`AgentLoopManager.create(config=, llm_client=, teacher_client=, reward_loop_worker_handles=)` and lets a
config key swap the class (`actor_rollout_ref.rollout.agent.agent_loop_manager_class`); `fit()` then calls
`generate_sequences(batch)` once per step with `meta_info["global_steps"]`. BeyondAgentTrainer sets that
key to this class, so verl's `fit()` runs unchanged and every episode is played against envservice.

Each row becomes one episode with its own AgentTask (`TaskTable.for_row`: the row's `task`, else its env's
entry, else `default`) and its own prompt (verl's `raw_prompt`, from the parquet `prompt` column), so one
batch can mix environments, parsers and rewards. What goes back to verl per row is `rollout/batch.py`'s
`training_batch`; a per_call agent episode's earlier samples wait here (`take_segment_rows`) for the
trainer, which adds them to the batch once verl has joined it with the input rows. Our metrics of a training
step (`beyond_agent/...`, each task's own under `beyond_agent/task/<name>/`, beyond_agent/multitask.py) wait
here until the trainer takes them (`take_step_metrics`) into the metrics of that step's update; validation's
reach the trainer through `take_validation_metrics`. (verl's `meta_info["timing"]` channel would log them as
`timing_s/...`, as if success were a duration; runs before 2026-11-26 did, see
`run_folder.EARLIER_METRICS_PREFIXES`.)

With `beyond_agent.rollout_mode: async` the training episodes are played ahead, in the background, by an
`AsyncEpisodePool` (rollout/async_pool.py) that the trainer feeds from its dataloader (`start_rows`,
`take_rows`); `generate_sequences` then returns the finished episodes of the rows verl hands it, found by the
row key the trainer's loader wrote (`ROW_KEY`). Dynamic sampling (rollout/dynamic_sampling.py) goes the same
way in sync mode: `take_rows` plays a batch of rows on the spot, drops the groups without signal and plays
new rows in their place, before the batch reaches verl. Validation always plays its episodes on the spot.

The round limit of each step comes from a `RoundLimit` (rollout/rounds.py): the schedule's value, raised from
the episodes each step trained on for `rounds.type: adaptive`; the limit is logged as `beyond_agent/max_rounds`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ContextManager, Iterator

from envservice.client import EnvClient
from beyond_agent.multitask import VAL_PREFIX, task_name, task_names, task_rollout_metrics
from beyond_agent.rollout.async_pool import AsyncEpisodePool, PendingRow, RowsInPlay
from beyond_agent.rollout.batch import NothingToTrain, SegmentRows, segment_batch, training_batch, untrainable
from beyond_agent.rollout.episode_loop import EpisodeResult, EpisodeSpec, place_seeds
from beyond_agent.algorithms.gigpo import group_has_step_signal
from beyond_agent.rollout.dynamic_sampling import GroupSieve, StepSignal, groups_with_signal
from beyond_agent.gateway import Gateway, GatewayConfig
from beyond_agent.gateway.agents import AgentEnvManager
from beyond_agent.gateway.server import GatewayServer
from beyond_agent.integrity import NoSignalMonitor, RewardHackMonitor
from beyond_agent.rollout.env_manager import ParallelEnvManager, RolloutOutput, summarize
from beyond_agent.rollout.llm import AsyncLLMServerManager, VerlLLMServerBackend
from beyond_agent.rollout.rounds import RoundLimit
from beyond_agent.rollout.seats import OpponentModels, SelfPlayEnvManager, seat_metrics
from beyond_agent.rollout.versions import PolicyVersionGate
from beyond_agent.run_folder import METRICS_PREFIX
from beyond_agent.settings import BeyondAgentConfig
from beyond_agent.tasks import TaskTable
from beyond_agent.trajectories import episode_record, write_dump

logger = logging.getLogger(__name__)

ROW_KEY = "beyond_agent_row_key"
"""Non-tensor field the async loader writes on every row it hands verl: the key of its finished episodes."""
GATEWAY_MODEL_NAME = "policy"
"""The model name a user's agent sends to the gateway (its `AgentContext.model`)."""


def rows_to_episodes(non_tensor_batch: dict, default_env_id: str | None, tasks: TaskTable) -> list[EpisodeSpec]:
    """One EpisodeSpec per row, from the row's `extra_info` (written by beyond_agent.data), its
    `raw_prompt` (verl's copy of the parquet `prompt`) and its task (extra_info.task or a `task` column)."""
    extra_infos = non_tensor_batch.get("extra_info")
    if extra_infos is None:
        raise ValueError("the batch has no `extra_info` column: write the dataset with "
                         "`python -m beyond_agent.data` (it stores env_id/task_id/seed/split there)")
    uids, prompts, task_column = (non_tensor_batch.get(key) for key in ("uid", "raw_prompt", "task"))
    specs = []
    for row, info in enumerate(extra_infos):
        info = dict(info or {})
        env_id = info.get("env_id") or default_env_id
        if not env_id:
            raise ValueError(f"row {row}: extra_info has no env_id and beyond_agent.env.env_id is not set")
        task_name = info.get("task") or (task_column[row] if task_column is not None else None)
        specs.append(EpisodeSpec(
            env_id=env_id, task_id=info.get("task_id"), seed=info.get("seed"), split=info.get("split") or "train",
            params=dict(info.get("params") or {}), group_id=str(uids[row]) if uids is not None else f"row{row}",
            index=row, agent_task=tasks.for_row(env_id, task_name),
            prompt=[dict(message) for message in prompts[row]] if prompts is not None else None))
    return specs


@dataclass
class PlayedRow:
    """A dataset row whose episodes were played on the spot (sync mode with dynamic sampling)."""

    key: str
    row: dict[str, Any]
    """The dataset row as the dataloader gave it (one element of each batch field)."""


@dataclass
class RowSource:
    """Where `take_rows` draws rows from in sync mode, and what it needs to play them."""

    rows: Iterator[dict]
    batch_size: int
    samples_per_row: int
    next_step: int


def outcome_only(result: EpisodeResult) -> EpisodeResult:
    """The result without its tokens and messages (what per-task metrics read, kept over a whole validation)."""
    return dataclasses.replace(result, episode=None, messages=[], step_rewards=[])


def rollout_metrics(output: RolloutOutput, llm_busy_s: float, tasks: list[str]) -> dict[str, float]:
    """Our metrics of one rollout, under `beyond_agent/`: the episodes' summary, the LLM server's busy time,
    the rollout's own extras (async mode's staleness and drops) and each task's metrics."""
    metrics = output.metrics.as_dict(prefix=METRICS_PREFIX)
    metrics[f"{METRICS_PREFIX}llm_busy_s"] = llm_busy_s
    metrics.update({f"{METRICS_PREFIX}{key}": value for key, value in output.extra.items()})
    metrics.update(task_rollout_metrics(tasks, output.results))  # beyond_agent/task/<name>/...
    played_by_agent = [result for result in output.results if result.agent_mode is not None]
    if played_by_agent:  # agent mode: how many rewrote their history, and the samples that added to the batch
        metrics[f"{METRICS_PREFIX}agent/per_call_episodes"] = float(
            sum(result.agent_mode == "per_call" for result in played_by_agent))
        metrics[f"{METRICS_PREFIX}agent/earlier_segments"] = float(
            sum(len(result.earlier_segments) for result in played_by_agent))
    metrics.update(seat_metrics(output.results, prefix=METRICS_PREFIX))  # games of several seats: each seat's
    return metrics


class BeyondAgentLoopManager:
    """The rollout manager verl's trainer calls: one ParallelEnvManager run per `generate_sequences`."""

    def __init__(self, config: Any, llm_client: Any, teacher_client: Any = None,
                 reward_loop_worker_handles: Any = None, llm: AsyncLLMServerManager | None = None):
        """`llm` replaces the front over verl's `llm_client` (e.g. vLLM servers over HTTP outside training)."""
        from verl.utils import hf_tokenizer

        self.config = config
        self.settings = BeyondAgentConfig.from_config(config)
        model = config.actor_rollout_ref.model
        self.tokenizer = hf_tokenizer(model.path, trust_remote_code=model.get("trust_remote_code", False))
        self.llm = llm or AsyncLLMServerManager(VerlLLMServerBackend(llm_client), self.settings.llm)
        self._dumped: dict[tuple[int, str], int] = {}  # (step, kind) -> episodes dumped by this process
        self.env_client = EnvClient(self.settings.env.url, token=self.settings.env.token,
                                    timeout=self.settings.env.timeout_s, pool_size=self.settings.concurrency)
        partial = self.settings.async_rollout.partial_rollout if self.settings.is_async else True  # read in async only
        self.gate = PolicyVersionGate(partial_rollout=partial, interrupt=self.llm.interrupt if self.llm.can_interrupt
                                      else None)
        """Weight versions of generated turns; the trainer's weight sync goes through it in async mode."""
        self.opponents = OpponentModels(self.settings.self_play.endpoints)
        """The self-play pool's frozen models (their LLM fronts open on first use and last the run)."""
        self.round_limit = RoundLimit(self.settings.rounds, record_dir=config.trainer.get("default_local_dir"))
        """The round limit of each step (adaptive: raised by the agent's episodes; kept in horizon.json)."""
        self.reward_hack = RewardHackMonitor(self.settings.integrity.reward_hack)
        """Watches each training step's rollouts for a cheap win or a collapse taking over (warn or stop)."""
        self.no_signal = NoSignalMonitor(self.settings.integrity.no_signal)
        """Counts the training steps in a row whose groups all scored alike (nothing to learn from; warn or stop)."""
        self._pool: AsyncEpisodePool | None = None
        self._row_source: RowSource | None = None  # sync mode's rows, with dynamic sampling
        self._serial = 0
        self._taken: dict[str, list[EpisodeResult]] = {}  # row key -> its n finished episodes, until verl asks
        self._taken_metrics: dict[str, float] = {}
        self._step_metrics: dict[str, float] = {}  # the last training rollout's, until the trainer takes them
        self._segments: SegmentRows | None = None  # the last training rollout's earlier segments, likewise
        self._validation: list[tuple[str, EpisodeResult]] = []  # (task, outcome) of this validation's episodes
        self._gateway: GatewayServer | None = None  # agent mode's gateway, started on first use
        self._agent = (self.settings.agent.load(self.settings.episode.episode_timeout_s)
                       if self.settings.agent.active else None)

    @classmethod
    def create(cls, config: Any, llm_client: Any, teacher_client: Any = None,
               reward_loop_worker_handles: Any = None) -> "BeyondAgentLoopManager":
        """verl's factory signature (its own manager's `create` is async and starts Ray workers; ours needs none)."""
        return cls(config, llm_client, teacher_client, reward_loop_worker_handles)

    def generate_sequences(self, prompts: Any) -> Any:
        """Play one episode per row and return verl's rollout batch (see the module docstring)."""
        meta = dict(prompts.meta_info)
        settings = self.settings
        busy_before = self.llm.metrics().busy_time_s
        if not meta.get("validate") and ROW_KEY in prompts.non_tensor_batch:
            output = self._finished_output(prompts.non_tensor_batch[ROW_KEY])
        else:
            specs = place_seeds(rows_to_episodes(prompts.non_tensor_batch, settings.env.env_id, settings.tasks),
                                settings.sampling_seed, "validate" if meta.get("validate") else "step",
                                int(meta.get("global_steps", 0)))
            manager = self._episode_manager(settings.sampling(meta), gated=self._pool is not None,
                                            validate=bool(meta.get("validate")))
            output = manager.run(specs, max_rounds=self._max_rounds(meta))
        limits = (self.tokenizer.pad_token_id, settings.episode.max_prompt_length,
                  settings.episode.max_response_length)
        batch = training_batch(output.results, prompts, *limits, group_based=settings.group_based)
        if not meta.get("validate"):
            if (reason := untrainable(output.results, batch.batch["response_mask"])) is not None:
                raise NothingToTrain(f"training step {meta.get('global_steps')}: {reason}")
            self._segments = segment_batch(output.results, *limits, group_based=settings.group_based)
        tasks = task_names(prompts.non_tensor_batch, len(output.results))
        if meta.get("validate"):
            self._validation.extend(zip(tasks, map(outcome_only, output.results)))
        else:
            step = int(meta.get("global_steps", 0))
            self._step_metrics = rollout_metrics(output, self.llm.metrics().busy_time_s - busy_before, tasks)
            horizon = self.round_limit.observe(step, output.results)
            self._step_metrics.update({f"{METRICS_PREFIX}{key}": value for key, value in horizon.items()})
            self._step_metrics.update(self.reward_hack.observe(step, output.metrics))
            signal = groups_with_signal(output.results, settings.group_based, self._step_signal())
            self._step_metrics.update(self.no_signal.observe(step, *signal, output.metrics))
        batch.meta_info = {"timing": {}, "reward_extra_keys": ["success"]}  # fit() reads "timing"; ours wait
        self._log_step(meta, output)
        return batch

    def take_segment_rows(self) -> SegmentRows | None:
        """The earlier segments of the last training rollout's per_call agent episodes, once (the trainer adds
        them to the batch verl joined with that rollout; `rollout.batch.add_segment_rows`); None when none."""
        segments, self._segments = self._segments, None
        return segments

    def take_step_metrics(self) -> dict[str, float]:
        """Our metrics of the last training rollout (`beyond_agent/...`), once: the trainer adds them to the
        metrics of that step's update; {} when none is waiting."""
        metrics, self._step_metrics = self._step_metrics, {}
        return metrics

    def take_validation_metrics(self) -> dict[str, float]:
        """Per-task metrics of the validation episodes played since the last call
        (`val-aux/beyond_agent/task/<name>/...`), and for games of several seats each seat's and each opponent's
        (`val-aux/beyond_agent/opponent/<name>/win`: the win rate against a fixed player); verl validates in several
        batches, this sums them up. Rows verl added to pad a batch to a multiple of agent.num_workers are counted
        too."""
        tasks, results = zip(*self._validation) if self._validation else ((), ())
        self._validation = []
        return {**task_rollout_metrics(tasks, results, prefix=VAL_PREFIX),
                **seat_metrics(list(results), prefix=f"val-aux/{METRICS_PREFIX}")}

    def _max_rounds(self, meta: dict) -> int:
        """The round limit of one rollout call: the horizon's at verl's global step (validation may fix it)."""
        if meta.get("validate") and self.settings.val_max_rounds:
            return self.settings.val_max_rounds
        return self.round_limit.max_rounds(int(meta.get("global_steps", 0)), validate=bool(meta.get("validate")))

    def _episode_manager(self, sampling: Any, gated: bool, validate: bool = False) -> ParallelEnvManager:
        """Episodes with this sampling; `gated`: through the version gate (async mode), so that weight syncs
        wait for requests in flight and every turn records its version; `validate`: validation's (self-play games
        then face `self_play.validation_opponent`)."""
        generate = self.llm.with_sampling(sampling)
        if gated:
            generate = self.gate.generate_fn(generate)
        if self.settings.agent.active:  # a user's agent plays them, through the gateway
            gateway = self._gateway_server()
            return AgentEnvManager(self.env_client, generate, self.tokenizer, self.settings.episode, gateway.gateway,
                                   gateway.url, self._agent, max_workers=self.settings.concurrency,
                                   gateway_socket=gateway.socket_path)
        if self.settings.self_play.active:  # the policy plays every seat of each game
            self_play = self.settings.self_play.for_validation() if validate else self.settings.self_play
            return SelfPlayEnvManager(self.env_client, generate, self.tokenizer, self.settings.episode, self_play,
                                      max_workers=self.settings.concurrency, models=self.opponents)
        return ParallelEnvManager(self.env_client, generate, self.tokenizer, self.settings.episode,
                                  max_workers=self.settings.concurrency)

    def _gateway_server(self) -> GatewayServer:
        """The OpenAI-compatible gateway the agents call, started on first use (a loopback port of this process)."""
        if self._gateway is None:
            episode = self.settings.episode
            gateway = Gateway(GatewayConfig(model_name=GATEWAY_MODEL_NAME, max_prompt_length=episode.max_prompt_length,
                                            max_response_length=episode.max_response_length,
                                            max_tokens_per_turn=episode.max_tokens_per_turn,
                                            merge=self.settings.agent.merge,
                                            max_calls=self.settings.agent.max_calls,
                                            max_concurrent_calls=self.settings.concurrency), self.tokenizer)
            self._gateway = GatewayServer(gateway).start()
            agent = self.settings.agent.function or self.settings.agent.command
            print(f"[beyond_agent] gateway for the agent {agent} on {self._gateway.url}", flush=True)
        return self._gateway

    # ---- rows played before verl sees them: async rollout, dynamic sampling ---------------------

    def start_rows(self, rows: Iterator[dict], batch_size: int, samples_per_row: int, trained_steps: int,
                   total_steps: int | None = None, resumed: RowsInPlay | None = None) -> None:
        """Draw training rows from `rows` from now on: in async mode episodes start playing in the background
        (none beyond what steps up to `total_steps` can train); in sync mode each `take_rows` plays its batch.
        `resumed`: what the checkpoint of a resumed run recorded (`rows` replays its rows first)."""
        if not self.settings.is_async:
            self._serial = resumed.serial if resumed is not None else self._serial
            self._row_source = RowSource(rows, batch_size, samples_per_row, next_step=trained_steps + 1)
            return
        self._start_async(rows, batch_size, samples_per_row, trained_steps, total_steps, resumed)

    def drawing_paused(self) -> ContextManager[None]:
        """No training row is drawn while inside (a checkpoint records what is in play); sync mode draws in the
        trainer's own thread."""
        return self._pool.drawing_paused() if self._pool is not None else nullcontext()

    def rows_in_play(self) -> RowsInPlay:
        """The rows drawn and not trained yet, with the accounting so far (call inside `drawing_paused`, between
        steps; in sync mode nothing is in play between steps)."""
        if self._pool is None:
            return RowsInPlay(rows=[], episodes=0, counts={}, serial=self._serial)
        return self._pool.rows_in_play()

    def take_rows(self) -> list[PendingRow] | list[PlayedRow]:
        """The next training step's rows, all episodes finished (async: blocks until they are; sync: plays them)."""
        if self._pool is None:
            return self._play_rows_now()
        taken = self._pool.take_batch()
        for row in taken.rows:
            self._taken[row.key] = row.results()
        self._taken_metrics = taken.metrics
        return taken.rows

    def _step_signal(self) -> StepSignal | None:
        """GiGPO's step-level test for the dynamic-sampling sieve (a group of equal returns may still train); None
        for an episode-level estimator."""
        if self.settings.adv_estimator != "gigpo":
            return None
        gigpo = self.settings.gigpo
        return lambda results: group_has_step_signal(results, gigpo)

    def _row_specs(self, key: str, row: dict, samples_per_row: int) -> list[EpisodeSpec]:
        """The episodes of one dataset row: one GRPO group, keyed by `key`."""
        group = {name: [row.get(name)] * samples_per_row for name in ("extra_info", "raw_prompt", "task")
                 if name in row}
        group["uid"] = [key] * samples_per_row
        # Keys count the rows drawn (s1, s2... in sync mode, r1, r2... in async mode): a row's place in the run.
        return place_seeds(rows_to_episodes(group, self.settings.env.env_id, self.settings.tasks),
                           self.settings.sampling_seed, "row", key)

    def _play_rows_now(self) -> list[PlayedRow]:
        """Sync mode with dynamic sampling: play a batch of rows, and new rows in place of the groups the sieve
        drops, until the batch is full (the sieve's budget bounds the extra rows)."""
        source, settings = self._row_source, self.settings
        step, source.next_step = source.next_step, source.next_step + 1
        manager = self._episode_manager(settings.train_sampling, gated=False)
        sieve = GroupSieve(settings.dynamic_sampling, source.batch_size, self._step_signal())
        max_rounds, started, kept = self.round_limit.max_rounds(step), time.monotonic(), []
        while len(kept) < source.batch_size:
            rows = []
            for _ in range(source.batch_size - len(kept)):
                self._serial += 1
                rows.append(PlayedRow(f"s{self._serial}", next(source.rows)))
            specs = [spec for row in rows for spec in self._row_specs(row.key, row.row, source.samples_per_row)]
            results = manager.run(specs, max_rounds=max_rounds).results
            for index, row in enumerate(rows):
                group = results[index * source.samples_per_row:(index + 1) * source.samples_per_row]
                if sieve.offer(group, task_name(row.row)):
                    self._taken[row.key] = group
                    kept.append(row)
        self._taken_metrics = {**sieve.metrics(), "dynamic_sampling/play_s": time.monotonic() - started}
        return kept

    def _start_async(self, rows: Iterator[dict], batch_size: int, samples_per_row: int, trained_steps: int,
                     total_steps: int | None, resumed: RowsInPlay | None) -> None:
        settings = self.settings
        manager = self._episode_manager(settings.train_sampling, gated=True)

        def make_specs(key: str, row: dict) -> list[EpisodeSpec]:
            return self._row_specs(key, row, samples_per_row)

        def run_episode(spec: EpisodeSpec, max_rounds: int) -> EpisodeResult:
            with self.gate.episode():
                return manager.episode_loop(spec, max_rounds).run()

        self._pool = AsyncEpisodePool(
            rows, make_specs, run_episode, self.round_limit.max_rounds, self.gate,
            batch_size, settings.async_rollout, settings.concurrency,
            describe=lambda spec: spec.agent_task.label, total_steps=total_steps,
            dynamic_sampling=settings.dynamic_sampling, step_signal=self._step_signal(), row_task=task_name)
        self._pool.start(trained_steps, resumed)

    def version_changed(self) -> None:
        """The trainer synced new weights: the pool may draw rows again."""
        if self._pool is not None:
            self._pool.version_changed()

    def close_async(self) -> dict[str, int]:
        """Stop the background rollout; the run's accounting of every admitted episode."""
        if self._pool is None:
            return {}
        accounting = self._pool.close()
        print(f"[beyond_agent] async rollout accounting: {accounting}", flush=True)
        return accounting

    def _finished_output(self, row_keys: Any) -> RolloutOutput:
        """The taken episodes of these rows, in verl's row order (rows repeated n times, interleaved)."""
        seen: dict[str, int] = {}
        results = []
        for key in row_keys:
            if key not in self._taken:
                raise KeyError(f"row {key!r} was not handed out by BeyondAgentTrainer's loader; in async mode and "
                               "with dynamic sampling every training batch must come from it")
            index = seen.get(key, 0)
            seen[key] = index + 1
            results.append(self._taken[key][index])
        walls = [r.wall_time_s for r in results]
        output = RolloutOutput(results=results, metrics=summarize(results, max(walls, default=0.0)),
                               extra=dict(self._taken_metrics))
        for key in seen:
            self._taken.pop(key, None)
        return output

    def _log_step(self, meta: dict, output: RolloutOutput) -> None:
        step = int(meta.get("global_steps", 0))
        m = output.metrics
        kind = "validation" if meta.get("validate") else "training"
        print(f"[beyond_agent] step {step} {kind} rollout: {m.episodes} episodes, success {m.success_rate:.3f}, "
              f"mean rounds {m.mean_rounds:.2f}, terminations {m.terminations}, wall {m.wall_time_s:.1f} s", flush=True)
        every = self.settings.trajectories.every
        if every and (meta.get("validate") or step % every == 0):
            self._dump_trajectories(step, "val" if meta.get("validate") else "train", output.results,
                                    meta.get("policy_version"))

    def _dump_trajectories(self, step: int, kind: str, results: list[EpisodeResult],
                           policy_version: int | None) -> None:
        # verl validates in as many batches as data.val_batch_size makes: the first batch of a step starts
        # its file, later ones add to it, all of them together up to max_per_step episodes.
        written = self._dumped.get((step, kind), 0) if kind == "val" else 0
        every_seat = [seat for result in results for seat in (result, *result.other_seats)]  # self-play: each seat's
        kept = every_seat[: max(self.settings.trajectories.max_per_step - written, 0)]
        if written and not kept:
            return
        write_dump(Path(self.settings.trajectories.dir), step, kind,
                   (episode_record(result, step, kind, policy_version) for result in kept), append=written > 0)
        self._dumped[(step, kind)] = written + len(kept)
