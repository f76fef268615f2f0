"""The experiment folder: everything needed to know later what ran, and how.

    <root>/<name>-<YYYYmmdd-HHMMSS>/
      launcher.yaml        the --conf file as given
      config.yaml          the resolved launch config (secret values hidden), services' URLs, training command
      command.txt          the launcher's command line and the training command
      git.txt, git.diff    the commit, `git status`, and the uncommitted diff
      verl.txt             the verl pin (REQUIRED_VERL.txt) and the installed verl version
      pip_freeze.txt       the installed packages
      processes.json       name, pid and process group of everything the launcher started
      logs/                each service's log, the preparation steps and training
      metrics.jsonl        one JSON object per logged step, written by verl's `file` tracker
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import yaml

from beyond_agent.verl_pin import installed_verl_version, read_pin
from launch.secrets import Redactor


def create_experiment_dir(root: Path, name: str) -> Path:
    """A new folder `<root>/<name>-<timestamp>` (with a suffix if that exists already)."""
    stem = f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    path, index = root / stem, 1
    while path.exists():
        path, index = root / f"{stem}-{index}", index + 1
    (path / "logs").mkdir(parents=True)
    return path


def _git(repo: Path, *args: str) -> str:
    """A git command's output, or a note saying why there is none."""
    try:
        result = subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"(git {' '.join(args)} failed: {error})\n"
    return result.stdout if result.returncode == 0 else f"(git {' '.join(args)}: {result.stderr.strip()})\n"


def write_git(folder: Path, repo: Path) -> None:
    """git.txt (commit and status) and git.diff (uncommitted changes to tracked files)."""
    sha = _git(repo, "rev-parse", "HEAD").strip()
    status = _git(repo, "status", "--short")
    dirty = "dirty" if status.strip() else "clean"
    (folder / "git.txt").write_text(f"commit: {sha}\nstate: {dirty}\n\n# git status --short\n{status}")
    (folder / "git.diff").write_text(_git(repo, "diff", "HEAD"))


def write_verl(folder: Path) -> None:
    """verl.txt: the pinned release and the installed one."""
    pin = read_pin()
    installed = installed_verl_version()
    match = "matches" if installed == pin.version else "DOES NOT MATCH"
    (folder / "verl.txt").write_text(f"pinned: {pin.version} (tag {pin.tag}, commit {pin.commit})\n"
                                     f"installed: {installed}\n{match} the pin\n")


def pip_freeze() -> str:
    """`pip freeze` of this interpreter; the installed distributions from importlib.metadata without pip."""
    try:
        result = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, timeout=120)
        if result.returncode == 0:
            return result.stdout
    except (OSError, subprocess.TimeoutExpired):
        pass
    from importlib import metadata

    lines = sorted({f"{dist.metadata['Name']}=={dist.version}" for dist in metadata.distributions()})
    return "# pip unavailable: listed from importlib.metadata\n" + "\n".join(lines) + "\n"


LAUNCHER_HEADER = "# launcher\n"
"""command.txt's first line; the launcher's own command line follows it."""
TRAINING_HEADER = "\n# training\n"
"""What follows the launcher's line in command.txt when it ran a training command; that command follows it."""


def write_commands(folder: Path, launcher_argv: list[str], train_command: list[str] | None,
                   redactor: Redactor) -> None:
    """command.txt: how the launcher was run and the training command it runs (secrets hidden)."""
    text = f"{LAUNCHER_HEADER}{shlex.join(launcher_argv)}\n"
    if train_command:
        text += f"{TRAINING_HEADER}{shlex.join(train_command)}\n"
    (folder / "command.txt").write_text(redactor.text(text))


def recorded_commands(folder: Path) -> tuple[list[str], list[str]]:
    """(launcher, training) command lines of the run in `folder`, from its command.txt as written above; [] for
    one not recorded."""
    commands = folder / "command.txt"
    text = commands.read_text() if commands.is_file() else ""
    launcher, marker, training = text.partition(TRAINING_HEADER)
    return (shlex.split(launcher.removeprefix(LAUNCHER_HEADER)) if text.startswith(LAUNCHER_HEADER) else [],
            shlex.split(training) if marker else [])


def recorded_launcher_command(folder: Path) -> list[str]:
    """How the launcher was run for the run in `folder`; [] if none is recorded."""
    return recorded_commands(folder)[0]


def recorded_training_command(folder: Path) -> list[str]:
    """The training command the run in `folder` ran; [] if none is recorded."""
    return recorded_commands(folder)[1]


def write_config(folder: Path, resolved: dict, conf_path: Path, redactor: Redactor) -> None:
    """config.yaml (resolved) and launcher.yaml (the file as given), secret values hidden in both."""
    (folder / "config.yaml").write_text(yaml.safe_dump(redactor.data(resolved), sort_keys=False))
    (folder / "launcher.yaml").write_text(redactor.text(conf_path.read_text()))


def write_processes(folder: Path, children) -> None:
    """processes.json: what the launcher started (tests and people can check these are gone)."""
    records = [{"name": child.name, "pid": child.process.pid, "pgid": child.pgid} for child in children]
    (folder / "processes.json").write_text(json.dumps(records, indent=2) + "\n")
