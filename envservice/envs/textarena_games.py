"""Single-player TextArena games (textarena 0.7.4) as service environments, fully offline.

Three games, one class each on a shared wrapper (`TextArenaGameEnv`):
- `GuessTheNumberEnv`: guess a secret number with higher/lower hints;
- `MastermindEnv`: crack a secret code from black/white peg feedback;
- `LightsOutEnv`: switch off a grid of lights where each press toggles a cross of cells.

The wrapper builds the TextArena game itself (not `textarena.make`, whose wrappers keep the whole history: the
service sends each turn's new messages and the agent keeps the conversation). Each observation is what TextArena
shows the player (its prompt, hints, boards and invalid-move notes), plus the outcome when the game ends. An
instance belongs to one split by its content (`TextArenaGameEnv.instance`, `envservice.envs.base.content_split`):
a task redraws until it gets one of its split, so no test instance is a train instance (drawn from seeds alone, all
20 default secret numbers were in both splits). Actions are read leniently ('7', '[7]', 'my guess is [7]') and
passed on in the game's own bracket format; text with no move in it is answered by the wrapper and never reaches
the game. Score and success come from the game's outcome.
"""

from __future__ import annotations

import abc
import importlib
import itertools
import math
import random
import re
import threading
from typing import Any, ClassVar, Mapping

from envservice.envs.base import (STATE_KEY, Param, StepResult, Task, TextEnv, clip_text, content_digest,
                                  draw_for_split)
from envservice.errors import EnvServiceError
from envservice.protocol import ErrorCode

_GAME_RANDOM_LOCK = threading.Lock()
"""Held while a TextArena game draws its instance (see `TextArenaGameEnv._new_game`)."""

_NUMBER = r"\d{1,6}"
"""A number in an action: at most 6 digits (a longer digit run is no move; `int` of 5000 digits would raise)."""


def _int_param(params: Mapping[str, Any], name: str, default: int, low: int, high: int) -> int:
    """`params[name]` (or `default`), which must be an integer from `low` to `high` (a `bad_request` otherwise)."""
    value = params.get(name, default)
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise EnvServiceError(ErrorCode.bad_request,
                              f"params.{name}={clip_text(repr(value))} must be an integer from {low} to {high}")
    return value


class TextArenaGameEnv(TextEnv):
    """A single-player TextArena game; subclasses name the game and say how to read a move and judge the end.

    Subclasses set `game_class_path` ("module:Class"), `move_hint` (the move format, for invalid-action
    observations), and implement `game_options`, `instance`, `normalize_move`, `won` and `progress`.
    """

    game_class_path: ClassVar[str] = ""
    """The TextArena game class, "module:Class"."""
    move_hint: ClassVar[str] = ""
    """How a move is written, e.g. "a number in square brackets, e.g. [10]"."""
    max_steps = 64

    def __init__(self) -> None:
        self.game: Any = None
        self.options: dict[str, Any] = {}
        self._done = False

    @classmethod
    def game_options(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        """Keyword arguments of the game class from a task's params (range-checked: `bad_request`)."""
        return {}

    @classmethod
    @abc.abstractmethod
    def instance(cls, game: Any) -> tuple:
        """What makes a freshly reset game the puzzle it is: its secret or its starting grid.

        Why not the params that bound the draw (`max_number`, `num_numbers`): they only say where the secret was
        drawn from, and leaving them out makes the split of secrets the same at every param value (a test secret
        is never a train secret, whatever params either was played with). `max_turns` only bounds the play.
        """
        ...

    @classmethod
    @abc.abstractmethod
    def content_space(cls, options: Mapping[str, Any]) -> str:
        """The game and the params that fix its instances, for an error that says a split has none."""
        ...

    @abc.abstractmethod
    def normalize_move(self, action: str) -> str | None:
        """The action in the game's canonical format, or None when it holds no move of this game."""
        ...

    @abc.abstractmethod
    def won(self) -> bool:
        """Whether the player won the current game."""
        ...

    @abc.abstractmethod
    def state(self) -> Any:
        """What the player's next move starts from (see `STATE_KEY`): the grid, or the moves made so far, whose
        hints follow from them and the secret."""
        ...

    @property
    def state_key(self) -> str:
        """The digest of `state()` (`STATE_KEY`); a move the game refuses leaves it as it was."""
        return content_digest(f"{type(self).__name__}-state", self.state())

    @abc.abstractmethod
    def progress(self) -> float:
        """Partial credit in [0, 1] of a game not won (the game's own completion measure)."""
        ...

    @classmethod
    def resolve_task(cls, task_id: int | str | None, split: str, seed: int | None,
                     params: Mapping[str, Any]) -> Task:
        """The base checks, then the params' ranges (a bad value fails at create time)."""
        task = super().resolve_task(task_id, split, seed, params)
        cls.game_options(task.params)
        return task

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        """The task's instance (`instance`: the secret number, the secret code or the starting grid)."""
        return cls.draw_game(task)[1]

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Start a new game; its instance (secret number, code, grid) is drawn from the task's split, index and seed."""
        self.options = self.game_options(task.params)
        self.game, _ = self.draw_game(task)
        self._done = False
        return self._messages(), {"game": self.game_class_path.rsplit(":", 1)[1], **self.options,
                                  STATE_KEY: self.state_key}

    @classmethod
    def draw_game(cls, task: Task) -> tuple[Any, str]:
        """(game, fingerprint) of `task`: games are reset one after the other from one generator seeded by the
        task, and the first whose instance belongs to the task's split is its game (the first reset is the
        game this task had before instances had splits)."""
        options = cls.game_options(task.params)
        rng = random.Random(f"{cls.__name__}:{task.split}:{task.index}:{task.seed}")
        games = (cls._new_game(options, rng) for _ in itertools.count())
        return draw_for_split(task.split, games, lambda game: content_digest(cls.__name__, cls.instance(game)),
                              cls.content_space(options))

    @classmethod
    def _new_game(cls, options: Mapping[str, Any], rng: random.Random) -> Any:
        """The game, reset with its module's `random` replaced by `rng` for the time of the reset.

        Why: TextArena games draw their instance from the global `random` module, and seeding it (their own
        `seed=` argument) would reseed every other user of `random` in this process. Passing no seed and
        swapping in a private generator keeps the draw deterministic and the global state untouched; the lock
        keeps two resets of the same game from swapping at once.
        """
        module_name, class_name = cls.game_class_path.split(":")
        module = importlib.import_module(module_name)
        game = getattr(module, class_name)(**options)
        with _GAME_RANDOM_LOCK:
            saved = module.random
            module.random = rng
            try:
                cls._reset_game(game)
            finally:
                module.random = saved
        return game

    @classmethod
    def _reset_game(cls, game: Any) -> None:
        """Reset `game` for one player (a subclass may redraw an instance the game cannot play)."""
        game.reset(num_players=1)

    def step(self, action: str) -> StepResult:
        """Pass a move to the game; text with no move in it is answered here with the move format."""
        if self.game is None or self._done:
            return "The game is over; reset to play again.", 0.0, self._done, False, {"invalid": True}
        move = self.normalize_move(action)
        if move is None:
            return (f"Invalid action {clip_text(action)!r}. Valid actions: {self.move_hint}.", 0.0, False, False,
                    {"invalid": True, STATE_KEY: self.state_key})
        done, _ = self.game.step(move)
        observation = self._messages()
        if not done:
            return observation, 0.0, False, False, {"move": move, STATE_KEY: self.state_key}
        self._done = True
        rewards, game_info = self.game.state.rewards or {0: 0.0}, self.game.state.game_info[0]
        reward = 1.0 if self.won() else float(rewards.get(0, 0.0))
        outcome = f"Game over: {game_info.get('reason', 'the game ended')}"
        return (f"{observation}\n{outcome}".strip(), reward, True, False,
                {"move": move, "invalid_move": bool(game_info.get("invalid_move", False)), STATE_KEY: self.state_key})

    def evaluate(self) -> tuple[float, bool]:
        """(1 when won, else the game's completion measure clipped to [0, 1]; whether the player won)."""
        if self.game is None:
            return 0.0, False
        if self.won():
            return 1.0, True
        return min(1.0, max(0.0, float(self.progress()))), False

    def close(self) -> None:
        """Drop the game (it holds no outside resources)."""
        self.game = None

    def _messages(self) -> str:
        """The game's new messages to the player, without the echo of the player's own action."""
        _, messages = self.game.get_observation()
        return "\n".join(text for sender, text, kind in messages if kind.name != "PLAYER_ACTION")


def _bracketed_or_whole(action: str, inner: str) -> re.Match[str] | None:
    """The first `[inner]` in `action`, else `action` itself when it is just `inner` (brackets optional)."""
    return re.search(rf"\[\s*({inner})\s*\]", action) or re.fullmatch(rf"\s*({inner})\s*\.?\s*", action)


class GuessTheNumberEnv(TextArenaGameEnv):
    """TextArena GuessTheNumber: find a secret number with 'higher'/'lower' hints; a move is '[7]' or '7'."""

    description = "TextArena GuessTheNumber: guess a secret number from higher/lower hints; move: [number]."
    splits = {"train": [f"number-{i}" for i in range(1000)], "test": [f"number-{i}" for i in range(200)]}
    params = {
        "max_number": Param("Largest possible number, 10..1000 (default 20; the smallest is 1).", int),
        "max_turns": Param("Guesses allowed, 1..50 (default 10).", int),
    }
    game_class_path = "textarena.envs.GuessTheNumber.env:GuessTheNumberEnv"
    move_hint = "a number in square brackets, e.g. [10]"

    @classmethod
    def game_options(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        """min_number 1, max_number and max_turns from the params."""
        return {"min_number": 1, "max_number": _int_param(params, "max_number", 20, 10, 1000),
                "max_turns": _int_param(params, "max_turns", 10, 1, 50)}

    @classmethod
    def instance(cls, game: Any) -> tuple:
        """The secret number."""
        return (game.game_number,)

    @classmethod
    def content_space(cls, options: Mapping[str, Any]) -> str:
        """GuessTheNumber with its max_number."""
        return f"GuessTheNumber with params.max_number={options['max_number']}"

    def normalize_move(self, action: str) -> str | None:
        """'[n]' from '[n]', 'n', 'I guess [n].'."""
        match = _bracketed_or_whole(action, _NUMBER)
        return f"[{int(match.group(1))}]" if match else None

    def won(self) -> bool:
        """The last valid guess was the secret number (TextArena only ends with reward 1 then)."""
        state = self.game.state
        return bool(state.done and state.rewards == {0: 1})

    def progress(self) -> float:
        """How close the last guess was (TextArena's measure)."""
        return self.game._get_percentage_completion()

    def state(self) -> Any:
        """The numbers guessed so far, in any order (each hint follows from its guess and the secret)."""
        return sorted(guess for guess, _ in self.game.state.game_state["guess_history"])


class MastermindEnv(TextArenaGameEnv):
    """TextArena Mastermind: find a secret code from black/white pegs; a move is '[1 2 3 4]' (or '1 2 3 4')."""

    description = "TextArena Mastermind: crack a secret code from black/white peg feedback; move: [1 2 3 4]."
    splits = {"train": [f"code-{i}" for i in range(1000)], "test": [f"code-{i}" for i in range(200)]}
    params = {
        "code_length": Param("Digits in the code, 2..6 (default 4).", int),
        "num_numbers": Param("Each digit is from 1 to this, 2..9 (default 6; at least code_length without "
                             "duplicates).", int),
        "duplicates": Param("Whether a digit may repeat in the code (default false).", bool),
        "max_turns": Param("Guesses allowed, 1..50 (default 20).", int),
    }
    game_class_path = "textarena.envs.Mastermind.env:MastermindEnv"
    move_hint = "the digits of your guess in square brackets, separated by spaces, e.g. [1 2 3 4]"

    @classmethod
    def game_options(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        """code_length, num_numbers, duplicate_numbers and max_turns from the params."""
        length = _int_param(params, "code_length", 4, 2, 6)
        duplicates = params.get("duplicates", False)
        # Why the lower bound: without duplicates a code of `length` digits needs at least `length` values.
        numbers = _int_param(params, "num_numbers", 6, 2 if duplicates else max(2, length), 9)
        return {"code_length": length, "num_numbers": numbers, "duplicate_numbers": bool(duplicates),
                "max_turns": _int_param(params, "max_turns", 20, 1, 50)}

    @classmethod
    def instance(cls, game: Any) -> tuple:
        """The secret code (its length is the code_length)."""
        return tuple(game.state.game_state["secret_code"])

    @classmethod
    def content_space(cls, options: Mapping[str, Any]) -> str:
        """Mastermind with the params that fix its codes, and how many codes they allow."""
        length, numbers, duplicates = options["code_length"], options["num_numbers"], options["duplicate_numbers"]
        codes = numbers ** length if duplicates else math.perm(numbers, length)
        return (f"Mastermind with params.code_length={length}, params.num_numbers={numbers}, params.duplicates="
                f"{str(duplicates).lower()} ({codes} possible codes)")

    def normalize_move(self, action: str) -> str | None:
        """'[a b c d]' from '[a b c d]', 'a b c d', '[a, b, c, d]' or 'abcd' (codes are single digits)."""
        length = self.options["code_length"]
        match = _bracketed_or_whole(action, r"\d(?:[\s,]{0,3}\d){0,9}")
        if not match:
            return None
        digits = re.findall(r"\d", match.group(1))
        return f"[{' '.join(digits)}]" if len(digits) == length else None

    def won(self) -> bool:
        """The last guess had a black peg for every digit."""
        history = self.game.state.game_state["history"]
        return bool(history) and history[-1]["black"] == self.options["code_length"]

    def progress(self) -> float:
        """Black and half the white pegs of the last guess, per digit (TextArena's measure)."""
        return self.game._get_percentage_completion()

    def state(self) -> Any:
        """The codes guessed so far, in any order (each one's pegs follow from it and the secret)."""
        return sorted(list(entry["guess"]) for entry in self.game.state.game_state["history"])


class LightsOutEnv(TextArenaGameEnv):
    """TextArena LightsOut: switch every light off; a move '[row col]' toggles that light and its neighbours."""

    description = "TextArena LightsOut: turn all lights off; a press toggles a light and its 4 neighbours; [row col]."
    splits = {"train": [f"grid-{i}" for i in range(1000)], "test": [f"grid-{i}" for i in range(200)]}
    params = {
        "size": Param("Side of the square grid, 3..8 (default 5).", int),
        "max_turns": Param("Presses allowed, 1..100 (default 20).", int),
    }
    game_class_path = "textarena.envs.LightsOut.env:LightsOutEnv"
    move_hint = "the row and column (0-indexed) of a light in square brackets, e.g. [0 2]"

    @classmethod
    def game_options(cls, params: Mapping[str, Any]) -> dict[str, Any]:
        """size and max_turns from the params."""
        return {"size": _int_param(params, "size", 5, 3, 8), "max_turns": _int_param(params, "max_turns", 20, 1, 100)}

    @classmethod
    def instance(cls, game: Any) -> tuple:
        """The starting grid (its side is the size)."""
        return tuple(tuple(bool(light) for light in row) for row in game.state.game_state["grid"])

    @classmethod
    def content_space(cls, options: Mapping[str, Any]) -> str:
        """LightsOut with its size."""
        return f"LightsOut with params.size={options['size']}"

    @classmethod
    def _reset_game(cls, game: Any) -> None:
        """Reset until the scramble leaves a light on.

        Why: TextArena scrambles by random presses, which can cancel out; the board is then already solved
        and its completion measure divides by zero lights.
        """
        for _ in range(100):
            try:
                game.reset(num_players=1)
                return
            except ZeroDivisionError:
                continue
        raise EnvServiceError(ErrorCode.env_error, "LightsOut: no scrambled grid after 100 draws")

    def normalize_move(self, action: str) -> str | None:
        """'[r c]' from '[r c]', '[r, c]', 'r c' or '(r, c)'."""
        pair = r"\d{1,2}\s*[,\s]\s*\d{1,2}"
        match = (re.search(rf"[\[(]\s*({pair})\s*[\])]", action)
                 or re.fullmatch(rf"\s*({pair})\s*\.?\s*", action))
        if not match:
            return None
        row, col = re.findall(r"\d+", match.group(1))
        return f"[{int(row)} {int(col)}]"

    def won(self) -> bool:
        """Every light is off."""
        return not any(any(row) for row in self.game.state.game_state["grid"])

    def progress(self) -> float:
        """Share of the initially lit lights now off (TextArena's measure)."""
        return self.game._get_percentage_completion()

    def grid(self) -> list[list[bool]]:
        """The current lights (True: on), row by row."""
        return [[bool(light) for light in row] for row in self.game.state.game_state["grid"]]

    def state(self) -> Any:
        """The lights (the moves that led there do not matter: a press undoes itself)."""
        return self.grid()
