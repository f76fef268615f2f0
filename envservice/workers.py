"""The `process` backend: env instances live in N worker processes (multiprocessing, spawn context).

Each worker runs an `EnvHost` and a few threads; the service talks to it over one pipe: requests
`(call_id, method, key, args)` go in, replies `(call_id, (ok, payload))` come back in any order, read by
one thread per worker. When the pipe closes (the worker segfaulted, called os._exit, was OOM-killed or
killed by us after a timeout), every call waiting on that worker fails with `WorkerLost` naming the
worker and its exit code, its sessions end with `env_error` on their next call, and a new worker is
started in its place. Workers ignore SIGINT and SIGTERM (Ctrl-C or stopping the service signals its whole
process group): they exit when the service tells them to or closes their pipe, i.e. when it exits.

Spawned workers re-import the parent's main module (standard multiprocessing): a script that builds a
`ProcessBackend` must do it under `if __name__ == "__main__":`, as `python -m envservice` does.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing as mp
import os
import signal
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from multiprocessing.connection import Connection
from typing import Any, Callable

from envservice.backends import DEFAULT_STEP_TIMEOUT_S, PooledBackend, WorkerLost
from envservice.host import EnvHost, Reply
from envservice.latency import InjectedLatency

logger = logging.getLogger("envservice")

THREADS_PER_WORKER = 4
"""Env calls one worker runs at once (sessions of one worker overlap while an env waits on I/O)."""
START_TIMEOUT_S = 120.0
"""How long a new worker may take to import and say it is ready (not counted in any call's limit)."""
_READY = -1
"""The call id of the message a worker sends once it serves."""
_STARTED = "started"
"""The reply a worker sends first for each call, when one of its threads starts it: the call's time limit
counts from there, so that a call queued behind others of the same worker is not taken for a hung one."""


class ProcessBackend(PooledBackend):
    """Env instances in `workers` spawned processes; see the module docstring."""

    name = "process"

    def __init__(self, workers: int, step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
                 threads_per_worker: int = THREADS_PER_WORKER, latency: InjectedLatency | None = None) -> None:
        self.threads_per_worker = threads_per_worker
        super().__init__(workers, step_timeout_s, latency=latency)
        atexit.register(self.shutdown)  # never leave workers behind, even without a clean shutdown

    def _start_worker(self, index: int) -> "ProcessWorker":
        return ProcessWorker(index, self.threads_per_worker, on_death=self.replace)


class ProcessWorker:
    """The service's handle on one worker process (implements `backends.WorkerHandle`)."""

    def __init__(self, index: int, threads: int, on_death: Callable[["ProcessWorker"], None]) -> None:
        context = mp.get_context("spawn")
        self._conn, child_conn = context.Pipe()
        self.process = context.Process(target=worker_main, args=(child_conn, threads),
                                       name=f"envservice-worker-{index}")
        self.process.start()
        child_conn.close()  # the child holds the only other end: its death closes the pipe
        self.index, self.load, self.pid = index, 0, self.process.pid
        self._on_death = on_death
        self._pending: dict[int, tuple[threading.Event, Future]] = {}  # call id -> (started, reply)
        self._ids = itertools.count()
        self._lock, self._send_lock = threading.Lock(), threading.Lock()
        self._death: str | None = None
        self._kill_reason: str | None = None
        self._stopped = False
        self._ready = threading.Event()
        threading.Thread(target=self._read_loop, name=f"envservice-worker-{index}-reader", daemon=True).start()

    @property
    def alive(self) -> bool:
        return self._death is None and self._kill_reason is None and not self._stopped

    def describe(self) -> str:
        return f"worker {self.index} (pid {self.pid})"

    def request(self, method: str, key: str, args: tuple, timeout_s: float | None) -> Reply:
        """Send one request and wait for its reply (see `WorkerHandle.request`); `timeout_s` counts from when a
        worker thread starts the call (`_STARTED`), not while it waits for one of the worker's threads. A call
        that waits is not left waiting for ever: the calls ahead of it run under the limit, and a worker killed
        for one of them fails every call it holds."""
        if not self._ready.wait(START_TIMEOUT_S):
            self.kill(f"{self.describe()} did not start within {START_TIMEOUT_S:g} s")
        started, future = threading.Event(), Future()
        with self._lock:
            if self._death is not None or self._kill_reason is not None:
                raise WorkerLost(self._death or self._kill_reason)
            call_id = next(self._ids)
            self._pending[call_id] = (started, future)
        try:
            self._send((call_id, method, key, args))
            started.wait()  # set when a thread starts it, or when the worker dies (the future then fails)
            return future.result(timeout_s)  # TimeoutError when no reply came in time
        finally:
            with self._lock:
                self._pending.pop(call_id, None)

    def _send(self, message: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, EOFError, ValueError) as exc:  # a closed pipe: the worker is gone
            raise WorkerLost(self._death or f"{self.describe()} cannot be reached: {exc!r}") from None

    def kill(self, reason: str) -> None:
        """SIGKILL the worker; its pending and later calls fail with `reason`."""
        self._kill_reason = reason
        self.process.kill()

    def stop(self, grace_s: float = 5.0) -> None:
        """Ask the worker to exit; kill it after `grace_s`."""
        if self._stopped:
            return
        self._stopped = True
        try:
            with self._send_lock:
                self._conn.send(None)
        except (OSError, ValueError):
            pass
        self.process.join(grace_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(grace_s)

    def _read_loop(self) -> None:
        while True:
            try:
                call_id, reply = self._conn.recv()
            except (EOFError, OSError):
                break
            if call_id == _READY:
                self._ready.set()
                continue
            with self._lock:
                waiting = self._pending.get(call_id) if reply == _STARTED else self._pending.pop(call_id, None)
            if waiting is None:
                continue
            started, future = waiting
            started.set()
            if reply != _STARTED and not future.done():
                future.set_result(reply)
        self._died()

    def _died(self) -> None:
        """The pipe closed: fail the waiting calls, then let the backend start a replacement."""
        self.process.join(5)
        reason = self._kill_reason or f"{self.describe()} exited with {exit_text(self.process.exitcode)}"
        with self._lock:
            self._death = reason
            pending, self._pending = list(self._pending.values()), {}
        for started, future in pending:
            if not future.done():
                future.set_exception(WorkerLost(reason))
            started.set()
        self._ready.set()  # wake callers waiting for a start that will not come
        self._conn.close()
        if not self._stopped:
            if self._kill_reason is None:  # a kill was logged by whoever killed it
                logger.error("%s; its sessions end with env_error", reason)
            self._on_death(self)


def exit_text(code: int | None) -> str:
    """'exit code 3', 'exit code -11 (SIGSEGV)' or 'no exit code (still running)'."""
    if code is None:
        return "no exit code (still running)"
    if code < 0:
        try:
            return f"exit code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"exit code {code}"
    return f"exit code {code}"


# ---- inside the worker process -------------------------------------------------------------------------


def worker_main(conn: Connection, threads: int) -> None:
    """Entry point of a worker: serve requests from `conn` until it closes or sends None."""
    for signum in (signal.SIGINT, signal.SIGTERM):  # the service's process group gets these: it stops us itself
        signal.signal(signum, signal.SIG_IGN)
    host, send_lock = EnvHost(), threading.Lock()
    pool = ThreadPoolExecutor(threads, thread_name_prefix="envservice-env")
    conn.send((_READY, None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the service is gone: free what the envs hold
            _close_all(host)
            break
        if message is None:
            break
        pool.submit(_serve, host, conn, send_lock, message)
    pool.shutdown(wait=False, cancel_futures=True)
    os._exit(0)  # do not wait for a stuck env thread


def _serve(host: EnvHost, conn: Connection, send_lock: threading.Lock, message: tuple) -> None:
    call_id, method, key, args = message
    try:
        with send_lock:
            conn.send((call_id, _STARTED))  # the service's time limit for this call starts now
    except (OSError, EOFError):
        return  # the service is gone
    reply: Any = host.handle(method, key, args)
    try:
        with send_lock:
            conn.send((call_id, reply))
    except (OSError, EOFError):
        return  # the service is gone
    except Exception as exc:  # the env returned something that cannot be pickled
        with send_lock:
            conn.send((call_id, (False, ("env", f"unpicklable {method} result: {exc!r}", ""))))


def _close_all(host: EnvHost, timeout_s: float = 5.0) -> None:
    """Close every env of `host` in a daemon thread, waiting at most `timeout_s`."""
    closer = threading.Thread(target=host.close_all, daemon=True)
    closer.start()
    closer.join(timeout_s)
