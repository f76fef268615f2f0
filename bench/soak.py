"""Soak bench: a long run of create / step / evaluate / release against a live envservice with faults injected,
proving that every episode is accounted for, no session leaks and memory stays flat.

    python bench/soak.py --minutes 30 [--clients 8] [--restart-every 10] [--json soak.json]

What runs: `python -m envservice --backend process --workers 2` serving frozenlake, textcraft and the
deliberately faulty test env (`envservice.envs.testing:FaultyEnv`), with a short step timeout and idle timeout.
`--clients` threads play episodes back to back; in each episode one fault may be injected:
- `crash`: the env's worker process dies (`os._exit` or a segfault) -> env_error, the worker is replaced;
- `hang`: the env sleeps past the step timeout -> env_timeout, its worker is killed and replaced;
- `raise`: the env raises -> env_error for that session only;
- `abandon`: the client is "killed" mid-episode and never releases -> the idle reaper must close it;
and every `--restart-every` minutes the service is stopped (SIGTERM) while clients are mid-episode and a new
one started on the same port (clients see connection errors, then carry on).

With `--phase-s S` it first runs four phases of S seconds each (bench/abusive_clients.py): an honest client
alone (quiet), then beside `--abusers` slow clients (silent, dripping and half-body connections), then beside
as many greedy ones (concurrent steps on one session, 30 000-entry bad bodies, 60 KiB heads; `--greedy-kinds`
picks some; `--greedy-host-per-kind` sends each kind from a host of its own), and checks that the honest client's
p99 latency stays within 2x of the quiet one's with every honest episode clean. The fourth phase is the
control: the same greedy clients aimed at a second service on this machine, which shows what sharing the cores
alone costs the honest client; the greedy phase is also checked against it. The abusers run only when nothing
else wants a core (SCHED_IDLE), as if on other machines.
`--minutes 0` runs only the phases. `--service-cpus 0` runs the service under test (with its workers and helper)
alone on those CPUs and every client, the honest one and the abusers, on the others, as a service and its
clients on different machines would (every phase, quiet included, runs with the same split; there is then no
control phase: no client shares the service's cores, so there is no cost of sharing to tell apart).

What it prints: a line per `--sample-s` (RSS of the service and its workers, sessions open, episodes, errors),
then per service run its stop line's ledger (sessions created, closed by cause, open), the client-side ledger
(episode outcomes, errors by code) and the checks: leaked sessions (created - closed - open at each stop) = 0,
every episode started has exactly one outcome, server-created sessions match client-acknowledged creates (up
to creates whose reply a restart cut off), RSS growth after warm-up.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import requests

from envservice.childproc import free_port
from envservice.client import EnvClient
from envservice.errors import EnvServiceError
from envservice.process import EnvServiceProcess

FAULTS = {"crash": 0.02, "hang": 0.01, "raise": 0.03, "abandon": 0.05}
"""Chance of each fault per episode (the rest run clean)."""
ENV_ACTIONS = {
    "frozenlake": ["left", "right", "up", "down", "jump", ""],
    "textcraft": ["inventory", "get 1 stick", "craft 1 planks using 1 log", "get 99999999999999999999 stone", "??"],
    "faulty": ["inc", "wait", "inc"],
}
STOP_LINE = re.compile(r"envservice stopped: (\{.*\})")


@dataclass
class ClientLedger:
    """What the clients saw, under one lock: episode outcomes, error codes, acknowledged calls."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    started: int = 0
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    errors: collections.Counter = field(default_factory=collections.Counter)
    creates_acknowledged: int = 0
    creates_cut: int = 0  # a create whose reply never came (connection error): it may exist server-side
    releases: collections.Counter = field(default_factory=collections.Counter)  # 'closed now' / 'already: <how>'

    def add(self, counter: str, key: str | None = None, n: int = 1) -> None:
        with self.lock:
            if key is None:
                setattr(self, counter, getattr(self, counter) + n)
            else:
                getattr(self, counter)[key] += n


class Service:
    """The envservice under test, restartable on one port."""

    def __init__(self, log_dir: Path, step_timeout_s: float, idle_timeout_s: float,
                 more_args: tuple[str, ...] | list[str] = ()) -> None:
        self.port, self.log_dir, self.runs = free_port(), log_dir, 0
        self.args = dict(backend="process", workers=2, step_timeout_s=step_timeout_s,
                         extra_args=["--register", "faulty=envservice.envs.testing:FaultyEnv",
                                     "--idle-timeout", str(idle_timeout_s), *more_args])
        self.process: EnvServiceProcess | None = None
        self.url = f"http://127.0.0.1:{self.port}"
        self.cpus: set[int] | None = None
        """The CPUs it is pinned to at every start (None: not pinned)."""

    def start(self) -> None:
        self.runs += 1
        self.process = EnvServiceProcess(["frozenlake", "textcraft", "faulty"], port=self.port,
                                         log_path=self.log_dir / f"service-{self.runs}.log", startup_timeout_s=120,
                                         env={"ENVSERVICE_TOKEN": ""}, **self.args).start()
        if self.cpus:
            pin(self.process.process.pid, self.cpus)

    def stop(self) -> dict:
        """Stop it (SIGTERM: sessions are closed) and return its stop line's ledger."""
        assert self.process is not None
        self.process.stop(grace_s=30)
        text = (self.log_dir / f"service-{self.runs}.log").read_text()
        match = STOP_LINE.search(text)
        if match is None:
            raise SystemExit(f"soak: service run {self.runs} printed no stop line; log tail:\n{text[-3000:]}")
        return json.loads(match.group(1))

    def rss_mib(self) -> tuple[float, float]:
        """RSS of the service process, and of its worker processes together (replaced when they crash)."""
        try:
            root = psutil.Process(self.process.process.pid)
            workers = sum(p.memory_info().rss for p in root.children(recursive=True))
            return root.memory_info().rss / 2**20, workers / 2**20
        except (psutil.Error, AttributeError):
            return float("nan"), float("nan")


def play_episode(client: EnvClient, rng: random.Random, ledger: ClientLedger) -> str:
    """One episode with at most one fault; returns its outcome."""
    env_id = rng.choice(list(ENV_ACTIONS))
    fault = next((name for name, p in FAULTS.items() if rng.random() < p), None)
    if fault in ("crash", "hang", "raise"):
        env_id = "faulty"
    ledger.add("started")
    try:
        created = client.create(env_id, seed=rng.randrange(2**31))
    except requests.RequestException:
        ledger.add("creates_cut")
        return "create_cut"
    except EnvServiceError as exc:
        ledger.add("errors", exc.code.value)
        return f"create_{exc.code.value}"
    ledger.add("creates_acknowledged")
    steps, fault_at = rng.randint(1, 8), rng.randint(0, 7)
    try:
        for index in range(steps):
            if fault == "abandon" and index == fault_at % steps:
                return "abandoned"  # the client "dies": no release; the reaper (or a shutdown) must close it
            action = {"crash": rng.choice(["exit", "segfault"]), "hang": "hang", "raise": "boom"}.get(
                fault if index == fault_at % steps else "", rng.choice(ENV_ACTIONS[env_id]))
            if client.step(created.session_id, action).terminated:
                break
        client.evaluate(created.session_id)
        outcome = "clean"
    except EnvServiceError as exc:
        ledger.add("errors", exc.code.value)
        outcome = exc.code.value
    except requests.RequestException:
        outcome = "cut"
    try:
        released = client.release(created.session_id)
        ledger.add("releases", f"already: {released.closed_by}" if released.already_closed else "closed now")
    except (EnvServiceError, requests.RequestException) as exc:
        ledger.add("releases", f"failed: {getattr(exc, 'code', type(exc).__name__)}")
    return outcome


def client_loop(url: str, seed: int, ledger: ClientLedger, stop: threading.Event) -> None:
    rng = random.Random(seed)
    with EnvClient(url, timeout=30, retries=2, backoff_s=0.2) as client:
        while not stop.is_set():
            outcome = play_episode(client, rng, ledger)
            ledger.add("outcomes", outcome)
            if outcome.endswith("cut"):
                time.sleep(0.5)  # the service is restarting


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from abusive_clients import GREEDY_KINDS  # beside this file (bench/ is on sys.path when it runs)

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0, help="how long to run (default 30)")
    parser.add_argument("--clients", type=int, default=8, help="client threads (default 8)")
    parser.add_argument("--restart-every", type=float, default=10.0, help="minutes between service restarts")
    parser.add_argument("--sample-s", type=float, default=30.0, help="seconds between progress lines")
    parser.add_argument("--step-timeout", type=float, default=2.0, help="the service's --step-timeout")
    parser.add_argument("--idle-timeout", type=float, default=20.0, help="the service's --idle-timeout")
    parser.add_argument("--log-dir", default="soak-logs", help="where the service logs go")
    parser.add_argument("--json", default=None, help="write every figure printed to this file")
    parser.add_argument("--phase-s", type=float, default=0.0,
                        help="seconds of each slow/greedy-client phase, run first (0: none)")
    parser.add_argument("--abusers", type=int, default=32, help="slow or greedy client threads per phase")
    parser.add_argument("--greedy-kinds", default=",".join(GREEDY_KINDS),
                        help=f"what the greedy clients send, taken in turn (default {','.join(GREEDY_KINDS)})")
    parser.add_argument("--greedy-host-per-kind", action="store_true",
                        help="each greedy kind from a loopback address of its own (127.0.0.2, .3, .4), as three "
                             "flooding hosts; default: every abuser from 127.0.0.2, one host")
    parser.add_argument("--service-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for the services (repeatable), "
                             "e.g. --service-arg=--loop-slots-per-host=0")
    parser.add_argument("--service-cpus", default="",
                        help="comma-separated CPUs for the service under test alone; every client runs on the "
                             "others (default: no pinning)")
    args = parser.parse_args(argv)
    args.service_cpus = {int(cpu) for cpu in args.service_cpus.split(",") if cpu.strip()}
    every = os.sched_getaffinity(0)
    if args.service_cpus and not (args.service_cpus < every):
        parser.error(f"--service-cpus {sorted(args.service_cpus)} must be a proper subset of this process's CPUs "
                     f"{sorted(every)}")
    args.client_cpus = every - args.service_cpus if args.service_cpus else set()
    args.greedy_kinds = tuple(kind.strip() for kind in args.greedy_kinds.split(",") if kind.strip())
    unknown = sorted(set(args.greedy_kinds) - set(GREEDY_KINDS))
    if unknown or not args.greedy_kinds:
        parser.error(f"--greedy-kinds {','.join(unknown) or '(none)'} unknown; valid: {', '.join(GREEDY_KINDS)}")
    return args


def pin(pid: int, cpus: set[int]) -> None:
    """Pin a process and its children (a process backend's workers) to `cpus`; later children inherit it."""
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        process.cpu_affinity(sorted(cpus))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    service = Service(log_dir, args.step_timeout, args.idle_timeout, args.service_arg)
    ledger, stop = ClientLedger(), threading.Event()
    if args.service_cpus:  # this process's threads (the honest client among them) inherit the main thread's CPUs
        service.cpus = args.service_cpus
        os.sched_setaffinity(0, args.client_cpus)
        print(f"soak: the service under test on CPUs {sorted(service.cpus)}, every client on "
              f"{sorted(args.client_cpus)}", flush=True)
    service.start()
    phases = run_phases(service.url, args) if args.phase_s > 0 else []
    threads = [threading.Thread(target=client_loop, args=(service.url, i, ledger, stop), daemon=True)
               for i in range(args.clients)]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    end, next_restart = started + args.minutes * 60, started + args.restart_every * 60
    runs, samples = [], []
    print(f"soak: {args.clients} clients for {args.minutes:g} min against {service.url}; restart every "
          f"{args.restart_every:g} min; faults per episode {FAULTS}", flush=True)
    while (now := time.monotonic()) < end:
        time.sleep(min(args.sample_s, max(0.0, end - now)))
        service_rss, workers_rss = service.rss_mib()
        sample = {"t_s": round(time.monotonic() - started), "run": service.runs, "rss_mib": round(service_rss, 1),
                  "workers_rss_mib": round(workers_rss, 1), "episodes": ledger.started, "errors": dict(ledger.errors)}
        try:
            sample["open"] = requests.get(f"{service.url}/healthz", timeout=5).json()["sessions"]
        except (requests.RequestException, ValueError, KeyError):
            sample["open"] = None
        samples.append(sample)
        print(f"  t={sample['t_s']:>5} s  run {sample['run']}  rss service {sample['rss_mib']:>6.1f} MiB, workers "
              f"{sample['workers_rss_mib']:>6.1f} MiB  open "
              f"{sample['open']}  episodes {sample['episodes']}  errors {sample['errors']}", flush=True)
        if time.monotonic() >= next_restart and time.monotonic() < end - 30:
            runs.append(service.stop())
            print(f"  restarted the service mid-traffic; run {service.runs} ledger: {runs[-1]}", flush=True)
            service.start()
            next_restart += args.restart_every * 60
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    alive = sum(thread.is_alive() for thread in threads)
    runs.append(service.stop())
    return report(runs, ledger, samples, alive, args, phases)


def run_phases(url: str, args: argparse.Namespace) -> list[dict]:
    """Quiet, slow-client and greedy-client phases, then (unless the service has CPUs of its own) the control: the
    greedy clients aimed at a second service on this machine (module docstring); each printed as it ends."""
    from abusive_clients import run_phase

    phases = []
    control = Service(Path(args.log_dir) / "control", args.step_timeout, args.idle_timeout, args.service_arg)
    control.log_dir.mkdir(parents=True, exist_ok=True)
    plan = [("quiet", None), ("slow", None), ("greedy", None)]
    if not args.service_cpus:
        control.start()
        plan.append(("greedy", control.url))
    try:
        for abuse, abused_url in plan:
            phase = run_phase(url, args.phase_s, abuse, args.abusers, abused_url, args.client_cpus or None,
                              args.greedy_kinds, args.greedy_host_per_kind)
            phases.append(phase)
            print(f"phase {phase['abuse']}: honest p50 {phase['p50_ms']} ms, p99 {phase['p99_ms']} ms over "
                  f"{phase['honest_requests']} requests, episodes {phase['honest_episodes']}; "
                  f"abuse {phase['abuse_counts']}", flush=True)
    finally:
        if control.process is not None:
            control.stop()
    return phases


def report(runs: list[dict], ledger: ClientLedger, samples: list[dict], alive: int, args: argparse.Namespace,
           phases: list[dict] = ()) -> int:
    """Print the ledgers and the checks; exit status 1 when a check fails."""
    created = sum(run["created"] for run in runs)
    closed = collections.Counter()
    for run in runs:
        closed.update(run["closed"])
    leaked = sum(run["created"] - sum(run["closed"].values()) - run["open"] for run in runs)
    outcomes = sum(ledger.outcomes.values())
    cut_releases = sum(n for how, n in ledger.releases.items() if how.startswith("failed"))
    growth = rss_growth(samples)
    print("\nservice runs (stop lines):")
    for number, run in enumerate(runs, 1):
        print(f"  run {number}: created {run['created']}, closed {run['closed']}, open at stop {run['open']}")
    print(f"client ledger: episodes {ledger.started}, outcomes {dict(ledger.outcomes)}")
    print(f"  errors by code {dict(ledger.errors)}; releases {dict(ledger.releases)}")
    print(f"  creates acknowledged {ledger.creates_acknowledged}, cut by a restart {ledger.creates_cut}; "
          f"server created {created}")
    print(f"RSS of the service process after warm-up, per run: {growth}")
    # The phases' sessions: each honest episode created and released one; each greedy phase made one shared
    # session that it never releases (the shutdown closes it).
    phase_creates = sum(phase["honest_episodes"].get("clean", 0) for phase in phases)
    phase_creates += sum(1 for phase in phases if phase["abuse"] == "greedy")
    phase_releases = sum(phase["honest_episodes"].get("clean", 0) for phase in phases)
    acknowledged, released = ledger.creates_acknowledged + phase_creates, ledger.releases["closed now"] + phase_releases
    checks = {
        "no session leaked (created = closed + open, every run)": leaked == 0,
        "every episode has one outcome": outcomes == ledger.started and alive == 0,
        "server creates = acknowledged (+ cut by restarts)":
            acknowledged <= created <= acknowledged + ledger.creates_cut,
        "server releases = client releases that closed a session (+ releases cut by restarts)":
            released <= closed["release"] <= released + cut_releases,
    }
    by_abuse = {phase["abuse"]: phase for phase in phases}
    quiet, control = by_abuse.get("quiet"), by_abuse.get("greedy elsewhere")
    for phase in phases:
        if phase is quiet or quiet is None:
            continue
        if phase is not control:
            checks[f"honest p99 beside {phase['abuse']} clients within 2x of quiet "
                   f"({phase['p99_ms']} vs {quiet['p99_ms']} ms)"] = phase["p99_ms"] <= 2 * quiet["p99_ms"]
        if phase["abuse"] == "greedy" and control is not None:  # what the service adds to the machine's share
            checks[f"honest p99 beside greedy clients within 2x of the same clients aimed at another service "
                   f"({phase['p99_ms']} vs {control['p99_ms']} ms)"] = phase["p99_ms"] <= 2 * control["p99_ms"]
        checks[f"every honest episode clean beside {phase['abuse']} clients"] = (
            set(phase["honest_episodes"]) <= {"started", "clean"} and phase["threads_left"] == 0)
    print("checks:")
    for name, ok in checks.items():
        print(f"  [{'ok' if ok else 'FAIL'}] {name}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "runs": runs, "client": {"episodes": ledger.started, "outcomes": dict(ledger.outcomes),
                                     "errors": dict(ledger.errors), "releases": dict(ledger.releases),
                                     "creates_acknowledged": ledger.creates_acknowledged,
                                     "creates_cut": ledger.creates_cut},
            "leaked": leaked, "rss_growth": growth, "samples": samples, "phases": list(phases), "checks": checks,
            "service_cpus": sorted(args.service_cpus)},
            indent=1))
    return 0 if all(checks.values()) else 1


def rss_growth(samples: list[dict]) -> list[dict]:
    """Per service run: the service process's RSS at the end of its warm-up (its first third) and at its last
    sample (workers are left out: a crashed worker's replacement starts small and grows with its imports)."""
    by_run: dict[int, list[float]] = collections.defaultdict(list)
    for sample in samples:
        by_run[sample["run"]].append(sample["rss_mib"])
    growth = []
    for run, values in sorted(by_run.items()):
        warm = values[len(values) // 3] if values else float("nan")
        growth.append({"run": run, "after_warmup_mib": warm, "last_mib": values[-1],
                       "growth_mib": round(values[-1] - warm, 1)})
    return growth


if __name__ == "__main__":
    sys.exit(main())
