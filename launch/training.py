"""The training command, the preparation commands, and running them with their output streamed.

Arguments may use placeholders, filled once the services are up: `{python}` (this interpreter),
`{repo}` (the checkout), `{experiment_dir}`, `{env_url}` (the service training talks to, the one with
`env_url: true`; empty when none was started). Hydra's own `${...}` interpolations are left alone.

Per-step metrics are written by verl's own `file` tracker (`trainer.logger` must list `file`, as the
recipe's config does by default) to `metrics.jsonl` in the experiment folder, one JSON object per
`Tracking.log` call: `{"step": N, "data": {"actor/pg_loss": -0.1, ...}}`. The launcher only reads that
file back to print a one-line summary per step; it never parses training's console output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Callable, TextIO

from envservice.childproc import ChildProcess
from launch.config import LaunchConfigError, PrepareStep, TrainConfig
from launch.signals import ProcessTracker
from beyond_agent.integrity import fired_monitors
from beyond_agent.run_folder import METRICS_FILE, METRICS_PATH_VARIABLE

PLACEHOLDER = re.compile(r"(?<!\$)\{([A-Za-z_][A-Za-z0-9_]*)\}")
# metric key -> label in the one-line summary printed per step
SUMMARY_KEYS = {"critic/score/mean": "score", "critic/rewards/mean": "reward", "actor/pg_loss": "pg_loss", "actor/entropy": "entropy",
                "response_length/mean": "response_len", "timing_s/step": "step_s"}


class PrepareError(RuntimeError):
    """A preparation step failed; the message has its last output line and its log."""


def substitute(arg: str, values: dict[str, str], where: str) -> str:
    """Replace `{name}` placeholders; an unknown name is an error listing the valid ones."""

    def replace(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            raise LaunchConfigError(f"{where}: unknown placeholder {{{name}}}; valid: "
                                    + ", ".join(f"{{{key}}}" for key in values))
        return values[name]

    return PLACEHOLDER.sub(replace, arg)


def cpu_settings() -> tuple[list[str], dict[str, str]]:
    """The CPU overrides and environment from verl_cpu/overrides.py."""
    try:
        from verl_cpu.overrides import CPU_ENV, cpu_overrides
    except ImportError as error:
        raise LaunchConfigError(f"train.cpu: true needs verl_cpu.overrides ({error})") from None
    return cpu_overrides(), dict(CPU_ENV)


def train_command(config: TrainConfig, values: dict[str, str], cli_overrides: list[str], token: bool) -> list[str]:
    """The full training command line: the raw `command`, or `python -m module` with Hydra overrides."""
    if config.command:
        base = [substitute(arg, values, "train.command") for arg in config.command]
        return base + cli_overrides
    command = [sys.executable, "-m", config.module]
    if config.config_path:
        command.append(f"--config-path={Path(substitute(config.config_path, values, 'train.config_path')).resolve()}")
    if config.config_name:
        command.append(f"--config-name={config.config_name}")
    if config.cpu:
        command += cpu_settings()[0]
    if values.get("experiment_dir"):  # Hydra's composed config (.hydra/config.yaml) lands in the experiment
        command.append(f"hydra.run.dir={values['experiment_dir']}/hydra")
    command += [substitute(arg, values, "train.overrides") for arg in config.overrides]
    if values.get("env_url"):
        command.append(f"beyond_agent.env.url={values['env_url']}")
    if token:  # the secret stays in the environment, never on the command line
        command.append("beyond_agent.env.token=${oc.env:ENVSERVICE_TOKEN}")
    return command + cli_overrides


def train_env(config: TrainConfig, dotenv: dict[str, str], values: dict[str, str]) -> dict[str, str]:
    """Environment additions for training: `.env`, CPU settings (unless already set), `train.env`, the URL."""
    env = {key: value for key, value in dotenv.items() if value != ""}
    if config.cpu:
        env.update({key: value for key, value in cpu_settings()[1].items() if key not in os.environ})
    env.update({key: substitute(value, values, f"train.env.{key}") for key, value in config.env.items()})
    if values.get("env_url"):
        env["ENVSERVICE_URL"] = values["env_url"]
    if values.get("experiment_dir"):
        env.setdefault(METRICS_PATH_VARIABLE, str(Path(values["experiment_dir"]) / METRICS_FILE))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def step_summary(step: int, metrics: dict) -> str:
    """One short line with the metrics people watch, when present."""
    numbers = {key: value for key, value in metrics.items() if isinstance(value, (int, float))}
    shown = [f"{label}={numbers[key]:.4g}" for key, label in SUMMARY_KEYS.items() if key in numbers]
    # Validation scores are named per data source: val-core/<source>/reward/mean@1.
    shown += [f"{key.split('/')[1]}_val={value:.4g}" for key, value in numbers.items()
              if key.startswith("val-core/") and key.endswith("/reward/mean@1")]
    # The integrity monitors that fired at this step (their own WARNING line is in training's output, which a
    # wrapper such as the learning bench may send to a log): the step's line says so too.
    fired = fired_monitors(numbers)
    if fired:
        shown.append(f"INTEGRITY ALARM: {', '.join(fired)}")
    return f"step {step}: " + (", ".join(shown) or f"{len(metrics)} metrics")


def run_streamed(name: str, command: list[str], env: dict[str, str], log_path: Path, tracker: ProcessTracker,
                 on_line: Callable[[str], None] | None = None, echo: TextIO = sys.stdout,
                 redact: Callable[[str], str] = lambda line: line) -> int:
    """Run `command` in its own process group; copy its output (through `redact`, which hides the run's secret
    values) to the terminal and `log_path`; return its code."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w") as log:
        child = tracker.add(ChildProcess.start(command, name, env={**os.environ, **env}, stdout=subprocess.PIPE,
                                               stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace"))
        for line in child.process.stdout:
            line = redact(line)
            log.write(line)
            log.flush()
            echo.write(line)
            echo.flush()
            if on_line:
                on_line(line)
        return child.process.wait()


class MetricsFollower:
    """Reads the lines verl's `file` tracker appended to metrics.jsonl and prints a summary per step.

    Call it after each line of training output (it only looks at the file when it grew) and once more
    when training has ended.
    """

    def __init__(self, path: Path, say: Callable[[str], None]):
        self.path = path
        self.say = say
        self.steps = 0
        """Records read so far."""
        self._offset = 0

    def __call__(self, _line: str = "") -> None:
        if not self.path.exists() or self.path.stat().st_size == self._offset:
            return
        with self.path.open("rb") as source:
            source.seek(self._offset)
            chunk = source.read()
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line still being written waits for the next call
        self._offset += len(complete)
        for raw in complete.decode(errors="replace").splitlines():
            self._show(raw)

    def _show(self, raw: str) -> None:
        try:
            record = json.loads(raw)
            step, data = int(record["step"]), dict(record["data"])
        except (ValueError, KeyError, TypeError):
            self.say(f"metrics.jsonl: a line is not verl's file-tracker format: {raw[:120]!r}")
            return
        self.steps += 1
        self.say(step_summary(step, data))


def run_prepare(step: PrepareStep, values: dict[str, str], env: dict[str, str], logs: Path,
                tracker: ProcessTracker, say: Callable[[str], None]) -> None:
    """Run one preparation step (skipped when its output exists); a failure raises with its last line."""
    marker = substitute(step.skip_if_exists, values, f"prepare {step.name}.skip_if_exists") if step.skip_if_exists else None
    if marker and Path(marker).exists():
        say(f"prepare {step.name}: skipped ({marker} exists)")
        return
    command = [substitute(arg, values, f"prepare {step.name}.command") for arg in step.command]
    say(f"prepare {step.name}: {' '.join(command)}")
    log = logs / f"prepare_{step.name}.log"
    code = run_streamed(f"prepare {step.name}", command, env, log, tracker)
    if code != 0:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
        raise PrepareError(f"prepare {step.name} failed with code {code}: {lines[-1] if lines else '(no output)'} "
                           f"(log: {log})")
