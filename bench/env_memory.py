"""Memory bench of one environment: what N open sessions cost, and whether releasing them gives it back.

    python bench/env_memory.py --env textcraft --sessions 1000 [--rounds 3] [--steps 3] [--trim] [--tracemalloc]

What it measures: in this one process (the service's in-process backend, no HTTP), each round
1. creates `--sessions` sessions through `envservice.sessions.SessionManager` (task `i % tasks`, seed `i`),
   takes up to `--steps` actions in each, and holds all of them open at once;
2. releases them all;
and prints the process's resident set size (RSS, MiB, from /proc/self/status VmRSS, else psutil) before the
round, with all sessions open, and after releasing them, after a `gc.collect()` each time. From that:
- `per session` = (RSS open - RSS before) / sessions: what one open session costs;
- `retained` = RSS after releasing - RSS before the round: what released sessions keep. Part of it may be the
  allocator keeping freed memory rather than a leak; `--trim` calls glibc's `malloc_trim(0)` before each
  reading to take that part out, and `--tracemalloc` also prints the memory Python objects hold (exact, but
  several times slower). A leak shows as RSS (and traced memory) after release that keeps growing from one round
  to the next; a healthy env is flat after the first (warm-up) round.

Any registered env id works (`envservice.registry.registered_ids()`); its sessions count against the env's
`max_sessions`, so `--sessions` must stay within it (textcraft: 1024).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import sys
import time
import tracemalloc

from envservice import registry
from envservice.backends import InProcessBackend
from envservice.errors import EnvServiceError
from envservice.protocol import CreateRequest
from envservice.sessions import SessionManager

ENV_ACTIONS = {
    "textcraft": ["inventory", "get 1 oak logs", "craft 4 oak planks using 1 oak logs", "get 5000 stick", "dance"],
    "frozenlake": ["left", "down", "right", "up"],
    "babyai": ["turn left", "go forward", "turn right", "pick up"],
    "code": ['{"name": "write", "arguments": {"code": "    return None\\n"}}', '{"name": "run"}'],
    "terminal": ["ls -la", "wc -l *"],
}
"""A few actions per env (any other env gets `DEFAULT_ACTIONS`); a session steps through the first `--steps`."""
DEFAULT_ACTIONS = ["look", "inventory", "help", "wait"]


def rss_mib() -> float:
    """Resident set size of this process in MiB."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import psutil  # not on Linux: fall back to psutil

    return psutil.Process().memory_info().rss / 2**20


_LIBC = None


def malloc_trim() -> None:
    """Hand the allocator's free memory back to the OS (glibc only; a no-op elsewhere)."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        _LIBC = ctypes.CDLL(name) if name else False
    if _LIBC and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def measure(trim: bool) -> tuple[float, float | None]:
    """(RSS MiB, traced MiB or None) after a full garbage collection."""
    gc.collect()
    if trim:
        malloc_trim()
    traced = tracemalloc.get_traced_memory()[0] / 2**20 if tracemalloc.is_tracing() else None
    return rss_mib(), traced


def fmt(reading: tuple[float, float | None]) -> str:
    rss, traced = reading
    return f"{rss:8.1f}" + (f" (py {traced:7.1f})" if traced is not None else "")


def run_round(manager: SessionManager, env_id: str, sessions: int, tasks: int, actions: list[str]) -> dict:
    """Open `sessions` sessions, step each, keep all open; return their ids and counters."""
    ids, steps, step_errors = [], 0, 0
    for i in range(sessions):
        created = manager.create(CreateRequest(env_id=env_id, task_id=i % tasks, seed=i))
        ids.append(created.session_id)
        for action in actions:
            try:
                response = manager.step(created.session_id, action)
            except EnvServiceError as exc:  # an env error closes the session: count it, carry on
                step_errors += 1
                print(f"  step {action!r} failed: {exc.message[:200]}", file=sys.stderr)
                break
            steps += 1
            if response.terminated or response.truncated:
                break
    return {"ids": ids, "steps": steps, "step_errors": step_errors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--env", default="textcraft", help="registered env id (default: textcraft)")
    parser.add_argument("--sessions", type=int, default=1000, help="sessions held open at once per round")
    parser.add_argument("--rounds", type=int, default=3, help="create-all / release-all rounds")
    parser.add_argument("--steps", type=int, default=3, help="actions taken in each session (at most)")
    parser.add_argument("--split", default="train", help="task split (default: train)")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) before each reading")
    parser.add_argument("--tracemalloc", action="store_true", help="also report memory held by Python objects")
    args = parser.parse_args(argv)

    known = registry.registered_ids()
    if args.env not in known:
        parser.error(f"unknown env id {args.env!r}; registered: {', '.join(known)}")
    registration = registry.get(args.env)
    env_class = registration.env_class()
    if args.sessions > registration.max_sessions:
        parser.error(f"--sessions {args.sessions} is over {args.env}'s max_sessions ({registration.max_sessions})")
    tasks = env_class.task_counts()[args.split]
    actions = ENV_ACTIONS.get(args.env, DEFAULT_ACTIONS)[:args.steps]
    if args.tracemalloc:
        tracemalloc.start()

    manager = SessionManager([args.env], max_sessions=max(args.sessions, 1), idle_timeout_s=1e9,
                             backend=InProcessBackend(step_timeout_s=0))
    start = measure(args.trim)
    print(f"env {args.env}: {args.sessions} sessions x {args.rounds} rounds, actions {actions}, "
          f"{tasks} {args.split} tasks; RSS MiB{' (trimmed)' if args.trim else ''} at start: {fmt(start)}",
          flush=True)
    print(f"{'round':>5} {'before':>8} {'open':>8} {'released':>8} {'per session':>11} {'retained':>8} "
          f"{'create+step s':>13} {'release s':>9}", flush=True)
    rows = []
    try:
        for round_index in range(1, args.rounds + 1):
            before = measure(args.trim)
            t0 = time.perf_counter()
            opened = run_round(manager, args.env, args.sessions, tasks, actions)
            t1 = time.perf_counter()
            at_open = measure(args.trim)
            t2 = time.perf_counter()
            for session_id in opened["ids"]:
                manager.release(session_id)
            t3 = time.perf_counter()
            released = measure(args.trim)
            per_session = (at_open[0] - before[0]) / args.sessions
            retained = released[0] - before[0]
            rows.append((before, at_open, released, per_session, retained))
            print(f"{round_index:>5} {before[0]:8.1f} {at_open[0]:8.1f} {released[0]:8.1f} {per_session:11.3f} "
                  f"{retained:+8.1f} {t1 - t0:13.1f} {t3 - t2:9.1f}"
                  + (f"   py MiB {before[1]:.1f} / {at_open[1]:.1f} / {released[1]:.1f}" if args.tracemalloc else "")
                  + (f"   ({opened['step_errors']} step errors)" if opened["step_errors"] else ""), flush=True)
    finally:
        manager.shutdown()
    end = measure(args.trim)
    growth = rows[-1][2][0] - rows[0][2][0] if rows else 0.0
    print(f"RSS at end {fmt(end)} MiB; total growth from start {end[0] - start[0]:+.1f} MiB; "
          f"after-release growth from round 1 to round {len(rows)}: {growth:+.1f} MiB; "
          f"per session (mean) {sum(r[3] for r in rows) / max(len(rows), 1):.3f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
