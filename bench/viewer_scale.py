"""How the run viewer copes with a big run: 1 000 steps x 128 episodes and 1 000 logged steps of metrics.

    python bench/viewer_scale.py [--steps 1000] [--episodes 128] [--response-tokens 2048] [--tokenizer DIR] [--json]

Writes a synthetic run folder (one dump file of `--episodes` records, hard-linked once per step, so the
disk holds it once while the viewer still reads a separate file per step), starts the real viewer process
on it, and times what the page asks for: the step list, a step's first page cold and warm, one whole
episode, the dashboard's panels and curves. It also reads the viewer's memory after 200 different
steps were opened (the step index keeps the last 64). Bytes are what the browser would download.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests

from envservice.childproc import ChildProcess, answers_200, free_port
from beyond_agent.trajectories import SCHEMA_VERSION, TrajectoryRecord, write_dump

TERMINATIONS = ("done", "max_rounds", "length", "env_error")
METRIC_KEYS = ([f"beyond_agent/{k}" for k in ("success_rate", "mean_reward", "mean_rounds", "env_time_s",
                                                       "llm_time_s", "llm_busy_s", "wall_time_s")]
               + [f"beyond_agent/termination/{t}" for t in TERMINATIONS]
               + ["actor/entropy", "actor/pg_loss", "actor/grad_norm", "critic/score/mean", "num_turns/mean"]
               + [f"filler/metric_{i}" for i in range(80)])


def synthetic_record(index: int, tokens: int, rng: random.Random) -> TrajectoryRecord:
    """One episode of `tokens` response tokens, a quarter of them trained, 8 turns."""
    mask = [1 if (position // 64) % 4 == 0 else 0 for position in range(tokens)]
    turn_ends = [position for position in range(tokens - 1) if mask[position] == 1 and mask[position + 1] == 0][:8]
    success = rng.random() < 0.3
    return TrajectoryRecord(
        schema=SCHEMA_VERSION, step=0, kind="train", index=index, env=rng.choice(["babyai", "textcraft"]),
        task=rng.randrange(500), split="train", seed=rng.randrange(10**6), agent_task="env", group=f"g{index // 8}",
        messages=[{"role": "user", "content": "observation " * 40}, {"role": "assistant", "content": "go forward"}] * 8,
        prompt_ids=[rng.randrange(150_000) for _ in range(512)],
        response_ids=[rng.randrange(150_000) for _ in range(tokens)], response_mask=mask,
        response_logprobs=[round(-rng.random() * 3, 4) if m else 0.0 for m in mask], turn_ends=turn_ends,
        step_rewards=[0.0] * len(turn_ends), reward=float(success), score=float(success), success=success,
        rounds=len(turn_ends), termination=rng.choice(TERMINATIONS), error=None, env_time_s=1.0, llm_time_s=5.0,
        wall_time_s=6.0)


def write_run(folder: Path, steps: int, episodes: int, tokens: int) -> int:
    """The synthetic run; returns the bytes of one step's dump."""
    rng = random.Random(0)
    dumps = folder / "checkpoints" / "trajectories"
    first = write_dump(dumps, 1, "train", (synthetic_record(i, tokens, rng) for i in range(episodes)))
    for step in range(2, steps + 1):
        os.link(first, dumps / f"step_{step}.jsonl")
    with (folder / "metrics.jsonl").open("w") as out:
        for step in range(1, steps + 1):
            out.write(json.dumps({"step": step, "data": {key: rng.random() for key in METRIC_KEYS}}) + "\n")
    return first.stat().st_size


def timed_get(url: str, repeats: int = 1, **params) -> tuple[float, int]:
    """(median seconds, bytes) of GET url."""
    times, size = [], 0
    for _ in range(repeats):
        started = time.perf_counter()
        answer = requests.get(url, params=params, timeout=300)
        times.append(time.perf_counter() - started)
        answer.raise_for_status()
        size = len(answer.content)
    return statistics.median(times), size


def measure(url: str, steps: int, viewer: psutil.Process) -> dict[str, float]:
    """The figures (see the module docstring)."""
    figures: dict[str, float] = {}
    figures["steps_list_s"], figures["steps_list_bytes"] = timed_get(f"{url}/api/steps", 5)
    figures["page_cold_s"], figures["page_bytes"] = timed_get(f"{url}/api/episodes", 1, step=steps // 2)
    figures["page_warm_s"], _ = timed_get(f"{url}/api/episodes", 5, step=steps // 2)
    figures["page_filtered_warm_s"], _ = timed_get(f"{url}/api/episodes", 5, step=steps // 2, termination="length")
    figures["episode_s"], figures["episode_bytes"] = timed_get(f"{url}/api/episode", 5, step=steps // 2, line=7)
    panels = requests.get(f"{url}/api/panels", timeout=60).json()
    keys = sorted({key for panel in panels["panels"] for key in panel["lines"] + panel["points"]})
    figures["panels_s"], figures["panels_bytes"] = timed_get(f"{url}/api/panels", 5)
    figures["curves_s"], figures["curves_bytes"] = timed_get(f"{url}/api/metrics", 5, keys=",".join(keys))
    figures["rss_mib_before_200_steps"] = viewer.memory_info().rss / 2**20
    started = time.perf_counter()
    for step in range(1, min(steps, 200) + 1):
        requests.get(f"{url}/api/episodes", params={"step": step}, timeout=300).raise_for_status()
    figures["open_200_steps_s"] = time.perf_counter() - started
    figures["rss_mib_after_200_steps"] = viewer.memory_info().rss / 2**20
    return figures


def main(argv: list[str] | None = None) -> int:
    """Build the run, start the viewer, print the figures."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--episodes", type=int, default=128)
    parser.add_argument("--response-tokens", type=int, default=2048)
    parser.add_argument("--tokenizer", default=None, help="token texts from this tokenizer (default: ids only)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="viewer-scale-") as tmp:
        folder = Path(tmp) / "big-run"
        started = time.perf_counter()
        dump_bytes = write_run(folder, args.steps, args.episodes, args.response_tokens)
        print(f"wrote {args.steps} steps x {args.episodes} episodes ({dump_bytes / 2**20:.1f} MiB per step, "
              f"{args.steps * dump_bytes / 2**30:.1f} GiB as the viewer sees it) in "
              f"{time.perf_counter() - started:.1f} s", file=sys.stderr)
        port = free_port()
        command = [sys.executable, "-m", "beyond_agent.viewer", str(folder), "--port", str(port)]
        child = ChildProcess.start(command + (["--tokenizer", args.tokenizer] if args.tokenizer else []), "viewer",
                                   Path(tmp) / "viewer.log")
        try:
            url = f"http://127.0.0.1:{port}"
            child.wait_until(lambda: answers_200(f"{url}/healthz"), 60, "answering /healthz")
            figures = {"steps": args.steps, "episodes_per_step": args.episodes,
                       "response_tokens": args.response_tokens, "dump_mib_per_step": dump_bytes / 2**20,
                       **measure(url, args.steps, psutil.Process(child.pid))}
        finally:
            child.stop()
    if args.json:
        print(json.dumps(figures))
    else:
        for key, value in figures.items():
            print(f"{key:28s} {value:,.4g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
