"""Start the services the launcher was asked for, with progress, a deadline and a one-line error.

A service is a `childproc.ChildProcess` (its own process group) built from a `ServiceConfig`: its command
with `{host}`, `{port}` and the launcher's placeholders filled in, its environment (`.env`, `env_file`,
`env` with `$NAME` expanded), and, when it has `activate`, run as
`bash -c '{ <activation>; } >&2 && exec python "$@"'` so that the pid we record is still the service
itself. It is ready once its `health_url` answers 200. A service with no command is the user's own
server: `wait_for_external` only waits for its `health_url`.
"""

from __future__ import annotations

import os
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from envservice.env_config import expand_variables
from envservice.childproc import ChildProcess, ChildStartError, answers_200, free_port
from launch.config import LaunchConfigError, ServiceConfig, load_dotenv
from launch.training import substitute

PROGRESS_EVERY_S = 5.0


class ServiceStartError(RuntimeError):
    """A service did not become healthy. `summary` is one readable line; `details` has the log tail."""

    def __init__(self, summary: str, details: str):
        super().__init__(f"{summary}\n{details}")
        self.summary = summary
        self.details = details


@dataclass
class PlannedService:
    """A service with its port chosen and its command, environment and health URL resolved."""

    config: ServiceConfig
    command: list[str]
    env: dict[str, str]
    """Additions to our environment."""
    health_url: str
    url: str
    """`http://host:port`: what training is given when the service has `env_url`."""


def activated(command: list[str], activation: str) -> list[str]:
    """Run `python <args>` after the activation command (or `source <file>`), in one bash that execs python.

    The activation's own stdout goes to the log (stderr): nothing of it can be mistaken for the service's.
    """
    prefix = f"source {shlex.quote(activation)}" if Path(activation).is_file() else activation
    return ["bash", "-c", f'{{ {prefix}; }} >&2 && exec python "$@"', "service", *command[1:]]


def plan_service(config: ServiceConfig, values: dict[str, str], dotenv: dict[str, str],
                 port: int | str | None = None) -> PlannedService:
    """Resolve one service: its port (`port`, else the configured one, else a free one), command,
    environment and URLs. A dry run passes a text such as "<free port>" to show instead of a number."""
    port = port if port is not None else (config.port or free_port(config.host))
    filled = {**values, "host": config.host, "port": str(port)}
    where = f"{config.where}.command"
    command = [substitute(arg, filled, where) for arg in config.command]
    env = service_env(config, dotenv)
    activation = expand_variables(config.activate, {**os.environ, **env}) if config.activate else ""
    if activation.strip():
        command = activated(command, activation.strip())
    health_url = expand_variables(substitute(config.health_url, filled, f"{config.where}.health_url"), {**os.environ, **env})
    if config.external:  # the user's server: its URL is where its health URL points
        parts = urlsplit(health_url)
        return PlannedService(config, [], env, health_url, f"{parts.scheme}://{parts.netloc}")
    return PlannedService(config, command, env, health_url, f"http://{config.host}:{port}")


def service_env(config: ServiceConfig, dotenv: dict[str, str]) -> dict[str, str]:
    """The service's environment additions: `.env`, then `env_file`, then `env` (with `$NAME` expanded)."""
    env = {**dotenv}
    if config.env_file:
        path = Path(config.env_file)
        if not path.exists():
            raise LaunchConfigError(f"{config.where}.env_file: {path} does not exist")
        env.update(load_dotenv(path))
    variables = {**os.environ, **env}
    env.update({key: expand_variables(value, variables) for key, value in config.env.items()})
    return {key: value for key, value in env.items() if value != ""}


def start_service(planned: PlannedService, log_path: Path, on_start, say=print) -> ChildProcess:
    """Start the service, hand its process to `on_start` at once (so a Ctrl-C stops it), wait until healthy."""
    config = planned.config
    say(f"starting {config.name}: {shlex.join(planned.command)} (log: {log_path})")
    child = ChildProcess.start(planned.command, config.name, log_path, env={**os.environ, **planned.env})
    on_start(child)
    report = _progress(config, child, say)
    try:
        elapsed = child.wait_until(lambda: answers_200(planned.health_url), config.startup_timeout_s,
                                   f"answering {planned.health_url}", on_tick=report)
    except ChildStartError as error:
        raise failure(planned, error) from None
    say(f"{config.name} is healthy at {planned.url} after {elapsed:.1f} s")
    return child


def wait_for_external(planned: PlannedService, say=print, poll_s: float = 0.5) -> None:
    """Wait until the user's own server answers its health URL; else a `ServiceStartError` with its hint."""
    config = planned.config
    say(f"waiting for {config.name} (your own server) at {planned.health_url}")
    deadline = time.monotonic() + config.startup_timeout_s
    while not answers_200(planned.health_url):
        if time.monotonic() >= deadline:
            hint = f" {config.hint}" if config.hint else ""
            raise ServiceStartError(
                f"{config.name} is not running: nothing answered {planned.health_url} with 200 within "
                f"{config.startup_timeout_s:.0f} s ({config.timeout_key}).{hint}",
                f"the launcher does not start {config.where} (it has no command); start it, or fix "
                f"{config.where}.health_url")
        time.sleep(poll_s)
    say(f"{config.name} answers at {planned.url}")


def failure(planned: PlannedService, error: ChildStartError) -> ServiceStartError:
    """One summary line for a service that did not start, and its log's tail."""
    config = planned.config
    if error.timed_out:
        reason = (f"{planned.health_url} did not answer within {config.startup_timeout_s:.0f} s "
                  f"({config.timeout_key}); last log line: {error.last_log_line}")
    else:
        reason = f"exited with code {error.exit_code} after {error.elapsed_s:.1f} s: {error.last_log_line}"
    return ServiceStartError(f"{config.name} service did not start: {reason}", error.log_tail)


def _progress(config: ServiceConfig, child: ChildProcess, say):
    """A tick callback that prints a progress line every few seconds."""
    next_report = [PROGRESS_EVERY_S]

    def report(elapsed: float) -> None:
        if elapsed >= next_report[0]:
            next_report[0] += PROGRESS_EVERY_S
            say(f"  waiting for {config.name}: {elapsed:.0f} s of {config.startup_timeout_s:.0f} s; "
                f"last log line: {child.last_log_line()[:120]}")

    return report
