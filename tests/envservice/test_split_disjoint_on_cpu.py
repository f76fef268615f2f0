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
import copy  # noqa: E402
import io  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
from collections import defaultdict  # noqa: E402
from typing import Any, Callable  # noqa: E402

import gymnasium as gym  # noqa: E402

from envservice import registry  # noqa: E402
from envservice.envs.babyai import ACTIONS, TEST_SEED_OFFSET, BabyAIEnv, layout_fingerprint  # noqa: E402
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


# The room's symmetries. Built here with minigrid's own `Grid.rotate_left` and a mirror written out cell by cell,
# not with the fingerprint's array transforms, so that a mistake in those cannot hide in the test.

def _unfolded(env: Any) -> str:
    """A layout's content as the fingerprint digested it before #69: grid, agent cell, mission (no symmetry)."""
    grid = env.grid.encode()
    return content_digest("babyai", grid.shape, grid.tobytes(), tuple(int(x) for x in env.agent_pos), env.mission)


def _quarter_turn(grid: Any, pos: tuple[int, int], facing: int) -> tuple[Any, tuple[int, int], int]:
    """The room turned a quarter counter-clockwise: cell (x, y) goes to (y, W-1-x), and so does the facing's
    vector (east (1, 0) becomes north (0, -1): direction d becomes d + 3 mod 4)."""
    return grid.rotate_left(), (pos[1], grid.width - 1 - pos[0]), (facing + 3) % 4


def _mirror(grid: Any, pos: tuple[int, int], facing: int) -> tuple[Any, tuple[int, int], int]:
    """The room mirrored left to right: cell (x, y) goes to (W-1-x, y); east and west swap."""
    from minigrid.core.grid import Grid

    image = Grid(grid.width, grid.height)
    for x in range(grid.width):
        for y in range(grid.height):
            image.set(grid.width - 1 - x, y, grid.get(x, y))
    return image, (grid.width - 1 - pos[0], pos[1]), {0: 2, 2: 0}.get(facing, facing)


def _images(env: Any) -> list[tuple[Any, tuple[int, int], int]]:
    """The 8 images (grid, agent cell, facing) of env's layout: 4 quarter turns, each also mirrored; deep copies,
    so that playing one never moves an object of another."""
    state = (copy.deepcopy(env.grid), (int(env.agent_pos[0]), int(env.agent_pos[1])), int(env.agent_dir))
    images = []
    for _ in range(4):
        images += [state, _mirror(*copy.deepcopy(state))]
        state = _quarter_turn(*copy.deepcopy(state))
    return images


def _install(env: Any, grid: Any, pos: tuple[int, int], facing: int, mission: str) -> None:
    """Put a layout into a freshly reset minigrid env, its mission's verifier re-read from the new grid."""
    env.grid, env.agent_pos, env.agent_dir, env.mission = grid, pos, facing, mission
    env.instrs.reset_verifier(env)


def _swap_sides(text: str) -> str:
    """'left' and 'right' swapped, as sides ('right in front of you' says 'just', not a side)."""
    return re.sub(r"\b(left|right)\b(?! in front)", lambda word: {"left": "right", "right": "left"}[word.group(1)],
                  text)


def _play(env: BabyAIEnv, actions: list[str]) -> list[tuple]:
    """(observation, reward, terminated, truncated) of the first view and of each action, until the episode ends."""
    from envservice.envs.babyai import describe_view

    played = [(describe_view(env._env), 0.0, False, False)]
    for action in actions:
        played.append(env.step(action)[:4])
        if played[-1][2] or played[-1][3]:
            break
    return played


_NO_DISTS = "BabyAI-GoToRedBallNoDists-v0"


def test_a_babyai_layout_rotated_with_the_agent_reads_the_same_and_all_8_images_share_one_fingerprint() -> None:
    """The view is egocentric: the room turned with the agent gives the same text and rewards for every action,
    so it is the same task; mirrored, it is the task with left and right swapped. Regression (#69): the fingerprint
    digested the grid as it lies, so the 8 images had 8 fingerprints and a test layout could be a train layout
    turned (30 of the learning bench's 64 held-out layouts were)."""
    task = BabyAIEnv.resolve_task(_NO_DISTS, "test", 4, {})
    original = BabyAIEnv()
    with contextlib.redirect_stdout(io.StringIO()):
        original.reset(task)
    images = _images(original._env)
    assert len({_unfolded_image(original._env, image) for image in images}) == 8  # no image is the layout itself
    actions = [random.Random(69).choice(ACTIONS[:3]) for _ in range(40)]
    expected = _play(original, actions)
    assert len(expected) > 14  # the random walk plays long enough to compare many views
    for number, image in enumerate(images):
        twin = BabyAIEnv()
        with contextlib.redirect_stdout(io.StringIO()):
            twin.reset(task)
        mirrored = number % 2 == 1
        _install(twin._env, *image, original._env.mission)
        assert layout_fingerprint(twin._env) == BabyAIEnv.task_fingerprint(task)
        if mirrored:  # left and right swap in every view and every turn
            played = _play(twin, [_swap_sides(action) for action in actions])
            assert [(_swap_sides(text), *rest) for text, *rest in played] == expected
        else:
            assert _play(twin, actions) == expected


def _unfolded_image(env: Any, image: tuple) -> str:
    scratch = copy.copy(env)
    scratch.grid, scratch.agent_pos = image[0], image[1]
    return _unfolded(scratch)


def test_a_mirrored_babyai_mission_swaps_left_and_right() -> None:
    """PickupLoc names the side from the agent's start ('the ball on your left'): its mirror image is the layout
    mirrored with the side swapped, the same fingerprint; the mirrored room with the side kept is another task."""
    env = _level_env("BabyAI-PickupLoc-v0")
    with contextlib.redirect_stdout(io.StringIO()):
        seed = next(seed for seed in range(500) if env.reset(seed=seed) and " on your left" in env.mission)
    start, mission = layout_fingerprint(env), env.mission
    grid, pos, facing = _mirror(copy.deepcopy(env.grid), tuple(env.agent_pos), env.agent_dir)
    env.grid, env.agent_pos, env.agent_dir = grid, pos, facing
    env.mission = mission.replace(" on your left", " on your right")
    assert layout_fingerprint(env) == start
    env.mission = mission
    assert layout_fingerprint(env) != start, f"seed {seed}"


def test_no_babyai_test_layout_is_a_train_layout_turned_rotated_or_mirrored() -> None:
    """The learning bench's sets on GoToRedBallNoDists (64 held-out layouts; the RL pool, train 0..479, and the
    warm-up's, train 500..899): no held-out layout has an image that is a train layout. Before #69, 30 had one."""
    with contextlib.redirect_stdout(io.StringIO()):
        train = {_unfolded(_layout(_NO_DISTS, "train", number)) for number in (*range(480), *range(500, 900))}
        shared = 0
        for number in range(64):
            env = _layout(_NO_DISTS, "test", number)
            shared += any(_unfolded_image(env, image) in train for image in _images(env))
    assert shared == 0


def _layout(level: str, split: str, number: int) -> Any:
    """The minigrid env reset to the layout the service plays for (split, task `level`, seed `number`)."""
    env = BabyAIEnv()
    env.reset(BabyAIEnv.resolve_task(level, split, number, {}))
    return env._env


def test_babyai_declares_what_its_fingerprint_folds() -> None:
    folds = " ".join(BabyAIEnv.fingerprint_folds)
    assert "facing" in folds and "rotations" in folds and "mirror" in folds


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
