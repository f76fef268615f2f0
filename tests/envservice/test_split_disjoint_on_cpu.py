"""Held-out means unseen: no task of one split has the content of a task of another split.

FrozenLake's test maps once came from seeds 1 000 000.. and 145 of the 200 were train maps; the
`split_disjoint` clause of `check_env` now compares the splits by content (`TextEnv.task_fingerprint`).
"""

from __future__ import annotations

import pytest
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

import envservice
from envservice.check import UNDECLARED_SPLITS, EnvCheckError, check_split_disjoint
from envservice.envs.base import Task, TextEnv
from envservice.envs.frozenlake import FrozenLakeEnv, TEST_MAPS, TRAIN_MAPS, generate_map
from envservice.errors import EnvServiceError


class _SeedOffsetFrozenLake(FrozenLakeEnv):
    """FrozenLake as it was: test map i from seed 1 000 000 + i, with no look at the train maps."""

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        seed = task.index + (1_000_000 if task.split == "test" else 0)
        return "|".join(generate_random_map(size=4, p=0.8, seed=seed))


def _maps(split: str, count: int, size: int) -> list[tuple[str, ...]]:
    return [tuple(generate_map(Task(split, index, f"map-{index}", 0, {"size": size}))) for index in range(count)]


def test_the_clause_catches_frozenlake_split_by_seed_offset() -> None:
    with pytest.raises(EnvCheckError) as failure:
        check_split_disjoint(_SeedOffsetFrozenLake, samples=200)
    message = str(failure.value)
    assert message.startswith("check_env[split_disjoint]: saw test task ")
    assert "has the content of train task" in message and "differ only by seed or index offsets" in message


@pytest.mark.parametrize("size", [4, 5, 6, 8, 12])
def test_no_frozenlake_test_map_is_a_train_map_and_none_repeats(size: int) -> None:
    train = set(_maps("train", TRAIN_MAPS, size))
    test = _maps("test", TEST_MAPS, size)
    assert len(set(test)) == TEST_MAPS and not set(test) & train


def test_frozenlake_train_maps_are_unchanged() -> None:
    """Train map i is still generate_random_map(seed=i): earlier runs' train tasks keep their meaning."""
    assert [list(m) for m in _maps("train", 50, 4)] == [generate_random_map(size=4, p=0.8, seed=i) for i in range(50)]
    # as the seed-offset version gave them (read off it on 2026-11-25)
    assert generate_map(Task("train", 0, "map-0", 0, {})) == ["SFFF", "HHFF", "FHHF", "HFFG"]
    assert generate_map(Task("train", 499, "map-499", 0, {})) == ["SFFF", "FHFF", "HFFF", "FFFG"]


def test_a_size_with_too_few_new_maps_says_how_many_exist() -> None:
    """3x3 has about 50 maps and the train split shows all but one: there is no larger held-out set."""
    only = len(set(_maps("test", 1, 3)))
    assert only == 1 and not set(_maps("test", 1, 3)) & set(_maps("train", TRAIN_MAPS, 3))
    with pytest.raises(EnvServiceError, match=r"params.size=3 has only 1 maps that no train task has: test task_id "
                                              r"must be below 1"):
        generate_map(Task("test", 1, "map-1", 0, {"size": 3}))


def test_the_fingerprint_ignores_how_a_map_is_shown() -> None:
    plain = FrozenLakeEnv.task_fingerprint(Task("test", 7, "map-7", 0, {}))
    shown = FrozenLakeEnv.task_fingerprint(Task("test", 7, "map-7", 99, {"around": True, "slippery": True}))
    assert plain == shown != FrozenLakeEnv.task_fingerprint(Task("test", 8, "map-8", 0, {}))


def test_check_env_reports_the_clause_for_frozenlake_and_says_when_an_env_cannot() -> None:
    assert "split_disjoint" in envservice.check_env("frozenlake")

    class _Silent(TextEnv):
        splits = {"train": ["a"], "test": ["a"]}

        def reset(self, task):
            return "", {}

        def step(self, action):
            return "", 0.0, True, False, {}

        def evaluate(self):
            return 0.0, False

    assert check_split_disjoint(_Silent) is False and "not held-out" in UNDECLARED_SPLITS


# --- envs that draw their tasks from seeds: the leaks found by content, and the fix ----------------------------------

import contextlib  # noqa: E402
import io  # noqa: E402
import random  # noqa: E402
from collections import defaultdict  # noqa: E402
from typing import Any, Callable  # noqa: E402

import gymnasium as gym  # noqa: E402

from envservice import registry  # noqa: E402
from envservice.envs.babyai import TEST_SEED_OFFSET, BabyAIEnv, layout_fingerprint  # noqa: E402
from envservice.envs.base import content_digest, content_split  # noqa: E402
from envservice.envs.gymnasium_text import GymnasiumTextEnv, start_content  # noqa: E402
from envservice.envs.sokoban import SokobanEnv, _draw_room, room_fingerprint  # noqa: E402
from envservice.envs.textarena_games import GuessTheNumberEnv, LightsOutEnv, MastermindEnv  # noqa: E402
from envservice.envs.textworld_env import TextWorldEnv, _fingerprint as textworld_content  # noqa: E402


def _shared(fingerprint: Callable[[Task], str], cls: type[TextEnv], samples: int, params: dict) -> int:
    """Contents shared by the train and test tasks `check_split_disjoint` samples (task k: index k mod size, seed k),
    played with `params` (the clause itself plays default params only)."""
    owners: dict[str, set[str]] = defaultdict(set)
    for split in ("train", "test"):
        for k in range(samples):
            owners[fingerprint(cls.resolve_task(k % len(cls.splits[split]), split, k, params))].add(split)
    return sum(len(splits) > 1 for splits in owners.values())


def _assert_train_tasks_kept(cls: type[TextEnv], old: Callable[[Task], str], params: dict) -> None:
    """A train task keeps the content it had unless that content is now a test content (earlier runs stay
    comparable on the others)."""
    kept = 0
    for index in range(50):
        task = cls.resolve_task(index, "train", index, params)
        if content_split(old(task)) == "train":
            assert cls.task_fingerprint(task) == old(task)
            kept += 1
    assert kept >= 10


def _old_sokoban(task: Task) -> str:
    """Sokoban's room as it was: the first room of the task's generator, whatever split it belongs to."""
    size, boxes = task.params.get("size", 7), task.params.get("boxes", 2)
    rng = random.Random(f"sokoban:{task.split}:{task.index}:{task.seed}:{size}:{boxes}")
    return room_fingerprint(_draw_room(rng, size, boxes))


class _FirstRoomSokoban(SokobanEnv):
    """Sokoban as it was, in 5x5 rooms with one box."""

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        return _old_sokoban(Task(task.split, task.index, task.name, task.seed, {"size": 5, "boxes": 1}))


def test_sokoban_small_rooms_were_shared_by_the_splits_and_no_longer_are() -> None:
    with pytest.raises(EnvCheckError, match="has the content of train task"):
        check_split_disjoint(_FirstRoomSokoban, samples=200)
    small = {"size": 5, "boxes": 1}
    assert _shared(_old_sokoban, SokobanEnv, 200, small) > 20  # 58 rooms of 200 tasks per split
    for params in (small, {"size": 6, "boxes": 1}, {}):
        assert _shared(SokobanEnv.task_fingerprint, SokobanEnv, 200, params) == 0
    _assert_train_tasks_kept(SokobanEnv, _old_sokoban, small)


def _old_textarena(cls: type) -> Callable[[Task], str]:
    """TextArena's instance as it was: the first game the task's generator resets, whatever split it belongs to."""

    def fingerprint(task: Task) -> str:
        rng = random.Random(f"{cls.__name__}:{task.split}:{task.index}:{task.seed}")
        return content_digest(cls.__name__, cls.instance(cls._new_game(cls.game_options(task.params), rng)))

    return fingerprint


class _FirstGameGuessTheNumber(GuessTheNumberEnv):
    """GuessTheNumber as it was (default params)."""

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        return _old_textarena(GuessTheNumberEnv)(task)


@pytest.mark.parametrize("cls, params", [
    (GuessTheNumberEnv, {}), (GuessTheNumberEnv, {"max_number": 10}), (MastermindEnv, {}),
    (MastermindEnv, {"code_length": 2}), (LightsOutEnv, {"size": 3}),
])
def test_textarena_instances_were_shared_by_the_splits_and_no_longer_are(cls: type, params: dict) -> None:
    """Drawn from seeds alone, all 20 default secret numbers, 70 of 241 default codes and 52 of 277 3x3 grids
    were in both splits' first 200 tasks."""
    assert _shared(_old_textarena(cls), cls, 200, params) > 5
    assert _shared(cls.task_fingerprint, cls, 200, params) == 0
    _assert_train_tasks_kept(cls, _old_textarena(cls), params)


def test_the_clause_catches_guess_the_number_split_by_seed() -> None:
    with pytest.raises(EnvCheckError, match="has the content of train task"):
        check_split_disjoint(_FirstGameGuessTheNumber, samples=200)


def test_a_test_secret_stays_a_test_secret_at_every_range() -> None:
    """The split of secrets leaves the range out, so training at one max_number never shows a test secret of
    another; the smallest range (10) has secrets of both splits, so every larger one does."""
    owners = {content_split(content_digest("GuessTheNumberEnv", (n,))) for n in range(1, 11)}
    assert owners == {"train", "test"}

    def secret(split: str, index: int, max_number: int) -> int:
        task = GuessTheNumberEnv.resolve_task(index, split, index, {"max_number": max_number})
        return GuessTheNumberEnv.draw_game(task)[0].game_number

    train = {secret("train", i, 1000) for i in range(100)}
    test = {secret("test", i, 20) for i in range(100)}
    assert not train & test and len(test) >= 3


def test_a_code_space_too_small_for_two_splits_says_so() -> None:
    """Mastermind's 6 codes of 3 different digits from 1..3 are all train codes: there is no test task."""
    params = {"code_length": 3, "num_numbers": 3}
    MastermindEnv().reset(MastermindEnv.resolve_task(0, "train", 0, params))
    with pytest.raises(EnvServiceError, match=r"Mastermind with params.code_length=3, params.num_numbers=3, "
                                              r"params.duplicates=false \(6 possible codes\) has no test task"):
        MastermindEnv().reset(MastermindEnv.resolve_task(0, "test", 0, params))


_SMALL_LEVELS = ["BabyAI-OpenRedDoor-v0", "BabyAI-GoToRedBallNoDists-v0"]
"""The levels with fewest layouts (OpenRedDoor has 105 in all)."""


class _SmallBabyAI(BabyAIEnv):
    splits = {"train": _SMALL_LEVELS, "test": _SMALL_LEVELS}


class _OffsetSeedBabyAI(_SmallBabyAI):
    """BabyAI as it was: the layout of seed + 2**31 for a test task, whatever split it belongs to."""

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        env = _level_env(task.name)
        with contextlib.redirect_stdout(io.StringIO()):  # minigrid prints its rejected samples
            env.reset(seed=task.seed + (TEST_SEED_OFFSET if task.split == "test" else 0))
        return layout_fingerprint(env)


_LEVEL_ENVS: dict[str, Any] = {}


def _level_env(gym_id: str) -> Any:
    """One Gymnasium env per id for this module's fingerprints of the old generators."""
    if gym_id not in _LEVEL_ENVS:
        _LEVEL_ENVS[gym_id] = gym.make(gym_id).unwrapped
    return _LEVEL_ENVS[gym_id]


def test_babyai_layouts_were_shared_by_the_splits_and_no_longer_are() -> None:
    with pytest.raises(EnvCheckError, match="has the content of train task"):
        check_split_disjoint(_OffsetSeedBabyAI, samples=100)
    with contextlib.redirect_stdout(io.StringIO()):
        assert check_split_disjoint(_SmallBabyAI, samples=100)
        env = BabyAIEnv()  # the episode plays the layout its fingerprint names
        for split in ("train", "test"):
            task = BabyAIEnv.resolve_task(8, split, 3, {})
            _, info = env.reset(task)
            twin = _level_env(task.name)
            twin.reset(seed=info["layout_seed"])
            assert layout_fingerprint(env._env) == layout_fingerprint(twin) == BabyAIEnv.task_fingerprint(task)


def test_a_babyai_layout_turned_is_the_same_task_and_moved_is_another() -> None:
    env = _level_env("BabyAI-GoToRedBallNoDists-v0")
    with contextlib.redirect_stdout(io.StringIO()):
        env.reset(seed=5)
    start = layout_fingerprint(env)
    env.agent_dir = (env.agent_dir + 1) % 4
    # Regression (#53): the facing was part of the fingerprint, so a test layout one turn from a train layout
    # counted as held-out.
    assert layout_fingerprint(env) == start
    x, y = env.agent_pos
    env.agent_pos = (x + 1 if env.grid.get(x + 1, y) is None else x - 1, y)
    assert layout_fingerprint(env) != start


_TAXI = {"gym_id": "Taxi-v4", "action_names": ["south", "north", "east", "west", "pickup", "dropoff"]}


class _SeedOffsetTaxi(GymnasiumTextEnv.configure({**_TAXI, "splits": {"train": 200, "test": 50}})):
    """Gymnasium games as they were: test task i reset with seed 1 000 000 + i."""

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        env = _level_env("Taxi-v4")
        return content_digest(start_content(env.reset(seed=task.index + (1_000_000 if task.split == "test" else 0))[0]))


def test_gymnasium_test_tasks_were_train_starts_and_now_are_new_ones() -> None:
    with pytest.raises(EnvCheckError, match="has the content of train task"):
        check_split_disjoint(_SeedOffsetTaxi, samples=200)
    taxi = GymnasiumTextEnv.configure({**_TAXI, "splits": {"train": 200, "test": 50}})
    assert check_split_disjoint(taxi, samples=200)
    env = taxi()
    assert env.reset(taxi.resolve_task(7, "train", 0, {}))[1]["reset_seed"] == 7  # train tasks are unchanged
    assert env.reset(taxi.resolve_task(0, "test", 0, {}))[1]["reset_seed"] > 1_000_000
    default = GymnasiumTextEnv.configure(_TAXI)  # 1000 train seeds show 286 of Taxi's 300 starts
    with pytest.raises(EnvServiceError, match=r"Taxi-v4 \(make_kwargs \{\}\) has only 14 start states that no train "
                                              r"task has .*: test task_id must be below 14"):
        default().reset(default.resolve_task(14, "test", 0, {}))


def test_a_gymnasium_game_with_one_start_has_no_held_out_split() -> None:
    lake = GymnasiumTextEnv.configure({"gym_id": "FrozenLake-v1", "make_kwargs": {"map_name": "4x4"},
                                       "action_names": ["left", "down", "right", "up"]})
    assert lake().reset(lake.resolve_task(3, "train", 0, {}))[1]["reset_seed"] == 3
    with pytest.raises(EnvServiceError, match=r"FrozenLake-v1 .* has no start state that no train task has .*: its "
                                              r"test split cannot be held out; give config.splits a train split only"):
        lake().reset(lake.resolve_task(0, "test", 0, {}))


def test_textworld_small_games_were_shared_by_the_splits_and_no_longer_are() -> None:
    """With 1 room, no objects and quest length 1, train game 991 (seed 991) was test game 905 (seed 10 000 905)."""
    small = {"rooms": 1, "objects": 0, "quest_length": 1}
    assert textworld_content(991, 1, 0, 1) == textworld_content(10_000_905, 1, 0, 1)
    train, test = TextWorldEnv.resolve_task(991, "train", 0, small), TextWorldEnv.resolve_task(905, "test", 0, small)
    assert TextWorldEnv.task_fingerprint(train) != TextWorldEnv.task_fingerprint(test)
    assert _shared(TextWorldEnv.task_fingerprint, TextWorldEnv, 8, small) == 0


@pytest.mark.parametrize("env_id, samples", [
    ("alfworld", 100), ("babyai", 50), ("sciworld", 200), ("search", 200), ("sokoban", 200),
    ("textarena-guess-number", 200), ("textarena-lights-out", 200), ("textarena-mastermind", 200),
    ("textcraft", 200), ("textworld", 8),
])
def test_every_offline_env_declares_disjoint_splits(env_id: str, samples: int) -> None:
    with contextlib.redirect_stdout(io.StringIO()):
        assert check_split_disjoint(registry.get(env_id).env_class(), samples) is True
