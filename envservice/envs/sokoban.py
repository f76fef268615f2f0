"""Sokoban with text actions, from a small generator of our own (no gym-sokoban, which needs the old `gym`).

Each room is drawn from the task's split, index and seed (and its `size` and `boxes` params), so the same task and
seed always give the same room. A room belongs to one split by its content (`room_fingerprint`,
`envservice.envs.base.content_split`): a task draws rooms until one is its split's, so no test room is ever a train
room (small rooms repeat: seeds alone gave 257 shared rooms in 1000 tasks per split at size 5). Rooms are solvable
by construction: the generator starts from the solved state (every box on its target) and plays the game backwards,
the player *pulling* boxes away from their targets; replaying those pulls as pushes in reverse order solves the
room, and that push sequence (with the walks between pushes) is kept as `SokobanEnv.solution`, an oracle for tests
and warm-up data.

Rewards follow gym-sokoban: -0.1 per move, +1 when a box goes onto a target, -1 when one leaves it, +10
when every box is on a target (which ends the episode).
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass
from typing import Any, Mapping

from envservice.envs.base import (STATE_KEY, Param, StepResult, Task, TextEnv, clip_text, content_digest,
                                  draw_for_split)
from envservice.errors import EnvServiceError
from envservice.protocol import ErrorCode

ACTIONS = ("up", "down", "left", "right")
"""The text actions, one move of the player each."""

MOVES: dict[str, tuple[int, int]] = {"up": (-1, 0), "down": (1, 0), "left": (0, -1), "right": (0, 1)}
"""(row, column) offset of each action."""

WALL, FLOOR, TARGET, BOX, BOX_ON_TARGET, PLAYER, PLAYER_ON_TARGET = "#", "_", "O", "X", "*", "P", "S"
LEGEND = (f"Legend: {WALL} wall, {FLOOR} floor, {TARGET} target, {BOX} box, {BOX_ON_TARGET} box on a target, "
          f"{PLAYER} you, {PLAYER_ON_TARGET} you standing on a target.")
RULES = ("Push every box onto a target. You move one cell per action and push a box by walking into it; "
         "a box only moves if the cell behind it is free, and boxes cannot be pulled.")

SIZE_RANGE = (5, 12)
"""Side of the square room, outer walls included."""
BOXES_RANGE = (1, 5)
"""Boxes per room (small rooms allow fewer: see `max_boxes`)."""
DEFAULT_SIZE, DEFAULT_BOXES = 7, 2

STEP_REWARD, BOX_ON_REWARD, BOX_OFF_REWARD, SOLVED_REWARD = -0.1, 1.0, -1.0, 10.0
MAX_SOLUTION_MOVES = 120
"""Longest solution a generated room may have, so that the oracle fits well within `max_steps`."""
_ATTEMPTS_PER_LAYOUT = 12
_LAYOUTS = 40

Cell = tuple[int, int]


def max_boxes(size: int) -> int:
    """Most boxes a room of this side may hold: a sixth of its inner cells, within `BOXES_RANGE`.

    Why: a crowded small room leaves no space to pull boxes off their targets, so no puzzle can be made.
    """
    return max(BOXES_RANGE[0], min(BOXES_RANGE[1], (size - 2) ** 2 // 6))


def room_options(params: Mapping[str, Any]) -> tuple[int, int]:
    """(size, boxes) of a create request's params; a value out of range is a `bad_request` naming the field."""
    size = params.get("size", DEFAULT_SIZE)
    boxes = params.get("boxes", DEFAULT_BOXES)
    low, high = SIZE_RANGE
    if not isinstance(size, int) or isinstance(size, bool) or not low <= size <= high:
        raise EnvServiceError(ErrorCode.bad_request,
                              f"params.size={clip_text(repr(size))} must be an integer from {low} to {high}")
    most = max_boxes(size)
    if not isinstance(boxes, int) or isinstance(boxes, bool) or not BOXES_RANGE[0] <= boxes <= most:
        raise EnvServiceError(ErrorCode.bad_request,
                              f"params.boxes={clip_text(repr(boxes))} must be an integer from {BOXES_RANGE[0]} to "
                              f"{most} for size {size} ({BOXES_RANGE[0]} to {BOXES_RANGE[1]} in larger rooms)")
    return size, boxes


@dataclass
class Room:
    """A generated puzzle: the static grid (walls, floor, targets), where boxes and player start, and a solution."""

    walls: frozenset[Cell]
    targets: tuple[Cell, ...]
    boxes: tuple[Cell, ...]
    player: Cell
    size: int
    solution: list[str]


def generate_room(task: Task) -> Room:
    """The room of `task` (same split, index, seed and params: the same room), solvable by construction.

    Rooms are drawn one after the other from one generator seeded by the task; the first room whose content
    belongs to the task's split is its room (the first draw is the room this task had before rooms had splits).
    """
    size, boxes = room_options(task.params)
    # A string seed is hashed with SHA-512 by `random.Random`: stable across processes and Python runs.
    rng = random.Random(f"sokoban:{task.split}:{task.index}:{task.seed}:{size}:{boxes}")
    rooms = (_draw_room(rng, size, boxes) for _ in itertools.count())
    room, _ = draw_for_split(task.split, rooms, room_fingerprint, f"Sokoban with params.size={size}, "
                             f"params.boxes={boxes}")
    return room


def room_fingerprint(room: Room) -> str:
    """What the player faces: walls, targets, boxes and the player's start (the solution is not part of it)."""
    return content_digest("sokoban", sorted(room.walls), sorted(room.targets), sorted(room.boxes), room.player)


def _draw_room(rng: random.Random, size: int, boxes: int) -> Room:
    """One room from `rng`: the first with every box off its target, else the one with most boxes off."""
    best: Room | None = None
    for _ in range(_LAYOUTS):
        walls = _carve_walls(rng, size)
        for _ in range(_ATTEMPTS_PER_LAYOUT):
            room = _reverse_play(rng, walls, size, boxes)
            if room is None:
                continue
            off_target = sum(box not in room.targets for box in room.boxes)
            if off_target == boxes:
                return room
            if best is None or off_target > sum(box not in best.targets for box in best.boxes):
                best = room
    if best is None:  # not reached for the allowed sizes; a clear error beats an unsolvable room
        raise EnvServiceError(ErrorCode.env_error, f"no Sokoban room could be generated for size {size}, "
                                                   f"boxes {boxes}")
    return best


def _carve_walls(rng: random.Random, size: int) -> frozenset[Cell]:
    """The outer wall plus a few inner wall cells, each kept only if the floor stays in one piece."""
    walls = {(r, c) for r in range(size) for c in range(size) if r in (0, size - 1) or c in (0, size - 1)}
    inner = [(r, c) for r in range(1, size - 1) for c in range(1, size - 1)]
    for cell in rng.sample(inner, rng.randint(0, len(inner) // 5)):
        walls.add(cell)
        floor = [other for other in inner if other not in walls]
        if len(_reachable(floor[0], walls, set())) != len(floor):
            walls.discard(cell)
    return frozenset(walls)


def _reverse_play(rng: random.Random, walls: frozenset[Cell], size: int, n_boxes: int) -> Room | None:
    """Put boxes on targets, pull them away for a random number of pulls, and derive the push solution.

    Returns None when the boxes could not be pulled off (a crowded layout) or the solution is too long.
    """
    floor = [(r, c) for r in range(size) for c in range(size) if (r, c) not in walls]
    cells = rng.sample(floor, n_boxes + 1)
    targets, player = tuple(cells[:n_boxes]), cells[n_boxes]
    boxes = set(targets)
    pulls: list[tuple[Cell, str]] = []  # (box cell before the pull, direction the player pulled towards)
    for _ in range(rng.randint(3 * n_boxes, 6 * n_boxes)):
        options = _pull_options(player, boxes, walls)
        if not options:
            break
        box, direction = options[rng.randrange(len(options))]
        dr, dc = MOVES[direction]
        boxes.remove(box)
        boxes.add((box[0] + dr, box[1] + dc))
        player = (box[0] + 2 * dr, box[1] + 2 * dc)
        pulls.append((box, direction))
    if not pulls:
        return None
    # Why a final stroll: without it the player always starts right next to the last box it pulled.
    stroll = sorted(_reachable(player, walls, boxes))
    player = stroll[rng.randrange(len(stroll))]
    solution = _push_solution(player, set(boxes), walls, pulls)
    if solution is None or len(solution) > MAX_SOLUTION_MOVES:
        return None
    return Room(walls=walls, targets=targets, boxes=tuple(sorted(boxes)), player=player, size=size,
                solution=solution)


def _pull_options(player: Cell, boxes: set[Cell], walls: frozenset[Cell]) -> list[tuple[Cell, str]]:
    """Every pull the player can make after walking: (box, direction) with the two cells beyond the box free.

    A pull towards `d` needs the player on `box + d` (reachable without moving boxes) and `box + 2d` free:
    the player steps to `box + 2d` and the box follows to `box + d`.
    """
    reachable = _reachable(player, walls, boxes)
    options = []
    for box in sorted(boxes):
        for direction in ACTIONS:
            dr, dc = MOVES[direction]
            stand, behind = (box[0] + dr, box[1] + dc), (box[0] + 2 * dr, box[1] + 2 * dc)
            if stand in reachable and behind not in walls and behind not in boxes:
                options.append((box, direction))
    return options


def _push_solution(player: Cell, boxes: set[Cell], walls: frozenset[Cell],
                   pulls: list[tuple[Cell, str]]) -> list[str] | None:
    """The forward solution: the pulls undone in reverse order, each a push preceded by a shortest walk.

    A pull of the box at `b` towards `d` is undone by pushing it back from `b + 2d` in direction `-d`.
    """
    opposite = {"up": "down", "down": "up", "left": "right", "right": "left"}
    moves: list[str] = []
    for box, direction in reversed(pulls):
        dr, dc = MOVES[direction]
        start = (box[0] + 2 * dr, box[1] + 2 * dc)
        walk = _walk(player, start, walls, boxes)
        if walk is None:
            return None  # cannot happen for a true reverse play; checked rather than assumed
        moves += walk + [opposite[direction]]
        boxes.remove((box[0] + dr, box[1] + dc))
        boxes.add(box)
        player = (box[0] + dr, box[1] + dc)
    return moves


def _reachable(start: Cell, walls: frozenset[Cell] | set[Cell], boxes: set[Cell]) -> set[Cell]:
    """Cells the player reaches from `start` without pushing a box."""
    seen = {start}
    queue = deque([start])
    while queue:
        r, c = queue.popleft()
        for dr, dc in MOVES.values():
            nxt = (r + dr, c + dc)
            if nxt not in seen and nxt not in walls and nxt not in boxes:
                seen.add(nxt)
                queue.append(nxt)
    return seen


def _walk(start: Cell, goal: Cell, walls: frozenset[Cell], boxes: set[Cell]) -> list[str] | None:
    """A shortest list of moves from `start` to `goal` around walls and boxes (BFS), or None."""
    parents: dict[Cell, tuple[Cell, str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if cell == goal:
            path = []
            while parents[cell] is not None:
                cell, action = parents[cell]
                path.append(action)
            return path[::-1]
        for action in ACTIONS:
            dr, dc = MOVES[action]
            nxt = (cell[0] + dr, cell[1] + dc)
            if nxt not in parents and nxt not in walls and nxt not in boxes:
                parents[nxt] = (cell, action)
                queue.append(nxt)
    return None


def parse_action(action: str) -> str | None:
    """The action word in `action` ('Up ', '[left]', 'RIGHT.' are accepted), or None when it is not one."""
    word = action.strip().strip("[]()<>'\"`.!").strip().lower()
    return word if word in MOVES else None


class SokobanEnv(TextEnv):
    """Push every box onto a target in a generated room; actions: up, down, left, right.

    `solution` holds the generator's solution of the current room (a list of action words), an oracle.
    """

    description = "Sokoban (own generator, solvable by construction): push all boxes onto targets; up/down/left/right."
    splits = {"train": [f"room-{i}" for i in range(1000)], "test": [f"room-{i}" for i in range(200)]}
    params = {
        "size": Param(f"Side of the square room with its outer walls, {SIZE_RANGE[0]}..{SIZE_RANGE[1]} "
                      f"(default {DEFAULT_SIZE}).", int),
        "boxes": Param(f"Number of boxes, {BOXES_RANGE[0]}..{BOXES_RANGE[1]}; rooms of size 5 hold 1, size 6 "
                       f"2, size 7 4 (default {DEFAULT_BOXES}).", int),
    }
    max_steps = 200

    def __init__(self) -> None:
        self.room: Room | None = None
        self.solution: list[str] = []
        self._boxes: set[Cell] = set()
        self._player: Cell = (0, 0)

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        """The task's room (`room_fingerprint`): walls, targets, boxes and where the player starts."""
        return room_fingerprint(generate_room(task))

    @classmethod
    def resolve_task(cls, task_id: int | str | None, split: str, seed: int | None,
                     params: Mapping[str, Any]) -> Task:
        """The base checks, then the ranges of `size` and `boxes` (a bad value fails at create time)."""
        task = super().resolve_task(task_id, split, seed, params)
        room_options(task.params)
        return task

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Generate the task's room and put boxes and player where it starts them."""
        self.room = generate_room(task)
        self.solution = list(self.room.solution)
        self._boxes = set(self.room.boxes)
        self._player = self.room.player
        observation = f"{RULES}\n{LEGEND}\n{self.render()}\n{self._status()}\nActions: {', '.join(ACTIONS)}."
        return observation, {"size": self.room.size, "boxes": len(self.room.targets), STATE_KEY: self._state_key()}

    def step(self, action: str) -> StepResult:
        """Move the player one cell (pushing a box in the way when the cell behind it is free)."""
        direction = parse_action(action)
        if direction is None or self.room is None:
            return (f"Invalid action {clip_text(action)!r}. Valid actions: {', '.join(ACTIONS)}.", 0.0, False, False,
                    {"invalid": True, STATE_KEY: self._state_key()})
        dr, dc = MOVES[direction]
        nxt = (self._player[0] + dr, self._player[1] + dc)
        reward = STEP_REWARD
        if nxt in self.room.walls:
            message = f"You bump into a wall ({direction})."
        elif nxt in self._boxes:
            beyond = (nxt[0] + dr, nxt[1] + dc)
            if beyond in self.room.walls or beyond in self._boxes:
                message = f"The box cannot move {direction}: something is behind it."
            else:
                self._boxes.remove(nxt)
                self._boxes.add(beyond)
                self._player = nxt
                reward += BOX_ON_REWARD * (beyond in self.room.targets) + BOX_OFF_REWARD * (nxt in self.room.targets)
                message = f"You push a box {direction}{self._push_note(nxt, beyond)}."
        else:
            self._player = nxt
            message = f"You move {direction}."
        solved = self._on_targets() == len(self.room.targets)
        if solved:
            reward += SOLVED_REWARD
            message += " Every box is on a target: puzzle solved!"
        return f"{message}\n{self.render()}\n{self._status()}", float(reward), solved, False, {STATE_KEY: self._state_key()}

    def _state_key(self) -> str:
        """Where the player and the boxes are: all that changes in one episode's room (see `STATE_KEY`)."""
        return f"player {self._player} boxes {sorted(self._boxes)}" if self.room is not None else "no room"

    def evaluate(self) -> tuple[float, bool]:
        """(fraction of boxes on targets, whether all are)."""
        if self.room is None:
            return 0.0, False
        on = self._on_targets()
        return on / len(self.room.targets), on == len(self.room.targets)

    def render(self) -> str:
        """The room as text, one row per line (see `LEGEND`)."""
        room = self.room
        rows = []
        for r in range(room.size):
            row = []
            for c in range(room.size):
                cell, target = (r, c), (r, c) in room.targets
                if cell in room.walls:
                    row.append(WALL)
                elif cell == self._player:
                    row.append(PLAYER_ON_TARGET if target else PLAYER)
                elif cell in self._boxes:
                    row.append(BOX_ON_TARGET if target else BOX)
                else:
                    row.append(TARGET if target else FLOOR)
            rows.append("".join(row))
        return "\n".join(rows)

    def _on_targets(self) -> int:
        return sum(target in self._boxes for target in self.room.targets)

    def _status(self) -> str:
        return f"Boxes on targets: {self._on_targets()}/{len(self.room.targets)}."

    def _push_note(self, came_from: Cell, went_to: Cell) -> str:
        onto, off = went_to in self.room.targets, came_from in self.room.targets
        if onto and not off:
            return " onto a target"
        if off and not onto:
            return " off its target"
        return ""
