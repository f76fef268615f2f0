"""How many sandboxed runs this machine starts and finishes per second (`sandbox/`, bubblewrap), by concurrency.

    python bench/sandbox_rate.py [--runs 40] [--concurrency 1 2 4] [--command python]

Each run is what the `code` and `terminal` envs pay per step beyond the work itself: a sandbox with its own
namespaces, limits and control groups around one command. `--command python` runs `python -I -c pass` (a code
env's run without the tests); `true` runs /bin/true (the sandbox alone); `bash` runs `bash -c true` (a terminal
command). Prints runs per second and the median and 95th-percentile latency of one run at each concurrency.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from sandbox import SandboxConfig, run_sandboxed

COMMANDS = {"python": ["python", "-I", "-c", "pass"], "true": ["true"], "bash": ["bash", "-c", "true"]}


def one_run(argv: list[str]) -> float:
    started = time.monotonic()
    done = run_sandboxed(argv, SandboxConfig(), wall_s=30)
    if done.returncode != 0:
        raise RuntimeError(f"a sandboxed run failed: {done.stderr.text()[-300:]}")
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--command", choices=sorted(COMMANDS), default="python")
    args = parser.parse_args()
    argv = COMMANDS[args.command]
    one_run(argv)  # warm: the probe and the page cache
    for workers in args.concurrency:
        started = time.monotonic()
        with ThreadPoolExecutor(workers) as pool:
            latencies = sorted(pool.map(lambda _: one_run(argv), range(args.runs)))
        wall = time.monotonic() - started
        p95 = latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))]
        print(f"{args.command}: concurrency {workers}: {args.runs / wall:.1f} runs/s, one run median "
              f"{statistics.median(latencies) * 1000:.0f} ms, p95 {p95 * 1000:.0f} ms")


if __name__ == "__main__":
    main()
