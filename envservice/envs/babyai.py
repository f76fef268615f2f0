"""BabyAI (minigrid) levels with our own text description of the agent's egocentric view.

A task is a level; the seed picks the layout. A layout belongs to one split by its content up to the room's
symmetries (`layout_fingerprint`, `envservice.envs.base.content_split`): an episode tries layout seeds in a fixed
order until the layout is its split's, so no test layout is a train layout, nor one turned, rotated or mirrored
(offset seeds alone gave 40 shared layouts in 1000 tasks per split; content without the symmetries left 30 of the
learning bench's 64 held-out GoToRedBallNoDists layouts rotations of a train layout, which play the same text).
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
from typing import Any, Iterator

import gymnasium as gym
import minigrid  # noqa: F401  (registers the BabyAI levels with gymnasium)
import numpy as np
from minigrid.envs.babyai.core import roomgrid_level
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

logger = logging.getLogger(__name__)


def _log_generator_line(*parts: object, **_print_kwargs: object) -> None:
    logger.debug("minigrid level generator: %s", " ".join(map(str, parts)))


# Why: minigrid's level generator `print`s every rejected draw ("Sampling rejected: unreachable object at ...")
# to stdout, hundreds per batch of resets, flooding the service's and a training run's console; the lines say
# nothing a user acts on, so they go to this module's debug log (one module-level name, thread-safe, unlike
# swapping sys.stdout around a reset).
roomgrid_level.print = _log_generator_line

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


FINGERPRINT_FOLDS = (
    "the agent's facing: a layout one turn from another is one action away from it",
    "the room's 4 rotations, the agent's cell moved with the grid: the egocentric view reads the same text after "
    "every action (its facing turned along)",
    "the room's 4 mirror images, with 'left' and 'right' swapped in the mission: the same task with left and right "
    "swapped in every view and action (a conservative fold: the text tells them apart)",
)
"""What `layout_fingerprint` folds (`TextEnv.fingerprint_folds`). Missions that name a place relative to the start
facing ('the door on your left', PickupLoc's and OpenDoor's) fold conservatively: with the facing left out, two
layouts whose missions point at different objects may share a fingerprint (the same split, never two)."""

_SIDE = re.compile(r"\b(left|right)\b")


def mirrored_mission(mission: str) -> str:
    """The mission of a mirrored room: 'left' and 'right' swapped (what was on the agent's left is on its right)."""
    return _SIDE.sub(lambda word: "right" if word.group(1) == "left" else "left", mission)


def layout_images(grid: np.ndarray, agent_pos: tuple[int, int], mission: str
                  ) -> Iterator[tuple[np.ndarray, tuple[int, int], str]]:
    """The 8 images of a layout under the room's symmetries: (encoded grid, the agent's cell, mission) for each
    rotation by a quarter turn, then each of those mirrored. The agent's cell is carried through the same array
    transform as the grid (a marker plane), so grid and cell never disagree, square room or not."""
    marker = np.zeros(grid.shape[:2], dtype=np.uint8)
    marker[agent_pos] = 1
    for quarter_turns in range(4):
        turned, turned_marker = np.rot90(grid, quarter_turns, axes=(0, 1)), np.rot90(marker, quarter_turns)
        for mirrored in (False, True):
            image, image_marker = (turned[::-1], turned_marker[::-1]) if mirrored else (turned, turned_marker)
            cell = tuple(int(v) for v in np.argwhere(image_marker)[0])
            yield np.ascontiguousarray(image), cell, mirrored_mission(mission) if mirrored else mission


def layout_digest(grid: np.ndarray, agent_pos: tuple[int, int], mission: str) -> str:
    """One image's content: the encoded grid (walls, doors and their state, objects), the agent's cell, the
    mission. For the unturned image it is the fingerprint the layouts had before the symmetries were folded."""
    return content_digest("babyai", grid.shape, grid.tobytes(), tuple(agent_pos), mission)


def layout_fingerprint(env: MiniGridEnv) -> str:
    """The content of the env's current layout up to the room's symmetries (`FINGERPRINT_FOLDS`): the least
    `layout_digest` of its 8 images. Why: the view is egocentric, so a layout rotated with the agent reads the same
    text whatever the agent does, and a mirrored one is that task with left and right swapped; the facing is left out
    since a layout one turn from another's start is the same task. Without the rotations 30 of the learning bench's
    64 held-out GoToRedBallNoDists layouts were a train layout rotated (without the facing, 91 of 200 earlier)."""
    cell = (int(env.agent_pos[0]), int(env.agent_pos[1]))
    return min(layout_digest(*image) for image in layout_images(env.grid.encode(), cell, env.mission))


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
    fingerprint_folds = FINGERPRINT_FOLDS

    def __init__(self) -> None:
        self._env: MiniGridEnv | None = None
        self._level = ""
        self._return = 0.0
        self._success = False

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        """The task's layout (`layout_fingerprint`): grid, the agent's cell and the mission, up to the room's
        rotations and mirror images; not the agent's facing."""
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
