"""Load test of envservice: hold many sessions of a cheap env and step them from many client threads.

    .venv/bin/python bench/envservice_load.py --sessions 1000 --threads 32 --duration 20 [--backend process --workers 2]

Starts `python -m envservice --port 0` on 127.0.0.1 (loopback only), opens the sessions, steps them for
`--duration` seconds (or `--max-steps` steps, whichever comes first), then prints sessions held, steps/s,
p50/p99 step latency, errors and the resident memory of the server (and of its worker processes with
`--backend process`), and the CPU the server and this load generator used per step (on a machine with fewer
free cores than both need, their sum bounds steps/s), and stops the server it started. `--json` keeps the
figures (bench/run_all.py reads them). `--light-client` adds a second client host (127.0.0.2) asking /healthz back
to back on one connection the whole time: what the service's fair sharing between hosts
(envservice/host_slots.py) costs a trainer while another host is active, and that host's latency.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from abusive_clients import read_answer  # bench/ is on the path when this script runs
from envservice import registry
from envservice.client import EnvClient
from envservice.errors import EnvServiceError
from envservice.process import EnvServiceProcess

ACTIONS = ("left", "up")  # the agent stays in the start corner: episodes end only by truncation


def parse_args() -> argparse.Namespace:
    """Command-line options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=1000, help="sessions to hold open (default 1000)")
    parser.add_argument("--threads", type=int, default=32, help="client threads stepping them (default 32)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of stepping (default 20)")
    parser.add_argument("--max-steps", type=int, default=200_000, help="stop after this many steps")
    parser.add_argument("--env", default="frozenlake", help="env id (default frozenlake: cheap)")
    parser.add_argument("--backend", default="inprocess", help="envservice --backend: inprocess, process or ray")
    parser.add_argument("--workers", type=int, default=None, help="envservice --workers (process or ray backend)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    parser.add_argument("--service-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for the service (repeatable), "
                        "e.g. --service-arg=--loop-slots-per-host=0")
    parser.add_argument("--step-route", default="steps", choices=("steps", "step"),
                        help="steps: the client batches concurrent steps through POST /steps (its default); "
                        "step: each step alone through POST /step")
    parser.add_argument("--batches-in-flight", type=int, default=1,
                        help="with --step-route steps: /steps requests out at once (EnvClient's max_batches_in_flight)")
    parser.add_argument("--light-client", action="store_true",
                        help="also ask /healthz back to back from another loopback host (127.0.0.2) while stepping")
    return parser.parse_args()


LIGHT_CLIENT_ADDRESS = "127.0.0.2"
"""The light client's source address: another host to the service (Linux routes all of 127.0.0.0/8 to loopback)."""


def light_client(url: str, stop: threading.Event, latencies: list[float]) -> None:
    """/healthz back to back on one kept-alive connection from LIGHT_CLIENT_ADDRESS until `stop`."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    request = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n"
    with socket.create_connection((host, int(port)), timeout=30, source_address=(LIGHT_CLIENT_ADDRESS, 0)) as sock:
        buffered = b""
        while not stop.is_set():
            started = time.perf_counter()
            sock.sendall(request)
            _, buffered, _ = read_answer(sock, buffered)
            latencies.append(time.perf_counter() - started)


def rss_mb(pid: int) -> float:
    """Resident memory of a process in MB (Linux /proc)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the server process and its worker processes so far."""
    import psutil

    processes = [psutil.Process(pid), *(psutil.Process(child) for child in worker_pids(pid))]
    return sum(sum(process.cpu_times()[:2]) for process in processes)


def worker_pids(pid: int) -> list[int]:
    """The envservice worker processes of server `pid` (its multiprocessing-spawned children)."""
    children = {int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                for c in (task / "children").read_text().split()}
    return sorted(c for c in children if b"spawn_main" in Path(f"/proc/{c}/cmdline").read_bytes())


def memory_text(pid: int) -> str:
    """'server_rss_mb=100' plus the workers' RSS when there are workers."""
    text = f"server_rss_mb={rss_mb(pid):.0f}"
    workers = [rss_mb(child) for child in worker_pids(pid)]
    if workers:
        text += f" workers_rss_mb={'+'.join(f'{mb:.0f}' for mb in workers)} (total {sum(workers) + rss_mb(pid):.0f})"
    return text


class Stepper:
    """Steps a slice of sessions round-robin and records latencies and errors."""

    def __init__(self, client: EnvClient, env_id: str, session_ids: list[str]) -> None:
        self.client, self.env_id, self.session_ids = client, env_id, session_ids
        self.latencies: list[float] = []
        self.errors: dict[str, int] = {}

    def run(self, stop: threading.Event, budget: "Budget") -> None:
        """Step until `stop` is set or the shared step budget is spent."""
        turn = 0
        while not stop.is_set() and self.session_ids and budget.take():
            index = turn % len(self.session_ids)
            self._step_one(index, ACTIONS[turn % 2])
            turn += 1

    def _step_one(self, index: int, action: str) -> None:
        started = time.perf_counter()
        try:
            response = self.client.step(self.session_ids[index], action)
            self.latencies.append(time.perf_counter() - started)
            if response.terminated or response.truncated:
                self._renew(index)
        except (EnvServiceError, OSError) as exc:
            key = getattr(getattr(exc, "code", None), "value", type(exc).__name__)
            self.errors[key] = self.errors.get(key, 0) + 1

    def _renew(self, index: int) -> None:
        self.client.release(self.session_ids[index])
        self.session_ids[index] = self.client.create(self.env_id).session_id


class Budget:
    """A thread-safe step counter with a ceiling."""

    def __init__(self, limit: int) -> None:
        self.left, self._lock = limit, threading.Lock()

    def take(self) -> bool:
        """Take one step from the budget; False once it is spent."""
        with self._lock:
            self.left -= 1
            return self.left >= 0


def env_alone_steps_per_s(env_id: str, steps: int = 5000) -> float:
    """The physical limit of the service's steps/s: the env class itself stepped in this process (no service, no
    HTTP, one thread), with the bench's actions, reset whenever an episode ends."""
    env_class = registry.get(env_id).env_class()
    task = env_class.resolve_task(None, "train", 0, {})
    env = env_class()
    env.reset(task)
    started = time.perf_counter()
    for turn in range(steps):
        _, _, terminated, truncated, _ = env.step(ACTIONS[turn % 2])
        if terminated or truncated:
            env.reset(task)
    seconds = time.perf_counter() - started
    env.close()
    return steps / seconds


def open_sessions(client: EnvClient, env_id: str, count: int, threads: int) -> list[str]:
    """Create `count` sessions concurrently."""
    with ThreadPoolExecutor(threads) as pool:
        return list(pool.map(lambda _: client.create(env_id).session_id, range(count)))


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) of `values` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def run_load(args: argparse.Namespace, client: EnvClient, pid: int) -> None:
    """Open the sessions, step them, print the figures."""
    started = time.perf_counter()
    session_ids = open_sessions(client, args.env, args.sessions, args.threads)
    opened_s = time.perf_counter() - started
    held = client.health().sessions
    steppers = [Stepper(client, args.env, session_ids[i :: args.threads]) for i in range(args.threads)]
    stop, budget = threading.Event(), Budget(args.max_steps)
    workers = [threading.Thread(target=s.run, args=(stop, budget)) for s in steppers]
    light_latencies: list[float] = []
    if args.light_client:
        workers.append(threading.Thread(target=light_client, args=(client.base_url, stop, light_latencies)))
    server_cpu, client_cpu = cpu_seconds(pid), time.process_time()
    started = time.perf_counter()
    for worker in workers:
        worker.start()
    stop.wait(args.duration)
    stop.set()
    for worker in workers:
        worker.join()
    elapsed = time.perf_counter() - started
    server_cpu, client_cpu = cpu_seconds(pid) - server_cpu, time.process_time() - client_cpu
    latencies = [x for s in steppers for x in s.latencies]
    errors: dict[str, int] = {}
    for stepper in steppers:
        for key, n in stepper.errors.items():
            errors[key] = errors.get(key, 0) + n
    batching = client.steps
    per_request = f" steps_per_request={batching.items / max(batching.batches, 1):.1f}" if batching else ""
    print(f"route=/{args.step_route}{per_request} env={args.env} backend={args.backend} sessions_held={held} "
          f"opened_in={opened_s:.1f}s "
          f"threads={args.threads} steps={len(latencies)} in {elapsed:.1f}s steps_per_s={len(latencies) / elapsed:.0f} "
          f"p50_ms={percentile(latencies, 0.5) * 1e3:.1f} p99_ms={percentile(latencies, 0.99) * 1e3:.1f} "
          f"errors={errors or 0} {memory_text(pid)}")
    if args.light_client:
        print(f"light client ({LIGHT_CLIENT_ADDRESS}): {len(light_latencies)} /healthz, "
              f"p50_ms={percentile(light_latencies, 0.5) * 1e3:.1f} p99_ms={percentile(light_latencies, 0.99) * 1e3:.1f}")
    steps = max(len(latencies), 1)
    # Where the time goes: CPU seconds of the server (with its workers) and of this load generator per step; on a
    # machine with fewer free cores than the two need, their sum per step bounds steps/s.
    env_alone = env_alone_steps_per_s(args.env)
    print(f"the env alone (its class stepped in one thread, no service): {env_alone:.0f} steps/s, "
          f"{1e6 / env_alone:.0f} us a step")
    print(f"cpu: server {server_cpu / elapsed:.2f} cores, {server_cpu / steps * 1e6:.0f} us/step; load generator "
          f"{client_cpu / elapsed:.2f} cores, {client_cpu / steps * 1e6:.0f} us/step; machine {os.cpu_count()} cores")
    if args.json:
        args.json.write_text(json.dumps({
            "step_route": args.step_route,
            "steps_per_request": batching.items / max(batching.batches, 1) if batching else 1.0,
            "env": args.env, "backend": args.backend, "sessions": args.sessions, "sessions_held": held,
            "threads": args.threads, "steps": len(latencies), "seconds": elapsed,
            "steps_per_s": len(latencies) / elapsed, "p50_ms": percentile(latencies, 0.5) * 1e3,
            "p99_ms": percentile(latencies, 0.99) * 1e3, "errors": errors, "server_rss_mb": rss_mb(pid),
            "worker_rss_mb": [rss_mb(child) for child in worker_pids(pid)],
            "server_cores": server_cpu / elapsed, "server_cpu_us_per_step": server_cpu / steps * 1e6,
            "client_cores": client_cpu / elapsed, "client_cpu_us_per_step": client_cpu / steps * 1e6,
            "machine_cores": os.cpu_count(), "env_alone_steps_per_s": env_alone}, indent=1))


def main() -> int:
    """Entry point."""
    args = parse_args()
    extra_args = ["--max-sessions", str(args.sessions + args.threads), *args.service_arg]
    with EnvServiceProcess([args.env], extra_args=extra_args, startup_timeout_s=60, backend=args.backend,
                           workers=args.workers) as service:
        client = EnvClient(service.url, timeout=30, pool_size=args.threads, batch_steps=args.step_route == "steps",
                           max_batches_in_flight=args.batches_in_flight)
        run_load(args, client, service.process.pid)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
