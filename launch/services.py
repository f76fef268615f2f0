"""Start the env services the launcher was asked for, with progress, a deadline and a one-line error.

Each service is an `envservice.process.EnvServiceProcess` (ready line + `/healthz`, own process group).
AppWorld's service may run in its own Python environment: with APPWORLD_ACTIVATION set, the command
becomes `bash -c '<activation> && exec python -m envservice ...'` (a path is `source`d), so the pid we
record is still the service itself.
"""

from __future__ import annotations

import shlex
import threading
import time
from pathlib import Path

from envservice.process import EnvServiceProcess
from launch.config import ServiceConfig
from launch.signals import Interrupted, ProcessTracker

PROGRESS_EVERY_S = 5.0


class ServiceStartError(RuntimeError):
    """A service did not become healthy. `summary` is one readable line; `details` has the log tail."""

    def __init__(self, summary: str, details: str):
        super().__init__(f"{summary}\n{details}")
        self.summary = summary
        self.details = details


def activated(command: list[str], activation: str) -> list[str]:
    """Run `python <args>` after the activation command (or `source <file>`), in one bash that execs python.

    The activation's own stdout goes to the log (stderr): the service's stdout must start with its ready line.
    """
    prefix = f"source {shlex.quote(activation)}" if Path(activation).is_file() else activation
    return ["bash", "-c", f'{{ {prefix}; }} >&2 && exec python "$@"', "envservice", *command[1:]]


def service_env(config: ServiceConfig, dotenv: dict[str, str]) -> dict[str, str]:
    """The service's environment additions: `.env` values, and AppWorld's data root when given."""
    env = dict(dotenv)
    if config.name == "appworld" and dotenv.get("APPWORLD_PATH"):
        env.setdefault("APPWORLD_ROOT", dotenv["APPWORLD_PATH"])  # the variable the appworld package reads
    return {key: value for key, value in env.items() if value != ""}


def build_service(config: ServiceConfig, log_path: Path, dotenv: dict[str, str]) -> EnvServiceProcess:
    """An EnvServiceProcess for `config` (not started)."""
    service = EnvServiceProcess(config.envs, host=config.host, port=config.port, extra_args=config.args,
                                startup_timeout_s=config.startup_timeout_s, log_path=log_path,
                                env=service_env(config, dotenv))
    if config.activation:
        service.cmd = activated(service.cmd, config.activation)
    return service


def last_message(log_path: Path) -> str:
    """The last non-empty line of a log: for a Python error, the `Type: message` line."""
    text = log_path.read_text(errors="replace") if log_path.exists() else ""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else "(the log is empty)"


def failure(config: ServiceConfig, service: EnvServiceProcess, error: BaseException, elapsed: float) -> ServiceStartError:
    """Turn whatever went wrong into a ServiceStartError with one summary line."""
    code = service.process.poll() if service.process else None
    if service.url is None and elapsed >= config.startup_timeout_s - 0.5:  # we stopped it at the deadline
        reason = (f"printed no ready line within {config.startup_timeout_s:.0f} s ({config.name}.startup_timeout_s); "
                  f"last log line: {last_message(service.log_path)}")
    elif code is not None:
        reason = f"exited with code {code} after {elapsed:.1f} s: {last_message(service.log_path)}"
    else:
        reason = f"{service.url}/healthz did not answer healthy: {type(error).__name__}: {error}"
    return ServiceStartError(f"{config.name} service ({' '.join(config.envs)}) did not start: {reason}",
                             service.log_tail())


def start_service(config: ServiceConfig, service: EnvServiceProcess, tracker: ProcessTracker, say=print) -> str:
    """Start `service` in a thread, record its process group, print progress; return its URL when healthy."""
    errors: list[BaseException] = []
    thread = threading.Thread(target=_start_into, args=(service, errors), daemon=True)
    started = time.monotonic()
    say(f"starting {config.name}: {shlex.join(service.cmd)} (log: {service.log_path})")
    thread.start()
    try:
        _wait_with_progress(config, service, thread, tracker, started, say)
    except Interrupted:
        _record_when_spawned(config, service, tracker)
        raise
    if errors:
        raise failure(config, service, errors[0], time.monotonic() - started)
    say(f"{config.name} is healthy at {service.url} after {time.monotonic() - started:.1f} s")
    return service.url


def _start_into(service: EnvServiceProcess, errors: list[BaseException]) -> None:
    try:
        service.start()
    except BaseException as error:  # reported by the main thread
        errors.append(error)


def _record_when_spawned(config: ServiceConfig, service: EnvServiceProcess, tracker: ProcessTracker) -> None:
    """Record the child's group once Popen has returned (it returns in milliseconds)."""
    deadline = time.monotonic() + 5.0
    while service.process is None and time.monotonic() < deadline:
        time.sleep(0.01)
    if service.process is not None and all(c.process is not service.process for c in tracker.children):
        tracker.add(config.name, service.process)


def _wait_with_progress(config, service, thread, tracker, started, say) -> None:
    """Join the start thread, recording the child and printing a progress line every few seconds."""
    next_report = started + PROGRESS_EVERY_S
    while thread.is_alive():
        thread.join(0.2)
        _record_when_spawned(config, service, tracker)
        if time.monotonic() >= next_report:
            next_report += PROGRESS_EVERY_S
            say(f"  waiting for {config.name}: {time.monotonic() - started:.0f} s of "
                f"{config.startup_timeout_s:.0f} s; last log line: {last_message(service.log_path)[:120]}")
