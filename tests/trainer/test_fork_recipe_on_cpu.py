"""A recipe is forked by copying its folder: the copy composes, passes the config check and uses its own files.

The RL recipe folder is copied under a new package name outside the repository; nothing is renamed. Hydra
composes the copy's own config (verl's ppo_trainer plus our section), the copy's config check passes, and
its entry point trains with the copy's trainer class, not the original's.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.startup  # fresh processes importing verl: the full run only (tests/conftest.py)
REPO_ROOT = Path(__file__).resolve().parents[2]
RECIPE_FOLDERS = ("multiturn_rl", "agentevol", "agent_r", "sft", "dpo")
MAX_FILES_PER_RECIPE = 8


def fork(tmp_path: Path, name: str = "my_rl") -> Path:
    folder = tmp_path / name
    shutil.copytree(REPO_ROOT / "recipe" / "multiturn_rl", folder, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def run_in_fork(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO_ROOT)])}
    return subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


CHECKS_IN_THE_COPY = """
import json
from hydra import compose, initialize_config_dir
import my_rl.main as entry

def check(overrides):
    with initialize_config_dir(config_dir=entry.__file__.rsplit('/', 1)[0] + '/config', version_base=None):
        config = compose('beyond_agent_trainer', overrides=['beyond_agent.env.url=http://127.0.0.1:1', *overrides])
    try:
        entry.check_config(config)
        return 'passed'
    except SystemExit as refusal:
        return f'refused: {refusal}'

print(json.dumps({'trainer': entry.BeyondAgentTrainer.__module__, 'entry': entry.__file__, 'default': check([]),
                  'bad key': check(['+beyond_agent.trajectories.evry=2'])}))
"""
"""One process of the copy (one verl import) runs its config check on the default config and on a bad key."""


@pytest.fixture(scope="module")
def copy_checks(tmp_path_factory) -> tuple[Path, dict]:
    tmp_path = tmp_path_factory.mktemp("fork")
    folder = fork(tmp_path)
    checked = run_in_fork(tmp_path, "-c", CHECKS_IN_THE_COPY)
    assert checked.returncode == 0, checked.stderr
    return folder, json.loads(checked.stdout.strip().splitlines()[-1])


def test_a_copied_rl_recipe_composes_checks_and_uses_its_own_trainer(tmp_path, copy_checks):
    folder = fork(tmp_path)
    code = [path for path in folder.rglob("*") if path.suffix in (".py", ".yaml")]
    imports_of_the_original = [f"{path.name}: {line}" for path in code for line in path.read_text().splitlines()
                               if re.search(r"^\s*(from|import)\s+recipe\.", line) or "_target_: recipe." in line]
    assert imports_of_the_original == []
    composed = run_in_fork(tmp_path, "-m", "my_rl.main", "--cfg", "job", "beyond_agent.env.url=http://127.0.0.1:1")
    assert composed.returncode == 0, composed.stderr
    assert "beyond_agent:" in composed.stdout and "adv_estimator: grpo" in composed.stdout
    checked_folder, checks = copy_checks
    assert checks["default"] == "passed"
    assert (checks["trainer"], checks["entry"]) == ("my_rl.trainer", str(checked_folder / "main.py"))


def test_a_bad_key_in_the_copy_is_refused_by_the_copy(copy_checks):
    _, checks = copy_checks
    assert checks["bad key"].startswith("refused: ")
    assert "beyond_agent.trajectories has unknown key(s) ['evry']; valid keys: every, dir, max_per_step" in \
        checks["bad key"]


def test_every_recipe_folder_is_a_handful_of_files():
    for name in RECIPE_FOLDERS:
        files = [path for path in (REPO_ROOT / "recipe" / name).rglob("*")
                 if path.is_file() and "__pycache__" not in path.parts]
        assert 0 < len(files) <= MAX_FILES_PER_RECIPE, (name, sorted(map(str, files)))
    assert sorted(path.name for path in (REPO_ROOT / "recipe").iterdir() if path.is_dir()
                  and path.name != "__pycache__") == sorted(RECIPE_FOLDERS)
