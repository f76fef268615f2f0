"""`kind: gymnasium`: a Gymnasium env served from an env-config file alone (FrozenLake-v1, CliffWalking)."""

from __future__ import annotations

from pathlib import Path

import pytest

from envservice.envs.base import STATE_KEY
from envservice import registry
from envservice.check import check_env
from envservice.client import EnvClient
from envservice.env_config import EnvConfigError, load_env_config
from envservice.process import EnvServiceProcess

pytestmark = pytest.mark.timeout(300)

FROZENLAKE_ENTRY = """frozenlake-gym:
  kind: gymnasium
  config:
    gym_id: FrozenLake-v1
    make_kwargs: {map_name: 4x4, is_slippery: false}
    action_names: [left, down, right, up]
    splits: {train: 20}
  max_steps: 20
"""
GOLD_PATH = ["down", "down", "right", "right", "down", "right"]
"""A shortest safe path on FrozenLake's fixed 4x4 map (SFFF / FHFH / FFFH / HFFG)."""


@pytest.fixture
def config_file(tmp_path) -> Path:
    path = tmp_path / "envs.yaml"
    path.write_text(FROZENLAKE_ENTRY)
    return path


@pytest.fixture
def frozenlake_gym(config_file):
    [registration] = load_env_config(config_file)
    yield registration
    registry.unregister(registration.env_id)


def test_frozenlake_from_config_alone_shows_the_agent_and_reaches_the_goal(frozenlake_gym):
    cls = frozenlake_gym.env_class()
    assert cls.task_counts() == {"train": 20} and frozenlake_gym.max_steps == 20
    env = cls()
    observation, info = env.reset(cls.resolve_task(3, "train", None, {}))
    assert observation.startswith("\n[S]FFF\nFHFH") and "Actions: left, down, right, up" in observation
    assert set(info) == {"reset_seed", STATE_KEY} and info["reset_seed"] == 3  # a fixed map: no held-out test split
    invalid = env.step("jump")
    assert invalid[0].startswith("Invalid action 'jump'. Valid actions: left, down, right, up")
    assert invalid[1:4] == (0.0, False, False)
    # The game's observation (the agent's cell here) is its state: a rejected action keeps its key (#53).
    assert invalid[4][STATE_KEY] == info[STATE_KEY] and env.step("up")[4][STATE_KEY] == info[STATE_KEY]
    assert env.step("right")[4][STATE_KEY] != info[STATE_KEY] and env.step("left")[4][STATE_KEY] == info[STATE_KEY]
    for action in GOLD_PATH:
        observation, reward, terminated, truncated, _ = env.step(action.upper())
    assert (reward, terminated, truncated) == (1.0, True, False) and "HFF[G]" in observation
    assert env.evaluate() == (1.0, True)
    env.close()


def test_check_env_passes_for_the_configured_gymnasium_env(frozenlake_gym):
    assert "reset_deterministic" in check_env(frozenlake_gym.env_id)


def test_a_user_renderer_draws_the_text(tmp_path, monkeypatch):
    (tmp_path / "my_renderer.py").write_text(
        "def describe(env, observation):\n    return f'you are on cell {observation}'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "envs.yaml"
    path.write_text("cliff:\n  kind: gymnasium\n  config: {gym_id: CliffWalking-v1, renderer: 'my_renderer:describe', "
                    "action_names: [up, right, down, left]}\n")
    [registration] = load_env_config(path)
    try:
        env = registration.env_class()()
        observation, _ = env.reset(registration.env_class().resolve_task(0, "train", None, {}))
        assert observation == "you are on cell 36\nActions: up, right, down, left"
        assert env.step("up")[0].startswith("you are on cell 24")
    finally:
        registry.unregister("cliff")


@pytest.mark.parametrize("config, expected", [
    ("{gym_id: FrozenLake-v1, action_names: [left, down, right]}", "has 3 names; FrozenLake-v1's action space has 4"),
    ("{gym_id: Pendulum-v1, action_names: [push]}", "Box action space; only Discrete"),
    ("{gym_id: NoSuchGame-v0, action_names: [a]}", "gym.make(config.gym_id='NoSuchGame-v0'"),
    ("{gym_id: FrozenLake-v1, action_names: [l, d, r, u], renderer: 'nowhere:draw'}", "config.renderer='nowhere:draw'"),
    ("{gym_id: FrozenLake-v1, action_names: [l, d, r, u], splits: {train: 0}}", "config.splits"),
    ("{action_names: [l, d, r, u]}", "lacks required setting(s) ['gym_id']"),
])
def test_bad_config_is_refused_at_load_naming_the_field(tmp_path, config, expected):
    path = tmp_path / "envs.yaml"
    path.write_text(f"game:\n  kind: gymnasium\n  config: {config}\n")
    with pytest.raises(EnvConfigError) as error:
        load_env_config(path)
    assert expected in str(error.value) and "game" in str(error.value)
    assert "game" not in registry.registered_ids()


@pytest.mark.parametrize("backend", ["inprocess", "process"])
def test_served_by_id_through_envservice_including_worker_processes(config_file, tmp_path, backend):
    """With `--backend process` the configured class reaches the workers as `module:Class#<config>`."""
    service = EnvServiceProcess(["frozenlake-gym"], log_path=tmp_path / "service.log", backend=backend,
                                workers=1 if backend == "process" else None,
                                extra_args=["--env-config", str(config_file)])
    with service, EnvClient(service.url) as client:
        [spec] = [spec for spec in client.envs() if spec.id == "frozenlake-gym"]
        assert spec.tasks == {"train": 20} and spec.max_steps == 20
        created = client.create("frozenlake-gym", task_id="seed-7")
        for action in GOLD_PATH:
            step = client.step(created.session_id, action)
        assert step.terminated and step.reward == 1.0
        assert client.evaluate(created.session_id).success
        client.release(created.session_id)
        assert client.health().sessions == 0
