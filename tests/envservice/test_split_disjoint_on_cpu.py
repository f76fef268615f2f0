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
