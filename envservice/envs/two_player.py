"""Two-player TextArena games (textarena 0.7.4) as service environments: TicTacToe from unseen starting positions,
against a scripted opponent or with both seats played by clients (self-play).

**Seats.** A game has two seats, 0 and 1 (TextArena's player ids). Every create and step answer names, in
`info["seat"]` (`SEAT`), the seat whose turn it is; the observation is that seat's view (TextArena's messages to
that player since its last turn: the opponent's move, the board, the moves it may make), and the next action is
that seat's move. When the game ends, `info["seat_rewards"]` (`SEAT_REWARDS`) holds each seat's outcome,
zero-sum: 1 for a win, -1 for a loss, 0 for both in a draw; the step's own reward is the outcome of the seat that
moved. `evaluate` scores seat 0 (score (outcome + 1) / 2, success on a win); a client playing another seat reads
its outcome from `seat_rewards`.

**Opponents.** `params.opponent` says who plays the seat the client does not: `none` (nobody: the client plays
both seats, one policy per seat, e.g. the same model in self-play), `random` (a free cell drawn from the task's
seed), `first` (the lowest free cell) or `perfect` (minimax: never loses). With an opponent, the client plays the
seat to move after the opening, and the env plays the other seat inside `step`, so the client only ever sees its
own turns; `info["opponent"]` names the opponent in every answer.

**Tasks** are starting positions: the board after `params.opening_moves` (0..4, default 3) random moves, drawn
from the task's split, index and seed. A position's content is its board up to the board's 8 symmetries
(rotations and reflections: the same game), so no test position is a train position turned or mirrored.

**Views.** By default a seat sees TextArena's own messages (its rules, each move described, the board drawn with
its free cells numbered). `params.view: compact` shows instead only the seat's mark, the opponent's last move, the
board as three rows of `X`, `O` and `.` and the free cells (~40 tokens of a small tokenizer instead of ~1 000 for
the first view): what a small model on CPU can read (bench/learning_cpu.py).

**Moves** are a cell number 0-8 ('[4]', '4', 'I take [4]'). An answer the game refuses, an occupied cell or text
with no cell in it, is judged by TextArena's own rule: a warning and the same seat moves again; a second refusal
in a row loses the game for that seat. A game a limit cuts before it ends (the client's rounds or tokens) has no
result, and `evaluate` scores it 0, as a loss: scored as a draw, a stalling policy beat one that played and lost
(bench/learning_cpu.py's TicTacToe RL, 2026-11-28: a warm model learnt within 7 steps to answer without a cell
until the round limit, for a score of 0.5 on every game).
"""

from __future__ import annotations

import functools
import itertools
import random
from typing import Any, Mapping

from envservice.envs.base import STATE_KEY, Param, StepResult, Task, TextEnv, clip_text, content_digest, draw_for_split
from envservice.envs.textarena_games import _bracketed_or_whole, _int_param
from envservice.errors import EnvServiceError
from envservice.protocol import ErrorCode

SEAT = "seat"
"""The `info` key naming the seat whose turn it is (an int from 0): the observation is that seat's view, and the
next action is that seat's move. Absent once the game is over."""
SEAT_REWARDS = "seat_rewards"
"""The `info` key of a finished game's outcome per seat, by seat number as text: {"0": 1.0, "1": -1.0}."""
FORFEIT_REWARD = "forfeit_reward"
"""The `info` key by which an env declares, in its create answer, what a game or episode a limit cuts is worth to the
player it stopped (the trainer credits it to that player's last turn: beyond_agent/rollout/episode_loop.py). Here
-1, a loss: a cut game scores as lost (see the module docstring), in one-player mode too."""
CUT_FORFEIT = -1.0
"""This env's declared forfeit (`FORFEIT_REWARD`): a loss."""
OPPONENTS = ("none", "random", "first", "perfect")
"""Who plays the seat the client does not (module docstring)."""
NO_MOVE = "(no cell named)"
"""What the game is told when a client's answer names no cell: TextArena's TicTacToe refuses it as out of format."""
VIEWS = ("textarena", "compact")
"""What a seat sees (module docstring)."""

Board = tuple[str, ...]
"""Nine cells, row by row: "X", "O" or "" (free)."""

_LINES = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (0, 3, 6), (1, 4, 7), (2, 5, 8), (0, 4, 8), (2, 4, 6))
_SYMMETRIES = (
    (0, 1, 2, 3, 4, 5, 6, 7, 8), (6, 3, 0, 7, 4, 1, 8, 5, 2), (8, 7, 6, 5, 4, 3, 2, 1, 0),
    (2, 5, 8, 1, 4, 7, 0, 3, 6), (2, 1, 0, 5, 4, 3, 8, 7, 6), (6, 7, 8, 3, 4, 5, 0, 1, 2),
    (0, 3, 6, 1, 4, 7, 2, 5, 8), (8, 5, 2, 7, 4, 1, 6, 3, 0),
)
"""The board's 8 symmetries as cell permutations: new cell i holds old cell p[i] (turns by 0/90/180/270 degrees,
then the four mirror images)."""


def canonical(board: Board) -> Board:
    """The least of the board's 8 symmetric images: one representative per position up to turning and mirroring."""
    return min(tuple(board[i] for i in permutation) for permutation in _SYMMETRIES)


def winner(board: Board) -> str:
    """"X" or "O" when that mark holds a line, else ""."""
    for a, b, c in _LINES:
        if board[a] and board[a] == board[b] == board[c]:
            return board[a]
    return ""


def free_cells(board: Board) -> list[int]:
    """The free cells, lowest first."""
    return [cell for cell, mark in enumerate(board) if not mark]


@functools.lru_cache(maxsize=None)
def minimax_value(board: Board, mark: str) -> int:
    """The value for `mark`, to move on `board`, of perfect play by both: 1 win, 0 draw, -1 loss."""
    other = "O" if mark == "X" else "X"
    if winner(board):
        return -1  # the previous mover (`other`) completed a line
    cells = free_cells(board)
    if not cells:
        return 0
    return max(-minimax_value(board[:cell] + (mark,) + board[cell + 1:], other) for cell in cells)


def perfect_move(board: Board, mark: str) -> int:
    """The lowest cell among those of best minimax value for `mark` (deterministic)."""
    other = "O" if mark == "X" else "X"
    return max(free_cells(board), key=lambda cell: (-minimax_value(board[:cell] + (mark,) + board[cell + 1:], other),
                                                    -cell))


class TicTacToeEnv(TextEnv):
    """TextArena TicTacToe for two seats, from a starting position, against an opponent or self-play (module
    docstring)."""

    description = ("TextArena TicTacToe for two seats from unseen starting positions: against a scripted opponent "
                   "(random, first, perfect) or both seats played by clients (self-play); move: [cell 0-8].")
    splits = {"train": [f"position-{i}" for i in range(1000)], "test": [f"position-{i}" for i in range(200)]}
    params = {
        "opponent": Param(f"Who plays the other seat: one of {', '.join(OPPONENTS)} (default random).", str),
        "opening_moves": Param("Random moves made before the first turn, 0..4 (default 3).", int),
        "view": Param(f"What a seat sees: one of {', '.join(VIEWS)} (default textarena).", str),
    }
    max_steps = 40

    def __init__(self) -> None:
        """An instance without a game; `reset` starts one."""
        self.game: Any = None
        self.opponent, self.view = "random", "textarena"
        self._rng = random.Random(0)
        self._client_seat = 0
        self._last_move: dict[int, int] = {}
        """Seat -> the cell of its last move (the compact view names the opponent's)."""

    @staticmethod
    def view_of(params: Mapping[str, Any]) -> str:
        """`params.view`, one of `VIEWS`."""
        return _choice(params, "view", "textarena", VIEWS, "a view")

    @staticmethod
    def opponent_of(params: Mapping[str, Any]) -> str:
        """`params.opponent`, one of `OPPONENTS`."""
        return _choice(params, "opponent", "random", OPPONENTS, "an opponent")

    @classmethod
    def resolve_task(cls, task_id: int | str | None, split: str, seed: int | None,
                     params: Mapping[str, Any]) -> Task:
        """The base checks, then the params (a bad value fails at create time)."""
        task = super().resolve_task(task_id, split, seed, params)
        cls.opponent_of(task.params)
        cls.view_of(task.params)
        _int_param(task.params, "opening_moves", 3, 0, 4)
        return task

    @classmethod
    def opening(cls, task: Task) -> tuple[tuple[int, ...], str]:
        """(the opening's cells in the order played, its fingerprint): the first of a seeded series of random
        openings whose position belongs to the task's split."""
        moves = _int_param(task.params, "opening_moves", 3, 0, 4)
        rng = random.Random(f"tictactoe:{task.split}:{task.index}:{task.seed}")
        openings = (tuple(rng.sample(range(9), moves)) for _ in itertools.count())
        return draw_for_split(task.split, openings,
                              lambda cells: content_digest("tictactoe", canonical(_board_after(cells))),
                              f"TicTacToe with params.opening_moves={moves}")

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        """The starting position up to the board's symmetries."""
        return cls.opening(task)[1]

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """A game from the task's starting position; the observation is the seat to move's view."""
        from textarena.envs.TicTacToe.env import TicTacToeEnv as Game

        self.opponent, self.view = self.opponent_of(task.params), self.view_of(task.params)
        self._last_move = {}
        self._rng = random.Random(f"tictactoe-opponent:{task.split}:{task.index}:{task.seed}")
        self.game = Game()
        self.game.reset(num_players=2)
        for cell in self.opening(task)[0]:
            self.game.step(f"[{cell}]")
        self._client_seat = self.seat_to_move()
        # A cut game is lost (module docstring): declared, so that a client need not infer it from the seat key.
        return self._observation(), {**self._info(), FORFEIT_REWARD: CUT_FORFEIT}

    def step(self, action: str) -> StepResult:
        """The move of the seat to move; with an opponent, then the opponent's reply (module docstring)."""
        if self.game is None or self.game.state.done:
            return "The game is over; reset to play again.", 0.0, True, False, {"invalid": True}
        move = _bracketed_or_whole(action, r"\d")
        mover, before = self.seat_to_move(), self.board()
        if move is None:  # no cell: the game's own rule judges it, as an answer out of format (warned, then lost)
            self.game.step(NO_MOVE)
        else:
            self._play(mover, int(move.group(1)))
        refused = self.board() == before and not self.game.state.done  # TextArena's warning: the seat moves again
        while self.opponent != "none" and not self.game.state.done and self.seat_to_move() != self._client_seat:
            self.game.get_observation()  # the opponent's view: the scripted player reads the board instead
            self._play(self.seat_to_move(), self._opponent_move())
        if not self.game.state.done:
            return self._observation(), 0.0, False, False, {**self._info(), **({"invalid": True} if refused else {})}
        outcome = {str(seat): float(reward) for seat, reward in sorted(self.game.state.rewards.items())}
        reason = self.game.state.game_info[mover].get("reason") or "the game ended"
        info = {STATE_KEY: self.state_key, SEAT_REWARDS: outcome, "opponent": self.opponent,
                "invalid_move": bool(self.game.state.game_info[mover].get("invalid_move", False))}
        ended = self._observation(seat=self._client_seat if self.opponent != "none" else mover)
        return f"{ended}\nGame over: {reason}".strip(), outcome[str(mover)], True, False, info

    def evaluate(self) -> tuple[float, bool]:
        """Seat 0's outcome as a score: (outcome + 1) / 2 (0.5 for a draw, 0 for a game that did not end); success
        on a win. With an opponent, the client's seat instead."""
        if self.game is None or not self.game.state.done:  # a limit cut it: no result (not a draw, see above)
            return 0.0, False
        seat = self._client_seat if self.opponent != "none" else 0
        outcome = float(self.game.state.rewards[seat])
        return (outcome + 1) / 2, outcome == 1

    def close(self) -> None:
        """Drop the game."""
        self.game = None

    # ---- the board ---------------------------------------------------------------------------------

    def seat_to_move(self) -> int:
        """TextArena's current player."""
        return int(self.game.state.current_player_id)

    def board(self) -> Board:
        """The nine cells, row by row."""
        return tuple(mark for row in self.game.state.game_state["board"] for mark in row)

    @property
    def state_key(self) -> str:
        """The board and the seat to move (`STATE_KEY`); a refused action leaves both as they were."""
        return content_digest("tictactoe-state", self.board(), None if self.game.state.done else self.seat_to_move())

    def _opponent_move(self) -> int:
        board, mark = self.board(), _mark_of(self.seat_to_move())
        if self.opponent == "random":
            return self._rng.choice(free_cells(board))
        if self.opponent == "first":
            return free_cells(board)[0]
        return perfect_move(board, mark)

    def _play(self, seat: int, cell: int) -> None:
        """`seat` moves to `cell` in TextArena's game (which judges it)."""
        before = self.board()
        self.game.step(f"[{cell}]")
        if self.board() != before:
            self._last_move[seat] = cell

    def _observation(self, seat: int | None = None) -> str:
        """The messages to the seat to move since its last turn, without the echo of raw actions; or the compact
        view (module docstring) of `seat` (default: the seat to move)."""
        to_move, messages = self.game.get_observation()
        seat = to_move if seat is None else seat
        if self.view == "textarena":
            return "\n".join(text for _, text, kind in messages if kind.name != "PLAYER_ACTION")
        refusal = next((text for _, text, _ in messages if "attempted an invalid move" in text), None)
        board = self.board()
        rows = "\n".join("".join(mark or "." for mark in board[row:row + 3]) for row in (0, 3, 6))
        opponent = self._last_move.get(1 - seat)
        lines = [f"You are {_mark_of(seat)}." + (f" The opponent took cell {opponent}." if opponent is not None else ""),
                 *([f"Your last answer was refused: {_refusal_reason(refusal)} Once more and you lose."]
                   if refusal else []),
                 f"Board (cells 0-8, row by row):\n{rows}",
                 f"Free cells: {' '.join(map(str, free_cells(board)))}. Answer with one, e.g. [{free_cells(board)[0]}]."
                 if free_cells(board) else "The board is full."]
        return "\n".join(lines)

    def _info(self) -> dict[str, Any]:
        return {SEAT: self.seat_to_move(), STATE_KEY: self.state_key, "opponent": self.opponent}


def _choice(params: Mapping[str, Any], name: str, default: str, choices: tuple[str, ...], what: str) -> str:
    """`params[name]` (or `default`), which must be one of `choices` (a `bad_request` naming them otherwise)."""
    value = params.get(name, default)
    if value not in choices:
        raise EnvServiceError(ErrorCode.bad_request, f"params.{name}={clip_text(repr(value))} is not {what}; valid "
                              f"choices: {list(choices)}", valid_choices=list(choices))
    return value


def _refusal_reason(message: str) -> str:
    """Why TextArena refused the last answer, from its message ('... Reason: cell 4 is already occupied. ...'):
    TicTacToe refuses an occupied cell, or an answer out of format."""
    return "that cell is taken." if "is already occupied" in message else "it named no free cell."


def _mark_of(seat: int) -> str:
    """TextArena's TicTacToe gives player 1 'X' and player 0 'O'."""
    return "X" if seat == 1 else "O"


def _board_after(cells: tuple[int, ...]) -> Board:
    """The board after `cells` were played in turn from player 0."""
    board = [""] * 9
    for turn, cell in enumerate(cells):
        board[cell] = _mark_of(turn % 2)
    return tuple(board)
