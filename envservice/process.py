"""Start an envservice in a child process we own, wait until it serves, and stop exactly it.

Used by the tests and the data and collection CLIs (the launcher starts envservice as one of its generic
services). Readiness is the service's own ready line *and* a healthy `/healthz` (not a string match
alone); the child is a `childproc.ChildProcess` in its own process group, and stopping it signals the
service, then that group only.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import requests

from envservice.childproc import ChildProcess, ChildStartError

READY_LINE = re.compile(r"envservice ready on (http://[\d.]+:(\d+)) \(envs: ([^;)]*)(?:; backend: ([^;)]*))?")


class EnvServiceStartError(RuntimeError):
    """The service exited or printed no ready line in time; the message carries its stderr tail."""


class EnvServiceProcess:
    """`python -m envservice` as a child process; a context manager that yields itself once healthy.

    Args:
        envs: env ids to serve, e.g. ["babyai", "textcraft"].
        port: 0 lets the service pick a free loopback port (the ready line tells which).
        extra_args: more CLI flags, e.g. ["--max-sessions", "64"].
        log_path: where stderr goes (a temporary file by default).
        env: additions to our environment for the service (e.g. PYTHONPATH for env plugins).
        backend, workers, step_timeout_s, ray_address: the placement flags of `python -m envservice`
            (None leaves the service's default).
    """

    def __init__(self, envs: list[str], host: str = "127.0.0.1", port: int = 0, extra_args: list[str] | None = None,
                 startup_timeout_s: float = 120.0, log_path: str | Path | None = None, env: dict | None = None,
                 backend: str | None = None, workers: int | None = None, step_timeout_s: float | None = None,
                 ray_address: str | None = None):
        placement = _flags(backend=backend, workers=workers, step_timeout=step_timeout_s, ray_address=ray_address)
        self.cmd = [sys.executable, "-m", "envservice", "--host", host, "--port", str(port),
                    "--envs", ",".join(envs), *placement, *(extra_args or [])]
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path or f"/tmp/envservice_{os.getpid()}_{id(self)}.log")
        self.env = {**os.environ, **(env or {})}
        self.child: ChildProcess | None = None
        self.url: str | None = None
        self.envs: list[str] = []
        self.backend: str | None = None
        """The backend phrase of the ready line, e.g. 'process, 4 workers'."""

    @property
    def process(self) -> subprocess.Popen | None:
        """The service's Popen (None before `start`)."""
        return self.child.process if self.child else None

    def start(self) -> "EnvServiceProcess":
        """Launch and block until the ready line and `/healthz` both say it serves."""
        # stdout is a pipe (its first line is the ready line); stderr goes to the log.
        self.child = ChildProcess.start(self.cmd, "envservice", self.log_path, env=self.env,
                                        stdout=subprocess.PIPE, text=True)
        try:
            line = self._ready_line()
            match = READY_LINE.search(line)
            if not match:
                raise EnvServiceStartError(f"envservice printed no ready line (first line: {line!r}).\n"
                                           f"{self.child.log_tail()}")
            self.url, self.envs, self.backend = match.group(1), match.group(3).split(", "), match.group(4)
            requests.get(f"{self.url}/healthz", timeout=10).raise_for_status()
        except BaseException:
            self.stop()
            raise
        return self

    def _ready_line(self) -> str:
        """The first line of stdout, read on a side thread so that a silent child cannot block us; the thread then
        copies the rest of stdout into the log to its end."""
        box: list[str] = []
        threading.Thread(target=self._read_stdout, args=(box,), daemon=True, name="envservice-stdout").start()
        try:
            self.child.wait_until(lambda: bool(box and box[0]), self.startup_timeout_s, "printing its ready line",
                                  poll_s=0.05)
        except ChildStartError as error:
            state = "still starting" if error.timed_out else f"exited with code {error.exit_code}"
            raise EnvServiceStartError(f"envservice {state} after {error.elapsed_s:.0f} s without a ready line.\n"
                                       f"{error.log_tail}") from None
        return box[0]

    def _read_stdout(self, box: list[str]) -> None:
        """Put the ready line in `box`, then drain stdout into the log. Why: an env that prints (minigrid prints
        every layout it rejects) filled the pipe once nobody read it, and every env call of the service then blocked
        in its print (a BabyAI service hung 40 minutes)."""
        stdout = self.child.process.stdout
        box.append(stdout.readline())
        with open(self.log_path, "a", encoding="utf-8", errors="replace") as log:
            for line in stdout:
                log.write(line)
                log.flush()

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the service's stderr."""
        return self.child.log_tail(lines) if self.child else f"(envservice was not started; log {self.log_path})"

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the service alone (it stops its own workers or private Ray: signalling them too would only
        make its shutdown wait on them), then SIGKILL whatever is left of its process group."""
        if self.child is not None:
            self.child.stop(grace_s, first_signal_to="leader")

    def __enter__(self) -> "EnvServiceProcess":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def _flags(**values: object) -> list[str]:
    """`--name value` for each given value (underscores become dashes)."""
    flags: list[str] = []
    for name, value in values.items():
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


@contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", startup_timeout_s: float = 30.0) -> Iterator[str]:
    """`app` (an envservice app) served by uvicorn in a thread of this process on a free loopback port; yields its
    URL and stops it after (the tests, and `python -m envservice.check --hacks`)."""
    import time

    import uvicorn

    from envservice.childproc import free_port

    port = free_port(host)
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True, name="envservice-in-thread")
    thread.start()
    deadline = time.monotonic() + startup_timeout_s
    while not server.started and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.05)
    if not server.started:
        raise EnvServiceStartError(f"the in-thread envservice did not start within {startup_timeout_s:.0f} s")
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@contextmanager
def envservice_url(envs: list[str], url: str | None = None, **process_kwargs) -> Iterator[str]:
    """`url` when given (a running service), else the URL of an EnvServiceProcess started (and stopped) here."""
    if url:
        yield url
        return
    with EnvServiceProcess(envs, **process_kwargs) as service:
        yield service.url
