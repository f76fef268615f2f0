"""The example launcher YAMLs and scripts: each starts with its command, parses, and composes with Hydra."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from launch.config import load_config
from launch.training import train_command
from recipe.beyond_agent.settings import BeyondAgentSettings

pytestmark = pytest.mark.timeout(120)
REPO_ROOT = Path(__file__).resolve().parents[2]
ENV_CONFIGS = sorted((REPO_ROOT / "examples").glob("*/envs.yaml"))
"""envservice env-config files (`--env-config`), not launcher YAMLs."""
EXAMPLES = sorted(set((REPO_ROOT / "examples").glob("*/*.yaml")) - set(ENV_CONFIGS))
SCRIPTS = sorted((REPO_ROOT / "examples").glob("**/run_*.sh"))
SECRET = re.compile(r"(TOKEN|API_KEY|SECRET|PASSWORD)\s*[=:]\s*\S", re.IGNORECASE)


def example_id(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT / "examples"))


def test_every_environment_has_a_yaml_and_a_script():
    for env in ("babyai", "textcraft", "frozenlake", "sciworld", "alfworld", "textworld", "search", "appworld",
                "webshop", "webarena"):
        assert (REPO_ROOT / "examples" / env / f"{env}.yaml").exists()
        assert (REPO_ROOT / "examples" / env / f"run_{env}.sh").exists()
    assert (REPO_ROOT / "examples" / "quickstart" / "cpu_tiny.yaml").exists()


@pytest.mark.parametrize("path", ENV_CONFIGS, ids=example_id)
def test_env_configs_load_and_every_launcher_yaml_names_an_existing_one(path, monkeypatch):
    """Each shipped env-config registers its envs (class imported, config valid, `${VAR:-default}` filled)."""
    from envservice import registry
    from envservice.env_config import load_env_config

    monkeypatch.delenv("WEBSHOP_URL", raising=False)
    registrations = load_env_config(path)
    try:
        assert registrations and all(r.env_class().task_counts() for r in registrations)
        assert all(r.config["url"].startswith("http://127.0.0.1:") for r in registrations if "url" in r.config)
    finally:
        for registration in registrations:
            registry.unregister(registration.env_id)
    for example in EXAMPLES:
        env_config = (load_config(example, Path("/nonexistent.env")).services.get("envservice") or None)
        if env_config and "--env-config" in env_config.command:
            assert (REPO_ROOT / env_config.command[env_config.command.index("--env-config") + 1]).exists()


@pytest.mark.parametrize("path", EXAMPLES, ids=example_id)
def test_yaml_starts_with_its_command_and_holds_no_secret(path):
    relative = path.relative_to(REPO_ROOT)
    assert path.read_text().splitlines()[0].startswith(f"# python launcher.py --conf {relative} ")
    assert not SECRET.search(path.read_text())


@pytest.mark.parametrize("path", SCRIPTS, ids=example_id)
def test_script_starts_with_its_command_and_dry_runs(path):
    lines = path.read_text().splitlines()
    assert lines[0] == "#!/usr/bin/env bash" and lines[1].startswith(f"# bash {path.relative_to(REPO_ROOT)}")
    result = subprocess.run(["bash", str(path), "--dry-run"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert re.search(r"^would start (envservice|appworld): ", result.stdout, re.M), result.stdout
    assert "training command: " in result.stdout


@pytest.mark.parametrize("path", EXAMPLES, ids=example_id)
def test_training_overrides_compose_with_the_recipe_config(path, tmp_path):
    """Every key the example sets exists in verl's + our config, and our `beyond_agent:` section is valid."""
    config = load_config(path, tmp_path / "no.env")
    values = {"python": "python", "repo": str(REPO_ROOT), "experiment_dir": str(tmp_path), "env_url": "http://x:1"}
    command = train_command(config.train, values, [], token=False)
    overrides = [arg for arg in command[3:] if not arg.startswith(("--config", "hydra."))]
    with initialize_config_dir(config_dir=str(REPO_ROOT / "recipe/beyond_agent/config"), version_base=None):
        composed = compose(config_name="beyond_agent_trainer", overrides=overrides)
    assert composed.beyond_agent.env.url == "http://x:1"
    BeyondAgentSettings.from_config(composed)
