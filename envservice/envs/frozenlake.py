"""FrozenLake (gymnasium) with text actions; each task is one procedurally generated map."""

from __future__ import annotations

import random
from collections import deque
from functools import lru_cache
from typing import Any

import gymnasium as gym
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from envservice.envs.base import STATE_KEY, Param, StepResult, Task, TextEnv
from envservice.envs.base import clip_text, content_digest, unseen_seeds
from envservice.errors import EnvServiceError
from envservice.protocol import ErrorCode

ACTIONS = ("left", "down", "right", "up")
"""Text actions in gymnasium's action-index order."""

_MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}
TRAIN_MAPS = 1000
"""Maps of the train split: train map i is `generate_random_map(seed=i)` (unchanged since the first release)."""
TEST_MAPS = 200
"""Maps of the test split, each a map no train task has (see `test_map_seeds`)."""
TEST_FIRST_SEED = 1_000_000
_TEST_SEED_SCAN = 20_000
"""Generator seeds scanned for test maps at most: small sizes run out of new maps (3x3 has about 50 in all)."""
_LEGEND = "Legend: S start, F frozen (safe), H hole (falling in ends the episode), G goal, A you."


def _random_map(size: int, seed: int) -> list[str]:
    return generate_random_map(size=size, p=0.8, seed=seed)


@lru_cache(maxsize=None)
def train_maps(size: int) -> frozenset[tuple[str, ...]]:
    """Every map of the train split at this size."""
    return frozenset(tuple(_random_map(size, seed)) for seed in range(TRAIN_MAPS))


@lru_cache(maxsize=None)
def test_map_seeds(size: int) -> tuple[int, ...]:
    """Generator seeds of the test maps: from `TEST_FIRST_SEED` on, each seed whose map is in no train task and
    differs from every earlier test map (at most `TEST_MAPS`).

    Why: 4x4 maps repeat a lot, so disjoint seeds are not disjoint maps (seeds 1 000 000.. gave 145 of 200 test
    maps that were train maps); a test map must be one no train task shows.
    """
    return tuple(unseen_seeds(lambda seed: tuple(_random_map(size, seed)), set(train_maps(size)), TEST_FIRST_SEED,
                              TEST_MAPS, _TEST_SEED_SCAN))


def generate_map(task: Task) -> list[str]:
    """The map of a task: rows of 'S', 'F', 'H', 'G'. Test maps are never train maps (see `test_map_seeds`)."""
    size = int(task.params.get("size", 4))
    if task.split == "train":
        return _random_map(size, task.index)
    seeds = test_map_seeds(size)
    if task.index >= len(seeds):
        raise EnvServiceError(ErrorCode.unknown_task, f"params.size={size} has only {len(seeds)} maps that no train "
                              f"task has: test task_id must be below {len(seeds)} at this size")
    return _random_map(size, seeds[task.index])


def shortest_path_actions(desc: list[str], rng: random.Random | None = None) -> list[str]:
    """A shortest safe action sequence from S to G found by BFS (an oracle for tests and warm-up data).

    Without `rng` it is always the same path (each cell's first BFS discoverer, moves tried left, down, right, up).
    With `rng`, wherever two shortest paths part, which one is taken is drawn from `rng`. Why: warm-up data from
    the fixed path teaches one habit (`down` wherever `down` and `right` are both shortest) even where both moves are
    as good, so the warm-up is sure of itself exactly where RL could learn something. (Measured on 6x6: trained on
    random ties, the tiny model's warm-up stopped reading the map; docs/benchmarks.md.)
    """
    size = len(desc)
    start = next((r, c) for r in range(size) for c in range(size) if desc[r][c] == "S")
    depth = {start: 0}
    arrivals: dict[tuple[int, int], list[tuple[tuple[int, int], str]]] = {start: []}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if desc[cell[0]][cell[1]] == "G":
            return _unwind(arrivals, cell, rng)
        for action, (dr, dc) in _MOVES.items():
            nxt = (cell[0] + dr, cell[1] + dc)
            if not (0 <= nxt[0] < size and 0 <= nxt[1] < size) or desc[nxt[0]][nxt[1]] == "H":
                continue
            if nxt not in depth:
                depth[nxt] = depth[cell] + 1
                arrivals[nxt] = []
                queue.append(nxt)
            if depth[nxt] == depth[cell] + 1:  # every shortest way into `nxt`, in discovery order
                arrivals[nxt].append((cell, action))
    raise ValueError("the map has no safe path from S to G")


def _unwind(arrivals: dict, cell: tuple[int, int], rng: random.Random | None) -> list[str]:
    """Walk back from `cell` to S through shortest arrivals: the first one, or one drawn from `rng`."""
    actions = []
    while arrivals[cell]:
        cell, action = rng.choice(arrivals[cell]) if rng is not None else arrivals[cell][0]
        actions.append(action)
    return actions[::-1]


class FrozenLakeEnv(TextEnv):
    """Cross a frozen lake from S to G without falling into a hole; actions: left, down, right, up."""

    description = "FrozenLake grid world (gymnasium): walk from S to G avoiding holes; actions left/down/right/up."
    splits = {"train": [f"map-{i}" for i in range(TRAIN_MAPS)], "test": [f"map-{i}" for i in range(TEST_MAPS)]}
    params = {
        "size": Param("Side of the square map, 3..12 (default 4).", int),
        "slippery": Param("Whether moves may slip sideways (default false).", bool),
        "around": Param("Also name the four cells next to the agent after the map, e.g. `Around you: left F, "
                        "down H, right F, up #.` (# is the edge; default false).", bool),
    }

    def __init__(self) -> None:
        self._env: gym.Env | None = None
        self._desc: list[str] = []
        self._state = 0
        self._reward = 0.0
        self._around = False

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        """The map (slippery or not, shown with or without the `around` line: the same lake)."""
        cls._check_size(task)
        return content_digest("frozenlake", generate_map(task))

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Build the task's map and put the agent on S."""
        self._check_size(task)
        self.close()
        self._desc = generate_map(task)
        self._env = gym.make(
            "FrozenLake-v1", desc=self._desc, is_slippery=bool(task.params.get("slippery", False)), render_mode="ansi"
        )
        self._state, _ = self._env.reset(seed=task.seed)
        self._reward = 0.0
        self._around = bool(task.params.get("around", False))
        return (f"{_LEGEND}\n{self._render()}\nActions: {', '.join(ACTIONS)}.",
                {"map": list(self._desc), STATE_KEY: self._state_key()})

    def step(self, action: str) -> StepResult:
        """Move one cell; an unknown action leaves the agent where it is and says which actions exist."""
        name = action.strip().lower().rstrip(".")
        if name not in ACTIONS:
            return (f"Invalid action {clip_text(action)!r}. Valid actions: {', '.join(ACTIONS)}.", 0.0, False, False,
                    {"invalid": True, STATE_KEY: self._state_key()})
        self._state, reward, terminated, truncated, _ = self._env.step(ACTIONS.index(name))
        self._reward += float(reward)
        outcome = self._outcome(terminated)
        return (f"{outcome}\n{self._render()}", float(reward), bool(terminated), bool(truncated),
                {STATE_KEY: self._state_key()})

    def gold_actions(self) -> list[str]:
        """A shortest path from S to G (every generated map has one); on a slippery lake it may not arrive."""
        return shortest_path_actions(self._desc)

    def evaluate(self) -> tuple[float, bool]:
        """Score 1 when the goal was reached, else 0."""
        success = self._reward > 0
        return (1.0 if success else 0.0), success

    def close(self) -> None:
        """Close the gymnasium env."""
        if self._env is not None:
            self._env.close()
            self._env = None

    def _state_key(self) -> str:
        """The agent's cell: all that changes in one episode's lake (see `STATE_KEY`)."""
        return f"cell {int(self._state)}"

    def _render(self) -> str:
        size = len(self._desc)
        row, col = divmod(int(self._state), size)
        rows = [list(line) for line in self._desc]
        rows[row][col] = "A"
        grid = "\n".join("".join(line) for line in rows)
        return f"{grid}\n{self._around_text(row, col)}" if self._around else grid

    def _around_text(self, row: int, col: int) -> str:
        # Why: in the grid, the cell below the agent sits a map-dependent number of tokens back; this line
        # puts each neighbour at the same place at the end of every observation, which a small model can read.
        size = len(self._desc)
        cells = []
        for action in ACTIONS:
            r, c = row + _MOVES[action][0], col + _MOVES[action][1]
            cells.append(f"{action} {self._desc[r][c] if 0 <= r < size and 0 <= c < size else '#'}")
        return f"Around you: {', '.join(cells)}."

    def _outcome(self, terminated: bool) -> str:
        if not terminated:
            return "You moved."
        return "You reached the goal!" if self._reward > 0 else "You fell into a hole."

    @staticmethod
    def _check_size(task: Task) -> None:
        size = task.params.get("size", 4)
        if not isinstance(size, int) or not 3 <= size <= 12:
            raise EnvServiceError(ErrorCode.bad_request, f"params.size={size!r} must be an integer from 3 to 12")
