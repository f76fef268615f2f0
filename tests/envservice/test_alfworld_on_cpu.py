"""ALFWorld engine through envservice: generated games of all six task types are solved by the planner's
plan, generation is deterministic and keeps train/test scenes apart, and `check_env` passes."""

from __future__ import annotations

import json

import pytest

import envservice
from envservice.envs.base import STATE_KEY
from envservice.envs.alfworld_env import (TASK_TYPES, AlfWorldEnv, generate_game, gold_actions, load_scene,
                                          scene_numbers)

pytestmark = pytest.mark.startup  # ALFWorld's planner: the full run only (tests/conftest.py)

FIRST_TEST_TASK_OF_TYPE = {"pick_and_place_simple": 0, "pick_cool_then_place_in_recep": 2,
                           "pick_two_obj_and_place": 3, "look_at_obj_in_light": 10,
                           "pick_clean_then_place_in_recep": 18, "pick_heat_then_place_in_recep": 52}


def _task(index: int, split: str = "test"):
    return AlfWorldEnv.resolve_task(index, split, 0, {})


@pytest.mark.timeout(180)
def test_planner_gold_path_solves_every_task_type() -> None:
    assert set(FIRST_TEST_TASK_OF_TYPE) == set(TASK_TYPES)
    env = AlfWorldEnv()
    for task_type, index in FIRST_TEST_TASK_OF_TYPE.items():
        observation, info = env.reset(_task(index))
        assert info["task_type"] == task_type and observation.startswith("-= Welcome to TextWorld, ALFRED! =-")
        assert observation.endswith(f"Your task is to: {info['goal']}.")
        actions = gold_actions(_task(index))
        for action in actions:
            assert action in info["admissible_commands"], (task_type, action)
            observation, reward, terminated, truncated, info = env.step(action)
        assert terminated and not truncated and reward == 1.0, (task_type, observation)
        assert env.evaluate() == (1.0, True)
    env.close()


@pytest.mark.timeout(60)
def test_alfworld_text_and_invalid_command() -> None:
    env = AlfWorldEnv()
    observation, info = env.reset(_task(0))
    assert "You are in the middle of a room. Looking quickly around you, you see a cabinet" in observation
    assert info["goal"] == "put some pot on sinkbasin"
    # A command that does nothing leaves the game's facts, hence its state key, as they were (#53).
    assert env.step("fly to the moon") == ("Nothing happens.", 0.0, False, False,
                                           {"admissible_commands": info["admissible_commands"],
                                            STATE_KEY: info[STATE_KEY]})
    observation, _, _, _, moved = env.step("go to sinkbasin 1")
    assert observation.startswith("You arrive at sinkbasin 1.") and moved[STATE_KEY] != info[STATE_KEY]
    assert env.evaluate() == (0.0, False)


def test_generation_is_deterministic_and_splits_use_other_scenes() -> None:
    generate_game.cache_clear()
    first = generate_game("train", 7)
    generate_game.cache_clear()
    assert generate_game("train", 7) == first
    assert generate_game("train", 8) != first
    assert not set(scene_numbers("train")) & set(scene_numbers("test"))
    assert generate_game("test", 0).scene in scene_numbers("test")
    assert AlfWorldEnv.task_counts() == {"train": 10_000, "test": 1_000}
    types = {generate_game("train", i).task_type for i in range(200)}
    assert types == set(TASK_TYPES)


def test_sink_basins_and_lamps_come_from_the_layouts() -> None:
    kitchen = load_scene(1)
    assert "Sink|-01.90|+00.97|-01.50|SinkBasin" in kitchen.receptacles
    assert any(scene for scene in scene_numbers("train") if load_scene(scene).lamps)


@pytest.mark.timeout(180)
def test_check_env_passes() -> None:
    assert "step_after_end_refused" in envservice.check_env("alfworld")


@pytest.mark.timeout(120)
def test_official_game_files_are_used_when_present(monkeypatch, tmp_path) -> None:
    """A folder laid out like ALFWorld's download (here filled with a generated game) replaces generation."""
    from envservice.envs import alfworld_env

    game = generate_game("test", 0)
    folder = tmp_path / "json_2.1.1" / "valid_unseen" / "pick_and_place_simple-Pot-None-SinkBasin-1" / "trial_T1"
    folder.mkdir(parents=True)
    (folder / "game.tw-pddl").write_text(json.dumps(alfworld_env.game_data(game)))
    unsolvable = folder.parent.parent / "pick_two_obj_and_place-Pen-None-Desk-2" / "trial_T2"
    unsolvable.mkdir(parents=True)
    (unsolvable / "game.tw-pddl").write_text(json.dumps({**alfworld_env.game_data(game), "solvable": False}))
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))
    games = alfworld_env.official_games()
    assert games == {"valid_unseen": ["pick_and_place_simple-Pot-None-SinkBasin-1/trial_T1"]}
    monkeypatch.setattr(AlfWorldEnv, "splits", games)
    monkeypatch.setattr(AlfWorldEnv, "official", True)
    task = AlfWorldEnv.resolve_task(0, "valid_unseen", 0, {})
    env = AlfWorldEnv()
    observation, info = env.reset(task)
    assert info["task_type"] == "pick_and_place_simple" and info["goal"] == "put some pot on sinkbasin"
    for action in gold_actions(task):
        env.step(action)
    assert env.evaluate() == (1.0, True)


def test_no_official_games_without_alfworld_data(monkeypatch, tmp_path) -> None:
    from envservice.envs import alfworld_env

    monkeypatch.delenv("ALFWORLD_DATA", raising=False)
    assert alfworld_env.official_games() is None
    monkeypatch.setenv("ALFWORLD_DATA", str(tmp_path))  # exists but holds no json_2.1.1
    assert alfworld_env.official_games() is None
    assert not AlfWorldEnv.official


@pytest.mark.timeout(240)
def test_sessions_reset_and_stepped_at_once_in_threads_all_work_and_stdout_stays_put(play_in_threads) -> None:
    """The service runs each session's calls in a thread of its own. TextWorld's PDDL stack shares a parser and
    grammars per process, and its reset swaps `sys.stdout` for a buffer: before #69 four sessions at once failed
    (a parse error in reset, a NameError in a step; found by `python -m envservice.check --hacks alfworld`) and the
    process's stdout was left pointing at a dropped buffer."""
    import sys

    stdout = sys.stdout
    tasks = [AlfWorldEnv.resolve_task(index % 2, "train", index % 2, {}) for index in range(8)]
    outcomes = play_in_threads(AlfWorldEnv, tasks, ("look", "inventory"))
    assert outcomes == ["ok"] * 8, next(outcome for outcome in outcomes if outcome != "ok")
    assert sys.stdout is stdout
