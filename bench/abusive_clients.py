"""Slow and greedy clients for bench/soak.py's phases, and the honest client whose latency they must not spoil.

- honest: one client plays short frozenlake episodes (create, step, evaluate, release) and asks /healthz
  between them; every request's latency is kept;
- slow: connections that say nothing, drip a request head a byte at a time, or send half a body, reopened
  as soon as the service closes them (envservice/transport.py's head deadline, the body deadline);
- greedy: concurrent /step calls on one shared session (`busy`), /create bodies with 30 000 bad `params`
  entries (a bounded 422), and 60 KiB request heads, each a pre-built request sent back to back on a kept-alive
  raw socket: the cheapest way for a client to keep the service busy, so that their process, which runs only
  when nothing else wants a core, still floods the service (through `requests` they spent their CPU in the client).

`run_phase` runs the honest client for a while beside one kind of abuse and returns its latency figures. The
abusers connect from ABUSER_ADDRESS, another loopback address, as they would from another host: the service
checks large bodies one at a time per client host (envservice/body_check.py), and on one host all clients are one.
"""

from __future__ import annotations

import json
import random
import socket
import statistics
import threading
import time
from typing import Callable

import requests

from envservice.client import EnvClient
from envservice.errors import EnvServiceError

ABUSER_ADDRESS = "127.0.0.2"
"""The abusers' source address (Linux routes all of 127.0.0.0/8 to loopback)."""
GREEDY_KINDS = ("busy_step", "bad_body", "big_head")
"""What greedy clients send: steps of one shared session (`busy`), 30 000-entry bad bodies, 60 KiB heads."""


def greedy_address(kind: str, host_per_kind: bool) -> str:
    """Where greedy clients of `kind` connect from: ABUSER_ADDRESS, or with `host_per_kind` a loopback address of
    the kind's own (127.0.0.2, .3, .4 in GREEDY_KINDS order), as three flooding hosts would."""
    return f"127.0.0.{2 + GREEDY_KINDS.index(kind)}" if host_per_kind else ABUSER_ADDRESS


def honest_client(url: str, stop: threading.Event, latencies: list[float], ledger: dict[str, int]) -> None:
    """Short episodes and health checks until `stop`; each request's seconds appended to `latencies`."""
    client = EnvClient(url, timeout=30, retries=0)
    rng = random.Random(0)

    def timed(call: Callable):
        started = time.monotonic()
        try:
            return call()
        finally:
            latencies.append(time.monotonic() - started)

    while not stop.is_set():
        timed(lambda: requests.get(f"{url}/healthz", timeout=30))
        ledger["started"] += 1
        try:
            session = timed(lambda: client.create("frozenlake", seed=rng.randrange(2**31))).session_id
            for _ in range(3):
                if timed(lambda: client.step(session, rng.choice(["left", "right", "up", "down"]))).terminated:
                    break
            timed(lambda: client.evaluate(session))
            timed(lambda: client.release(session))
            ledger["clean"] += 1
        except (EnvServiceError, requests.RequestException) as error:
            ledger[f"failed: {type(error).__name__}"] += 1


def _connect(url: str, source: str = ABUSER_ADDRESS) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=60, source_address=(source, 0))


def _until_closed(sock: socket.socket, stop: threading.Event, send: Callable[[], None] | None = None) -> None:
    """Call `send` every 0.5 s (or nothing) until the server closes the connection or `stop`."""
    sock.settimeout(0.5)
    while not stop.is_set():
        try:
            if send is not None:
                send()
            sock.recv(65536)  # an answer (the server's 408 or 431) or b"" (closed): either way it is over
            return
        except socket.timeout:
            continue
        except OSError:
            return


def slow_client(url: str, stop: threading.Event, index: int, counts: dict[str, int]) -> None:
    """Silent, dripping or half-body connections, one after another, until `stop`."""
    head = b"POST /step HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    while not stop.is_set():
        kind = ("silent", "drip", "half_body")[index % 3]
        try:
            with _connect(url) as sock:
                counts[kind] += 1
                if kind == "silent":
                    _until_closed(sock, stop)
                elif kind == "drip":
                    data, sent = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Slow: " + b"a" * 10_000, [0]

                    def drip() -> None:
                        sock.sendall(data[sent[0]:sent[0] + 1])
                        sent[0] += 1
                    _until_closed(sock, stop, drip)
                else:
                    sock.sendall(head + b'{"session_id": ')
                    _until_closed(sock, stop)
        except OSError:
            time.sleep(0.1)


def greedy_request(kind: str, session: str) -> bytes:
    """The whole request a greedy client of `kind` sends again and again (built once: sending it costs the client
    next to nothing, so even a low-priority client process keeps the service busy)."""
    if kind == "busy_step":
        return _post("/step", json.dumps({"session_id": session, "action": "left"}).encode())
    if kind == "bad_body":
        return _post("/create", json.dumps({"env_id": "frozenlake",
                                            "params": {f"p{i}": [[i]] for i in range(30_000)}}).encode())
    if kind == "big_head":
        return b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"b" * 60_000 + b"\r\n\r\n"
    raise ValueError(f"greedy kind {kind!r} is unknown; valid: {', '.join(GREEDY_KINDS)}")


def _post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def read_answer(sock: socket.socket, buffered: bytes) -> tuple[int, bytes, bool]:
    """One HTTP answer from `sock` (after the `buffered` bytes read before): its status, the bytes read past
    it, and whether the server closes the connection."""
    while b"\r\n\r\n" not in buffered:
        buffered += _received(sock)
    head, _, rest = buffered.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(b":") for line in lines[1:])}
    length = int(headers.get(b"content-length", b"0"))
    while len(rest) < length:
        rest += _received(sock)
    return int(lines[0].split(b" ", 2)[1]), rest[length:], headers.get(b"connection", b"").lower() == b"close"


def _received(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    if not chunk:
        raise ConnectionError("the service closed the connection")
    return chunk


def greedy_client(url: str, stop: threading.Event, kind: str, counts: dict[str, int], session: str,
                  source: str = ABUSER_ADDRESS) -> None:
    """One kind of greedy request (GREEDY_KINDS) on a kept-alive raw socket from `source`, back to back, until
    `stop`; reconnects when the service closes the connection."""
    request = greedy_request(kind, session)
    while not stop.is_set():
        try:
            with _connect(url, source) as sock:
                buffered, closing = b"", False
                while not (stop.is_set() or closing):
                    sock.sendall(request)
                    status, buffered, closing = read_answer(sock, buffered)
                    counts[f"{kind} {status}"] += 1
        except OSError as error:
            counts[f"{kind} {type(error).__name__}"] += 1
            time.sleep(0.01)


def abuse(url: str, kind: str, abusers: int, seconds: float, counts_out, cpus: set[int] | None = None,
          greedy_kinds: tuple[str, ...] = GREEDY_KINDS, host_per_kind: bool = False) -> None:
    """Entry of the abusers' own process: `abusers` threads of `kind` for `seconds`; their counts put on
    `counts_out` (a multiprocessing queue). The process runs only when nothing else wants a core (SCHED_IDLE):
    the abusers stand for clients on other machines, so their own Python should not take the cores the service
    and the honest client need (what their requests cost the service is what is measured). With `cpus` it runs on
    those CPUs only. Greedy abusers take `greedy_kinds` in turn, all from ABUSER_ADDRESS or, with `host_per_kind`,
    each kind from its own address (`greedy_address`)."""
    import collections
    import os

    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    if cpus:
        os.sched_setaffinity(0, cpus)
    stop, counts = threading.Event(), collections.Counter()
    if kind == "slow":
        threads = [threading.Thread(target=slow_client, args=(url, stop, i, counts), daemon=True) for i in range(abusers)]
    else:
        shared = EnvClient(url).create("frozenlake", task_id=0).session_id
        kinds = [greedy_kinds[i % len(greedy_kinds)] for i in range(abusers)]
        threads = [threading.Thread(target=greedy_client, daemon=True,
                                    args=(url, stop, kind, counts, shared, greedy_address(kind, host_per_kind)))
                   for kind in kinds]
    for thread in threads:
        thread.start()
    time.sleep(seconds)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    counts_out.put(dict(counts))


def run_phase(url: str, seconds: float, kind: str, abusers: int, abused_url: str | None = None,
              abuser_cpus: set[int] | None = None, greedy_kinds: tuple[str, ...] = GREEDY_KINDS,
              host_per_kind: bool = False) -> dict:
    """The honest client for `seconds` beside `abusers` threads of `kind` (quiet | slow | greedy). The abusers run
    in a process of their own, so that the honest client's latencies are the service's, not this process's GIL.
    With `abused_url` the abusers aim at that other service instead: the control that shows what sharing the
    machine's cores alone costs the honest client. `abuser_cpus`: the CPUs the abusers' process may use;
    `host_per_kind`: each greedy kind from a loopback address of its own (`greedy_address`)."""
    import collections
    import multiprocessing

    stop, latencies, ledger = threading.Event(), [], collections.Counter()
    counts, child = {}, None
    if kind != "quiet":
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        child = context.Process(target=abuse, args=(abused_url or url, kind, abusers, seconds, queue, abuser_cpus,
                                                    greedy_kinds, host_per_kind))
        child.start()
        time.sleep(1.0)  # the abusers are at it before the honest client starts counting
    honest = threading.Thread(target=honest_client, args=(url, stop, latencies, ledger), daemon=True)
    honest.start()
    time.sleep(seconds)
    stop.set()
    honest.join(timeout=90)
    if child is not None:
        counts = queue.get(timeout=120)
        child.join(timeout=30)
    ordered = sorted(latencies)
    return {"abuse": kind if abused_url is None else f"{kind} elsewhere", "seconds": seconds, "abusers": abusers if kind != "quiet" else 0,
            "honest_requests": len(ordered), "honest_episodes": dict(ledger),
            "p50_ms": round(1000 * statistics.median(ordered), 1) if ordered else None,
            "p99_ms": round(1000 * ordered[int(0.99 * (len(ordered) - 1))], 1) if ordered else None,
            "abuse_counts": counts, "threads_left": int(honest.is_alive())}
