"""Fixtures for the launcher tests: run `launcher.py` as a real child, fake trainers and fake services.

The launcher runs as its own session (so the signals a test sends reach it alone, like Ctrl-C in a
terminal reaches the foreground launcher and not the groups it started). A "fake service" is a `python`
put first on PATH by an APPWORLD_ACTIVATION script: it never prints the ready line, and records its pid
and its child's pid, so tests can check that exactly these are stopped.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from dev_tools.processes import is_alive

REPO_ROOT = Path(__file__).resolve().parents[2]

FAKE_TRAIN = '''
import json, os, signal, subprocess, sys, time
out = sys.argv[1]
steps = int(sys.argv[2])
then = sys.argv[3]            # "exit" | "hang" | "ignore-term"
if then == "ignore-term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "300"])
with open(os.path.join(out, "train_pids.txt"), "w") as f:
    f.write(f"{os.getpid()} {child.pid}\\n")
print("fake trainer sees", os.environ.get("ENVSERVICE_URL"), "args", sys.argv[4:], flush=True)
metrics = os.environ["VERL_FILE_LOGGER_PATH"]  # set by the launcher; verl's `file` tracker writes there
for step in range(1, steps + 1):
    data = {"critic/score/mean": step / 10, "actor/pg_loss": -0.25}
    with open(metrics, "a") as f:  # one line per Tracking.log call, in verl's file-tracker format
        f.write(json.dumps({"step": step, "data": data}) + "\\n")
    print(f"(TaskRunner pid={os.getpid()}) step:{step} - critic/score/mean:{step / 10} - actor/pg_loss:-0.25", flush=True)
    time.sleep(0.1)
if then != "exit":
    time.sleep(300)
child.kill()
'''

FAKE_SERVICE_PYTHON = '''#!/bin/bash
# A "python" that pretends to be an env service which never becomes ready.
echo "fake service: loading tasks from {data}" >&2
echo $$ > {out}/service_pid.txt
sleep 300 &
echo $! > {out}/service_child_pid.txt
wait
'''


def wait_for(predicate, timeout_s: float, what: str):
    """Poll `predicate` until truthy; fail naming `what`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class LauncherRun:
    """One `python launcher.py ...` child, its combined output in a file."""

    def __init__(self, args: list[str], tmp_path: Path):
        self.output_path = tmp_path / "launcher_output.txt"
        self.output = self.output_path.open("w")
        self.process = subprocess.Popen([sys.executable, str(REPO_ROOT / "launcher.py"), *args], cwd=REPO_ROOT,
                                        stdout=self.output, stderr=subprocess.STDOUT, start_new_session=True)

    def text(self) -> str:
        return self.output_path.read_text()

    def wait(self, timeout_s: float = 120) -> int:
        try:
            return self.process.wait(timeout=timeout_s)
        finally:
            self.output.close()

    def experiment_dir(self, backup: Path) -> Path:
        return wait_for(lambda: next(iter(backup.glob("*/")), None), 30, "the experiment folder")


@pytest.fixture
def launch(tmp_path: Path):
    """Start the launcher with the given arguments; kill its group at the end if a test left it running."""
    runs: list[LauncherRun] = []

    def start(*args: str) -> LauncherRun:
        runs.append(LauncherRun(list(args), tmp_path))
        return runs[-1]

    yield start
    for run in runs:
        if run.process.poll() is None:
            os.killpg(run.process.pid, 9)
            run.process.wait()


@pytest.fixture
def fake_train(tmp_path: Path) -> Path:
    """A trainer that prints verl-style step lines; argv: OUT STEPS exit|hang|ignore-term [overrides...]."""
    path = tmp_path / "fake_train.py"
    path.write_text(FAKE_TRAIN)
    return path


def appworld_service() -> dict:
    """The `services.appworld` entry of the AppWorld example, as a user copies it into their YAML."""
    return yaml.safe_load((REPO_ROOT / "examples" / "appworld" / "appworld.yaml").read_text())["services"]["appworld"]


@pytest.fixture
def appworld():
    """A `services:` section holding the example's AppWorld entry, with some keys replaced: appworld(**keys)."""
    return lambda **keys: {"appworld": {**appworld_service(), **keys}}


@pytest.fixture
def fake_service_env(tmp_path: Path) -> Path:
    """A .env whose APPWORLD_ACTIVATION puts a never-ready fake `python` first on PATH."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.write_text(FAKE_SERVICE_PYTHON.format(out=tmp_path, data="/nonexistent/appworld/data"))
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    activate = tmp_path / "activate.sh"
    activate.write_text(f'export PATH="{bin_dir}:$PATH"\n')
    dotenv = tmp_path / "fake.env"
    dotenv.write_text(f"APPWORLD_ACTIVATION={activate}\nAPPWORLD_PATH=/nonexistent/appworld\nWANDB_API_KEY=secret-123\n")
    return dotenv


@pytest.fixture
def unrelated_processes():
    """Processes the launcher did not start: one in pytest's group, one in its own session. Must survive."""
    same_group = subprocess.Popen(["sleep", "300"])
    own_session = subprocess.Popen(["sleep", "300"], start_new_session=True)
    yield [same_group, own_session]
    for process in (same_group, own_session):
        process.kill()
        process.wait()


def write_conf(path: Path, data: dict) -> Path:
    """A launcher YAML written from a dict, starting with the command that runs it."""
    path.write_text(f"# python launcher.py --conf {path}\n" + yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture
def conf(tmp_path: Path):
    """Write a launcher YAML into tmp_path: conf({...}) -> path."""
    return lambda data, name="launch.yaml": write_conf(tmp_path / name, data)


@pytest.fixture
def helpers():
    """is_alive and wait_for for the tests (a conftest is not importable by name: several exist)."""
    return SimpleNamespace(is_alive=is_alive, wait_for=wait_for)
