"""Which evaluated tasks share content with trained ones: the check behind every figure called held-out.

A task's content is its env's `TextEnv.task_fingerprint` (FrozenLake: the map), never its split, index or
seed: seed offsets do not make tasks different (4x4 FrozenLake maps repeat so often that 145 of 200 maps
from disjoint seeds were train maps). A set may be called held-out only when `contamination` finds none of
its tasks in any set a stage trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from envservice import registry


class UnknownContent(ValueError):
    """The env gives no `task_fingerprint`: nothing can tell whether its tasks were seen in training."""


@dataclass(frozen=True)
class TaskSet:
    """Tasks of one env split as `(task index, seed)` pairs, played with `params`; `name` says what the set is
    for (e.g. "warm-up", "rl pool", "held-out")."""

    name: str
    env_id: str
    split: str
    tasks: tuple[tuple[int | str, int], ...]
    """(task, seed) pairs: a task is the split's index or name (what an env's create request takes)."""
    params: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, name: str, env_id: str, split: str, indices: Iterable[int], seed_offset: int = 0,
           params: Mapping[str, Any] | None = None, task_name: str | None = None) -> "TaskSet":
        """The tasks `indices` of `split`, task i played with seed `seed_offset + i` (how recipe data and the
        bench seed their episodes); with `task_name` every task is that one of the split and i only picks its seed
        (one BabyAI level, many layouts)."""
        tasks = tuple((i if task_name is None else task_name, seed_offset + i) for i in indices)
        return cls(name, env_id, split, tasks, dict(params or {}))


def fingerprints(task_set: TaskSet) -> list[str]:
    """The content fingerprint of each task of the set, in order (raises `UnknownContent` when the env has none)."""
    cls = registry.get(task_set.env_id).env_class()
    found = []
    for index, seed in task_set.tasks:
        fingerprint = cls.task_fingerprint(cls.resolve_task(index, task_set.split, seed, task_set.params))
        if fingerprint is None:
            raise UnknownContent(f"env {task_set.env_id!r} gives no task_fingerprint, so whether {task_set.name!r} "
                                 "shares tasks with training cannot be checked: do not call it held-out")
        found.append(fingerprint)
    return found


def folds(env_id: str) -> list[str]:
    """The symmetries the env's fingerprint folds (`TextEnv.fingerprint_folds`): what "the same content" means in
    its counts. Empty: tasks count as one only when the content the fingerprint digests is equal."""
    return list(registry.get(env_id).env_class().fingerprint_folds)


def contamination(evaluated: TaskSet, trained: Sequence[TaskSet]) -> dict[str, Any]:
    """How many tasks of `evaluated` have the content of a task in each of the `trained` sets.

    Returns {"tasks": n, "distinct": distinct contents among them, "shared": {trained set name: count},
    "shared_any": count in any trained set, "folds": {env id: what its fingerprint folds} for every env compared};
    a set is held-out only when "shared_any" is 0.
    """
    evaluated_contents = fingerprints(evaluated)
    shared, seen_anywhere = {}, set()
    for train_set in trained:
        contents = set(fingerprints(train_set))
        hits = [fingerprint for fingerprint in evaluated_contents if fingerprint in contents]
        shared[train_set.name] = len(hits)
        seen_anywhere.update(hits)
    env_ids = dict.fromkeys(task_set.env_id for task_set in (evaluated, *trained))
    return {"tasks": len(evaluated_contents), "distinct": len(set(evaluated_contents)), "shared": shared,
            "shared_any": sum(fingerprint in seen_anywhere for fingerprint in evaluated_contents),
            "folds": {env_id: folds(env_id) for env_id in env_ids}}
