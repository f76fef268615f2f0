"""An environment from a package of its own, plugged in through the `envservice.envs` entry point.

The test writes a throw-away package (its own pyproject.toml, one module, one entry point), installs it
with pip into a temporary site folder (not our venv), and then, with only PYTHONPATH pointing there:
`python -m envservice --envs counter` serves it (in-process and in worker processes), an episode is
played to success over HTTP, GET /envs shows the limits the class declares, and
`python -m envservice.check counter` passes. No file of this repository is edited.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from envservice.client import EnvClient
from envservice.process import EnvServiceProcess

pytestmark = pytest.mark.timeout(300)

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "counter-env"
version = "0.1.0"

[tool.setuptools]
py-modules = ["counter_env"]

[project.entry-points."envservice.envs"]
counter = "counter_env:CounterEnv"
"""

MODULE = '''
"""A user's env: count up to the task's target."""
import os

from envservice import Task, TextEnv, clip_text


class CounterEnv(TextEnv):
    description = "count up to a target with 'inc'"
    splits = {"train": ["to2", "to3"], "test": ["to4"]}
    max_steps = 12       # limits as class attributes: read by the registry
    max_sessions = 7

    def reset(self, task: Task):
        self.target = int(task.name[2:])
        self.value = 0
        return f"Count to {self.target}. Value 0.", {"pid": os.getpid()}

    def step(self, action: str):
        if action != "inc":
            return f"Unknown action {clip_text(action)!r}; valid: inc.", 0.0, False, False, {"pid": os.getpid()}
        self.value += 1
        done = self.value >= self.target
        return f"Value {self.value}.", 0.5, done, False, {"pid": os.getpid()}

    def evaluate(self):
        return float(self.value >= self.target), self.value >= self.target
'''


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory) -> Path:
    """The package installed by pip into a temporary site folder (no network: setuptools of our venv)."""
    root = tmp_path_factory.mktemp("plugin")
    package = root / "counter-env"
    package.mkdir()
    (package / "pyproject.toml").write_text(PYPROJECT)
    (package / "counter_env.py").write_text(textwrap.dedent(MODULE))
    site = root / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-index", "--target", str(site), str(package)], capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(site.glob("counter_env-0.1.0.dist-info/entry_points.txt")), sorted(p.name for p in site.iterdir())
    return site


def with_site(site: Path) -> dict[str, str]:
    """Our environment with the plugin's site folder on the path (workers inherit it)."""
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH", "")]))}


@pytest.mark.parametrize("backend", ["inprocess", "process"])
def test_installed_plugin_is_served_and_played_to_success(plugin_site, tmp_path, backend):
    workers = {"workers": 1} if backend == "process" else {}
    with EnvServiceProcess(["counter"], env=with_site(plugin_site), log_path=tmp_path / "service.log",
                           backend=backend, **workers) as service, EnvClient(service.url) as client:
        (spec,) = client.envs()
        assert (spec.id, spec.max_steps, spec.max_sessions) == ("counter", 12, 7)
        assert spec.tasks == {"train": 2, "test": 1}
        created = client.create("counter", task_id="to3", seed=0)
        assert created.observation == "Count to 3. Value 0."
        assert client.step(created.session_id, "jump").observation == "Unknown action 'jump'; valid: inc."
        steps = [client.step(created.session_id, "inc") for _ in range(3)]
        assert [s.reward for s in steps] == [0.5, 0.5, 0.5] and steps[-1].terminated
        evaluation = client.evaluate(created.session_id)
        assert evaluation.success and evaluation.score == 1.0
        if backend == "process":  # the env ran in a worker, which imported the plugin by its entry point
            assert steps[0].info["pid"] != service.process.pid
        client.release(created.session_id)


def test_check_env_passes_on_the_installed_plugin(plugin_site):
    done = subprocess.run([sys.executable, "-m", "envservice.check", "counter", "--json"], capture_output=True,
                          text=True, env={**os.environ, **with_site(plugin_site)}, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    assert report["env_id"] == "counter" and report["passed"]
    assert {"reset_deterministic", "step_types", "step_after_end_refused", "release_closes"} <= set(report["clauses"])


def test_without_the_package_the_id_is_unknown_and_the_valid_ids_are_listed(tmp_path):
    """The same command without the site folder: the plugin is really what made `counter` exist."""
    done = subprocess.run([sys.executable, "-m", "envservice", "--envs", "counter", "--port", "0"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--envs has unknown id(s) ['counter']; valid ids:" in done.stderr and "babyai" in done.stderr
