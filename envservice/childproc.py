"""A child process in its own process group: start it, wait until it is ready, stop exactly it.

One mechanism for everything BeyondAgent starts and must stop again: envservice (`envservice.process`),
vLLM servers (`beyond_agent.serving`) and the launcher's services and training (`launch`).

Every child is started with `start_new_session=True`, so its pid is its process-group id, a Ctrl-C in
the terminal reaches only us, and stopping the group reaches the child and everything it started
(a vLLM engine core, envservice workers, Ray's processes) and nothing else. Descendants that left the
group (daemons that call `setsid`) are remembered when the stop begins and killed only if they are
still the same process (psutil compares pid and start time, so a reused pid is never hit).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import psutil

FIRST_SIGNAL_TARGETS = ("group", "leader")


class ChildStartError(RuntimeError):
    """The child exited, or was not ready in time, while we waited for it.

    `exit_code` is None when the deadline passed first; `log_tail` is the end of its log, for messages.
    """

    def __init__(self, child: "ChildProcess", what: str, elapsed_s: float, exit_code: int | None):
        self.elapsed_s = elapsed_s
        self.exit_code = exit_code
        self.last_log_line = child.last_log_line()
        self.log_tail = child.log_tail()
        happened = (f"exited with code {exit_code} after {elapsed_s:.1f} s" if exit_code is not None
                    else f"was not {what} after {elapsed_s:.0f} s")
        super().__init__(f"{child.name} {happened}: {self.last_log_line}\n{self.log_tail}")

    @property
    def timed_out(self) -> bool:
        """True when the deadline passed while the child was still running."""
        return self.exit_code is None


class ChildProcess:
    """A process we started in its own process group (see the module docstring).

    Build one with `ChildProcess.start(...)`, or wrap a `Popen` that was started with
    `start_new_session=True` (e.g. by `subprocess.run`-like code that needs the pipe itself).
    """

    def __init__(self, process: subprocess.Popen, name: str, log_path: Path | None = None):
        self.process = process
        """The Popen of the group's leader."""
        self.name = name
        """What the child is, for messages (e.g. "envservice", "train")."""
        self.log_path = log_path
        """Where its output goes, when it goes to a file."""

    @classmethod
    def start(cls, command: Sequence[str], name: str, log_path: Path | None = None, env: dict | None = None,
              **popen: Any) -> "ChildProcess":
        """Start `command` as the leader of a new process group.

        `popen` passes Popen's own options (stdout, stderr, text, ...). With `log_path`, whichever of stdout
        and stderr is not given goes to that file (both: one stream). `env` is the whole environment
        (None: ours).
        """
        log = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_path.write_text("")
            log = log_path.open("a")  # appending: what we copy into it too (its stdout) never overwrites its own lines
            popen.setdefault("stdout", log)
            popen.setdefault("stderr", subprocess.STDOUT if popen["stdout"] is log else log)
        try:
            process = subprocess.Popen(list(command), env=env, start_new_session=True, **popen)
        finally:
            if log is not None:
                log.close()  # the child holds its own descriptor
        return cls(process, name, log_path)

    @property
    def pid(self) -> int:
        """The leader's pid, which is also the group id."""
        return self.process.pid

    @property
    def pgid(self) -> int:
        """The process-group id (the leader's pid: it was started in a new session)."""
        return self.process.pid

    def group_alive(self) -> bool:
        """Whether any process is still in the group (the leader is reaped first, so a zombie does not count)."""
        self.process.poll()
        return _signal_group(self.pgid, 0)

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, what: str,
                   on_tick: Callable[[float], None] | None = None, poll_s: float = 0.2) -> float:
        """Poll `ready()` until it is true; return the seconds waited.

        Raises ChildStartError when the leader exits first or `timeout_s` passes (`what` says what was
        awaited, e.g. "answering /healthz"). `on_tick(elapsed)` is called once per poll (progress lines).
        """
        started = time.monotonic()
        while True:
            if ready():
                return time.monotonic() - started
            elapsed = time.monotonic() - started
            code = self.process.poll()
            if code is not None or elapsed >= timeout_s:
                raise ChildStartError(self, what, elapsed, code)
            if on_tick is not None:
                on_tick(elapsed)
            time.sleep(poll_s)

    def last_log_line(self) -> str:
        """The last non-empty line of the log: for a Python error, its `Type: message` line."""
        lines = [line.strip() for line in self._log_lines() if line.strip()]
        return lines[-1] if lines else "(the log is empty)"

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the log, introduced by its path."""
        if self.log_path is None:
            return f"({self.name} writes no log file)"
        tail = self._log_lines()[-lines:]
        return f"last {len(tail)} lines of {self.log_path}:\n" + "\n".join(tail)

    def _log_lines(self) -> list[str]:
        if self.log_path is None or not self.log_path.exists():
            return []
        return self.log_path.read_text(errors="replace").splitlines()

    def stop(self, grace_s: float = 10.0, first_signal_to: str = "group") -> None:
        """SIGTERM, wait up to `grace_s` for the group to empty, then SIGKILL the group and its strays.

        `first_signal_to="leader"` sends the SIGTERM to the leader alone, for a child that stops its own
        children in order (envservice stops its workers and its private Ray; signalling them at the same
        time would only make its shutdown wait on them). Safe to call more than once.
        """
        if first_signal_to not in FIRST_SIGNAL_TARGETS:
            raise ValueError(f"first_signal_to={first_signal_to!r}; choose one of {FIRST_SIGNAL_TARGETS}")
        strays = self._descendants()
        if first_signal_to == "leader":
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGTERM)
        else:
            _signal_group(self.pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self.group_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        self._kill(strays)

    def kill(self) -> None:
        """SIGKILL the group (and remembered strays) now."""
        self._kill(self._descendants())

    def _descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []

    def _kill(self, strays: list[psutil.Process]) -> None:
        _signal_group(self.pgid, signal.SIGKILL)
        for process in strays:
            try:
                if process.is_running():  # psutil compares the start time: never a reused pid
                    process.kill()
            except psutil.Error:
                pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass


def _signal_group(pgid: int, sig: int) -> bool:
    """Send `sig` to the group; False when no process is left in it."""
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def answers_200(url: str, timeout_s: float = 2.0) -> bool:
    """Whether `url` answers HTTP 200 now: the readiness check of a child that serves HTTP."""
    import requests

    try:
        return requests.get(url, timeout=timeout_s).status_code == 200
    except requests.RequestException:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on `host` a moment ago (the OS picks it)."""
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
"""The Host names a loopback-bound server answers to (with any port), besides the ones its user adds."""


def allowed_hosts(bind_host: str, extra: Sequence[str] = ()) -> tuple[str, ...] | None:
    """The Host header names a server bound to `bind_host` answers to; None: any.

    Why: a web page on another site can point its own DNS name at 127.0.0.1 (DNS rebinding) and reach a
    loopback server from the user's browser; its requests then carry that site's name as Host. A server
    bound to loopback therefore answers only to loopback names (and the `extra` ones its user names, e.g. a
    container's host name). One bound elsewhere is reached by names it cannot know, and needs its token.
    """
    if not is_loopback(bind_host):
        return tuple(name.lower() for name in extra) or None
    return (*LOOPBACK_NAMES, *(name.lower() for name in extra))


def host_allowed(host_header: str, allowed: Sequence[str] | None) -> bool:
    """Whether a request's Host header (`name`, `name:port`, `[v6]:port`) names an allowed host."""
    if allowed is None:
        return True
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8000
        name = host[1:host.find("]")] if "]" in host else host
    else:
        name = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
    return name in allowed


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) only reaches this machine: `localhost`, 127.0.0.0/8 or ::1."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
