"""Start an envservice in a child process we own, wait until it serves, and stop exactly it.

Used by tests, the collection CLI and the launcher. Readiness is the service's own ready line *and* a
healthy `/healthz` (not a string match alone); the child gets its own process group, and stopping it
signals the service, then that group only.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import requests

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
        self.process: subprocess.Popen | None = None
        self.url: str | None = None
        self.envs: list[str] = []
        self.backend: str | None = None
        """The backend phrase of the ready line, e.g. 'process, 4 workers'."""

    def start(self) -> "EnvServiceProcess":
        """Launch and block until the ready line and `/healthz` both say it serves."""
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                                            env=self.env, start_new_session=True)
        try:
            match = READY_LINE.search(self._first_line())
            if not match:
                raise EnvServiceStartError(f"envservice printed no ready line.\n{self.log_tail()}")
            self.url, self.envs, self.backend = match.group(1), match.group(3).split(", "), match.group(4)
            requests.get(f"{self.url}/healthz", timeout=10).raise_for_status()
        except BaseException:
            self.stop()
            raise
        return self

    def _first_line(self) -> str:
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.process.stdout.readline()), daemon=True)
        reader.start()
        reader.join(self.startup_timeout_s)
        if not box or not box[0]:
            state = f"exited with code {self.process.poll()}" if self.process.poll() is not None else "still starting"
            raise EnvServiceStartError(f"envservice {state} after {self.startup_timeout_s:.0f} s without a "
                                       f"ready line.\n{self.log_tail()}")
        return box[0]

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the service's stderr."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return f"last lines of {self.log_path}:\n" + "\n".join(text.splitlines()[-lines:])

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the service, then SIGKILL what is left of its process group (at once when it exited,
        after `grace_s` when it did not). The service stops its own workers or private Ray: signalling
        them too would only make its shutdown wait on a dead Ray."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:  # the whole group is gone
            pass
        self.process.wait(timeout=grace_s)

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
def envservice_url(envs: list[str], url: str | None = None, **process_kwargs) -> Iterator[str]:
    """`url` when given (a running service), else the URL of an EnvServiceProcess started (and stopped) here."""
    if url:
        yield url
        return
    with EnvServiceProcess(envs, **process_kwargs) as service:
        yield service.url
