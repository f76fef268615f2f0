"""ScienceWorld through envservice: the gold path succeeds, the split table matches the jar, the JVM is capped
and stops on release, and `check_env` passes."""

from __future__ import annotations

import os

import psutil
import pytest

import envservice
from envservice.envs.base import STATE_KEY
from envservice.envs import sciworld
from envservice.envs.sciworld import VARIATIONS, ScienceWorldTextEnv, parse_task_name
from envservice.errors import EnvServiceError

pytestmark = pytest.mark.startup  # ScienceWorld's JVMs: the full run only (tests/conftest.py)


def _java_children() -> set[psutil.Process]:
    """JVMs started by this test process (the module fixture's shared one included)."""
    return {p for p in psutil.Process(os.getpid()).children(recursive=True) if p.name() == "java"}


@pytest.fixture(scope="module")
def sciworld_env():
    """One JVM shared by the tests of this module that do not test the JVM's life itself."""
    env = ScienceWorldTextEnv()
    yield env
    env.close()


@pytest.mark.timeout(120)
def test_gold_path_reaches_success(sciworld_env: ScienceWorldTextEnv) -> None:
    task = ScienceWorldTextEnv.resolve_task("boil:0", "train", 0, {})
    observation, info = sciworld_env.reset(task)
    assert observation.startswith("Your task is to boil water.") and "This room is called the hallway" in observation
    assert (info["task"], info["variation"]) == ("boil", 0)
    rewards = []
    for action in sciworld_env.gold_actions():
        observation, reward, terminated, truncated, step_info = sciworld_env.step(action)
        rewards.append(reward)
        if terminated:
            break
    assert terminated and not truncated
    assert sciworld_env.evaluate() == (1.0, True)
    assert sum(rewards) == pytest.approx(1.0) and step_info["score"] == 1.0


@pytest.mark.timeout(120)
def test_the_state_key_is_the_room_the_inventory_and_the_score(sciworld_env: ScienceWorldTextEnv) -> None:
    """GiGPO's anchor (#53): not the answer to the last command. Looking again keeps it, the same variation starts
    from the same key, a move to another room changes it, and coming back to the unchanged hallway returns to it."""
    task = ScienceWorldTextEnv.resolve_task("boil:0", "train", 0, {})
    start = sciworld_env.reset(task)[1][STATE_KEY]
    assert sciworld_env.step("look around")[4][STATE_KEY] == start
    assert sciworld_env.reset(task)[1][STATE_KEY] == start
    opened = sciworld_env.step("open door to kitchen")[4][STATE_KEY]
    moved = sciworld_env.step("go to kitchen")[4][STATE_KEY]
    assert len({start, opened, moved}) == 3
    assert sciworld_env.step("go to hallway")[4][STATE_KEY] == opened


@pytest.mark.timeout(120)
def test_split_table_matches_the_package(sciworld_env: ScienceWorldTextEnv) -> None:
    sim = sciworld_env._sim
    assert sorted(sim.get_task_names()) == sorted(VARIATIONS)
    for name, (count, train_end, dev_end) in VARIATIONS.items():
        sim.load(name, 0, "")
        assert sim.get_max_variations(name) == count, name
        assert sim.get_variations_train() == list(range(0, train_end)), name
        assert sim.get_variations_dev() == list(range(train_end, dev_end)), name
        assert sim.get_variations_test() == list(range(dev_end, count)), name


def test_splits_hold_every_variation_once() -> None:
    counts = ScienceWorldTextEnv.task_counts()
    assert counts == {"train": 3592, "dev": 1796, "test": 1819}
    assert sum(counts.values()) == sum(n for n, _, _ in VARIATIONS.values()) == 7207
    assert parse_task_name(ScienceWorldTextEnv.splits["test"][0]) == ("boil", 21)


@pytest.mark.timeout(120)
def test_unknown_action_and_bad_simplification(sciworld_env: ScienceWorldTextEnv) -> None:
    start = sciworld_env.reset(ScienceWorldTextEnv.resolve_task("melt:0", "train", 0, {}))[1][STATE_KEY]
    assert sciworld_env.step("fly to the moon") == (
        "No known action matches that input.", 0.0, False, False, {"score": 0.0, STATE_KEY: start})
    bad = ScienceWorldTextEnv.resolve_task("melt:0", "train", 0, {"simplifications": "easy,warp"})
    with pytest.raises(EnvServiceError, match=r"params.simplifications='easy,warp' has unknown simplification\(s\) "
                                              r"\['warp'\]") as failure:
        sciworld_env.reset(bad)
    assert "openDoors" in failure.value.valid_choices


@pytest.mark.timeout(120)
def test_jvm_heap_is_capped_and_release_stops_it(make_client, monkeypatch) -> None:
    monkeypatch.setenv(sciworld.JVM_HEAP_ENV, "256m")
    before = _java_children()
    client = make_client(env_ids=["sciworld"])
    created = client.post("/create", json={"env_id": "sciworld", "task_id": "boil:0", "split": "train", "seed": 0})
    assert created.status_code == 200, created.text
    session_id = created.json()["session_id"]
    javas = list(_java_children() - before)
    assert len(javas) == 1
    assert "-Xmx256m -XX:+UseSerialGC" in javas[0].environ().get("JAVA_TOOL_OPTIONS", "")
    assert "-Xmx256m" not in os.environ.get("JAVA_TOOL_OPTIONS", "")  # only the JVM got the option
    step = client.post("/step", json={"session_id": session_id, "action": "open door to kitchen"})
    assert step.status_code == 200 and "The door is now open." in step.json()["observation"]
    assert client.post("/release", json={"session_id": session_id}).status_code == 200
    psutil.wait_procs(javas, timeout=15)
    assert _java_children() == before


@pytest.mark.timeout(240)
def test_check_env_passes() -> None:
    before = _java_children()
    assert "release_closes" in envservice.check_env("sciworld")
    assert _java_children() == before  # the 7 JVMs check_env started are gone
