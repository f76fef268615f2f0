"""BabyAI (minigrid) levels with our own text description of the agent's egocentric view.

A task is a level; the seed picks the layout. A layout belongs to one split by its content (`layout_fingerprint`,
`envservice.envs.base.content_split`): an episode tries layout seeds in a fixed order until the layout is its
split's, so no test layout is a train layout (offset seeds alone gave 40 shared layouts in 1000 tasks per split).
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Iterator

import gymnasium as gym
import minigrid  # noqa: F401  (registers the BabyAI levels with gymnasium)
from minigrid.minigrid_env import MiniGridEnv

from envservice.envs.base import STATE_KEY, StepResult, Task, TextEnv
from envservice.envs.base import clip_text, content_digest, draw_for_split

LEVELS = (
    "BabyAI-GoToRedBallNoDists-v0",
    "BabyAI-GoToRedBall-v0",
    "BabyAI-GoToObj-v0",
    "BabyAI-GoToLocal-v0",
    "BabyAI-GoToDoor-v0",
    "BabyAI-PickupLoc-v0",
    "BabyAI-PickupDist-v0",
    "BabyAI-OpenDoor-v0",
    "BabyAI-OpenRedDoor-v0",
    "BabyAI-UnlockLocal-v0",
)
"""The levels served (small single-room levels the BabyAI bot solves)."""

ACTIONS = ("turn left", "turn right", "go forward", "pick up", "drop", "toggle", "done")
"""Text actions in minigrid's action-index order."""

TEST_SEED_OFFSET = 1 << 31
"""Added to the seed of a test-split episode's first layout seed (see `layout_seeds`)."""

_SCRATCH_ENVS: dict[str, MiniGridEnv] = {}
"""One env per level for `BabyAIEnv.task_fingerprint` (a fingerprint needs a reset; making the env is the slow part)."""
_SCRATCH_LOCK = threading.Lock()

_FEEDBACK = {
    "turn left": "You turned left.",
    "turn right": "You turned right.",
    "go forward": "You moved forward.",
    "pick up": "You tried to pick up what is in front of you.",
    "drop": "You tried to drop what you carry.",
    "toggle": "You tried to toggle what is in front of you.",
    "done": "You declared the mission done.",
}


def _steps(n: int, word: str) -> str:
    return f"{n} step{'s' if n != 1 else ''} {word}"


def relative_position(forward: int, right: int) -> str:
    """Words for a cell `forward` cells ahead and `right` cells to the right (negative: left) of the agent."""
    if forward == 1 and right == 0:
        return "right in front of you"
    parts = []
    if forward > 0:
        parts.append(_steps(forward, "forward"))
    if right:
        parts.append(_steps(abs(right), "to the right" if right > 0 else "to the left"))
    return " and ".join(parts) if parts else "at your position"


def _object_name(obj) -> str:
    if obj.type == "door":
        state = "locked" if obj.is_locked else ("open" if obj.is_open else "closed")
        return f"a {state} {obj.color} door"
    return f"a {obj.color} {obj.type}"


def describe_view(env: MiniGridEnv) -> str:
    """Describe what the agent sees: objects with their offsets, the wall ahead, what it carries."""
    grid, visible = env.gen_obs_grid()
    cx, cy = grid.width // 2, grid.height - 1  # the agent's cell in its own view, facing "up"
    seen = []
    for i in range(grid.width):
        for j in range(grid.height):
            obj = grid.get(i, j)
            if (i, j) == (cx, cy) or not visible[i, j] or obj is None or obj.type in ("wall", "floor"):
                continue
            forward, right = cy - j, i - cx
            seen.append((forward + abs(right), f"{_object_name(obj)} {relative_position(forward, right)}"))
    lines = [text for _, text in sorted(seen)] or ["nothing of interest"]
    wall = _wall_ahead(grid, visible, cx, cy)
    carrying = _object_name(env.carrying) if env.carrying else "nothing"
    return "You see: " + "; ".join(lines) + f".\n{wall}\nYou are carrying {carrying}."


def _wall_ahead(grid, visible, cx: int, cy: int) -> str:
    for j in range(cy - 1, -1, -1):
        obj = grid.get(cx, j)
        if not visible[cx, j]:
            break
        if obj is not None and obj.type == "wall":
            distance = cy - j
            return "A wall is right in front of you." if distance == 1 else f"A wall is {distance} steps forward."
    return "No wall in sight straight ahead."


def layout_seeds(task: Task) -> Iterator[int]:
    """The seeds an episode of `task` tries, in order: the seed it always had (test: offset by `TEST_SEED_OFFSET`),
    then seeds derived from (split, seed, attempt)."""
    yield task.seed + (TEST_SEED_OFFSET if task.split == "test" else 0)
    for attempt in itertools.count(1):
        yield int(content_digest("babyai-seed", task.split, task.seed, attempt), 16) % (1 << 63)


def layout_fingerprint(env: MiniGridEnv) -> str:
    """The content of the env's current layout: its grid (walls, doors, objects), where the agent stands, and the
    mission. Not where the agent faces: one turn away from another task's start, a layout that differs only in
    its facing is the same task to an agent (on GoToRedBallNoDists 91 of 200 test layouts were such turns of a
    train layout), so the splits must not share it."""
    grid = env.grid.encode()
    return content_digest("babyai", grid.shape, grid.tobytes(), tuple(int(x) for x in env.agent_pos), env.mission)


def reset_layout(env: MiniGridEnv, task: Task) -> tuple[int, str]:
    """Reset `env` to the layout of `task`: the first of `layout_seeds` whose layout belongs to the task's split.
    Returns (seed, fingerprint)."""

    def reset_and_read(seed: int) -> str:
        env.reset(seed=seed)
        return layout_fingerprint(env)

    # The draw stops right after reading the chosen seed's layout: the env is left reset to it.
    return draw_for_split(task.split, layout_seeds(task), reset_and_read, f"BabyAI level {task.name}")


class BabyAIEnv(TextEnv):
    """A BabyAI level: follow the mission in a grid world, seen through a text description."""

    description = "BabyAI grid-world missions (minigrid) with a text view; actions: " + ", ".join(ACTIONS) + "."
    splits = {"train": list(LEVELS), "test": list(LEVELS)}
    params: dict[str, str] = {}

    def __init__(self) -> None:
        self._env: MiniGridEnv | None = None
        self._level = ""
        self._return = 0.0
        self._success = False

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        """The task's layout (`layout_fingerprint`): grid, agent position and direction, mission."""
        with _SCRATCH_LOCK:
            if task.name not in _SCRATCH_ENVS:
                _SCRATCH_ENVS[task.name] = gym.make(task.name).unwrapped
            return reset_layout(_SCRATCH_ENVS[task.name], task)[1]

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Generate the task's layout (see `reset_layout`); info names the seed it was generated from."""
        if task.name != self._level:
            self.close()
            self._env = gym.make(task.name).unwrapped
            self._level = task.name
        seed, _ = reset_layout(self._env, task)
        self._return, self._success = 0.0, False
        intro = f"Mission: {self._env.mission}.\nActions: {', '.join(ACTIONS)}."
        info = {"level": task.name, "mission": self._env.mission, "layout_seed": seed, STATE_KEY: self._state_key()}
        return f"{intro}\n{describe_view(self._env)}", info

    def step(self, action: str) -> StepResult:
        """Apply one text action; an unknown one is answered with the list of valid actions."""
        name = " ".join(action.strip().lower().rstrip(".").split())
        if name not in ACTIONS:
            return (f"Invalid action {clip_text(action)!r}. Valid actions: {', '.join(ACTIONS)}.", 0.0, False, False,
                    {"invalid": True, STATE_KEY: self._state_key()})
        _, reward, terminated, truncated, _ = self._env.step(ACTIONS.index(name))
        self._return += float(reward)
        self._success = self._success or bool(terminated and reward > 0)
        feedback = "Mission complete!" if self._success else _FEEDBACK[name]
        return (f"{feedback}\n{describe_view(self._env)}", float(reward), bool(terminated), bool(truncated),
                {STATE_KEY: self._state_key()})

    def _state_key(self) -> str:
        """The grid (doors opened, objects moved), the agent's cell and facing, and what it carries (see
        `STATE_KEY`); the view text is a function of these."""
        env = self._env
        grid = env.grid.encode()
        carrying = (env.carrying.type, env.carrying.color) if env.carrying is not None else None
        return content_digest("babyai-state", grid.tobytes(), tuple(int(x) for x in env.agent_pos),
                              int(env.agent_dir), carrying)

    def evaluate(self) -> tuple[float, bool]:
        """Score: minigrid's success reward (1 - 0.9 * steps / max_steps), 0 without success."""
        return (min(1.0, self._return) if self._success else 0.0), self._success

    def close(self) -> None:
        """Close the minigrid env."""
        if self._env is not None:
            self._env.close()
            self._env = None
            self._level = ""
