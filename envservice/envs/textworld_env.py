"""TextWorld (textworld 1.7.0): text adventure games generated offline, one game per task.

A task `game-<i>` of a split is the game TextWorld's generator makes from a seed fixed by (split, i) and the size
params. Disjoint seeds are not disjoint games (small games repeat), so a game belongs to one split by its content
(`game_fingerprint`, `envservice.envs.base.content_split`): a task tries seeds in a fixed order (`candidate_seeds`,
the first one the seed it always had) until its game is its split's. Games are compiled once (Inform 7, ~1-2 s) and
cached on disk under `$BEYOND_AGENT_TEXTWORLD_CACHE` (default `~/.cache/beyond_agent/textworld`); later resets of
the same game only load the file. Reward is the change of the game's score over its maximum.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import tempfile
import threading
import unicodedata
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

import textworld
from textworld import EnvInfos, GameOptions
from textworld.generator import KnowledgeBase, compile_game, make_game

from envservice.envs.base import STATE_KEY, Param, StepResult, Task, TextEnv, content_digest, draw_for_split
from envservice.errors import EnvServiceError
from envservice.protocol import ErrorCode

CACHE_ENV = "BEYOND_AGENT_TEXTWORLD_CACHE"
"""Environment variable naming the folder of compiled games."""

DEFAULT_CACHE = "~/.cache/beyond_agent/textworld"

SPLIT_SEED_OFFSET = {"train": 0, "test": 10_000_000}
"""Added to the task index to form a task's first generator seed (see `candidate_seeds`)."""

CACHE_LAYOUT = "split-by-content"
"""Suffix of the cache folder. Why: games cached before splits were by content sit in the folder without it, and
one train game in five (most test games) changed since."""

SIZE_PARAMS: dict[str, tuple[int, int, int]] = {
    "rooms": (3, 1, 20),
    "objects": (6, 0, 40),
    "quest_length": (3, 1, 10),
}
"""Game size params: (default, minimum, maximum)."""

_BANNER_CHARS = set(" _|\\/$<>-")
_REQUEST_INFOS = EnvInfos(policy_commands=True, won=True, lost=True, score=True, max_score=True, objective=True,
                          facts=True)
_GENERATION_LOCKS: dict[str, threading.Lock] = {}
_GENERATION_LOCKS_GUARD = threading.Lock()
_SHARED_KB_LOCK = threading.Lock()
"""Held while a fingerprint's game is made on TextWorld's shared knowledge base (one generation at a time)."""


def cache_dir() -> Path:
    """The folder of compiled games (`$BEYOND_AGENT_TEXTWORLD_CACHE` or `~/.cache/beyond_agent/textworld`)."""
    return Path(os.path.expanduser(os.environ.get(CACHE_ENV) or DEFAULT_CACHE))


def game_size(params: Mapping[str, Any]) -> dict[str, int]:
    """The size params of a task with defaults filled in; a bad value names the param and its valid range."""
    size = {}
    for name, (default, low, high) in SIZE_PARAMS.items():
        value = params.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise EnvServiceError(ErrorCode.bad_request,
                                  f"params.{name}={value!r} is invalid: give an integer in {low}..{high}")
        size[name] = value
    return size


def candidate_seeds(split: str, index: int) -> Iterator[int]:
    """The generator seeds a task tries, in order: the seed it always had (split offset + index), then seeds
    derived from (split, index, attempt)."""
    yield SPLIT_SEED_OFFSET[split] + index
    for attempt in itertools.count(1):
        yield int(content_digest("textworld-seed", split, index, attempt), 16) % (1 << 31)


def game_seed(task: Task) -> int:
    """The generator seed of a task: the first of `candidate_seeds` whose game belongs to the task's split."""
    return _task_draw(task)[0]


def game_fingerprint(task: Task) -> str:
    """The content of the task's game: its world, quest, entity names and texts, and objective (not its seed or
    uuid), from TextWorld's generator without compiling (~50 ms a game, against ~1.3 s to compile)."""
    return _task_draw(task)[1]


def _task_draw(task: Task) -> tuple[int, str]:
    size = game_size(task.params)
    return _draw(task.split, task.index, size["rooms"], size["objects"], size["quest_length"])


@functools.lru_cache(maxsize=4096)
def _draw(split: str, index: int, rooms: int, objects: int, quest_length: int) -> tuple[int, str]:
    """(seed, fingerprint) of a task's game. Why a draw: small games repeat (1 room, no objects, quest length 1:
    one game of 1000 test games was a train game), so disjoint seeds are not disjoint games."""
    return draw_for_split(split, candidate_seeds(split, index),
                          lambda seed: _fingerprint(seed, rooms, objects, quest_length),
                          f"TextWorld with params.rooms={rooms}, params.objects={objects}, "
                          f"params.quest_length={quest_length}")


def _fingerprint(seed: int, rooms: int, objects: int, quest_length: int) -> str:
    options = _game_options(seed, rooms, objects, quest_length)
    with _SHARED_KB_LOCK:
        # Why the shared knowledge base: loading it is 85% of `make_game`'s time (~0.3 s); the game is the same.
        options.kb = KnowledgeBase.default()
        game = make_game(options).serialize()
    content = {key: game[key] for key in ("world", "quests", "infos", "objective")}
    return content_digest("textworld", json.dumps(content, sort_keys=True))


def game_path(task: Task) -> Path:
    """Where the compiled game of `task` is cached (the name holds every input of the generator)."""
    size = game_size(task.params)
    name = "{}-{}-r{rooms}-o{objects}-q{quest_length}.z8".format(task.split, task.index, **size)
    return cache_dir() / f"textworld-{textworld.__version__}-{CACHE_LAYOUT}" / name


def ensure_game(task: Task) -> Path:
    """The cached game file of `task`, generating and compiling it first when it is missing."""
    path = game_path(task)
    with _generation_lock(str(path)):
        if not path.is_file():
            with _TEXTWORLD_LOCK:  # why: the generator parses with TextWorld's one parser (see the lock)
                _generate(task, path)
    return path


_TEXTWORLD_LOCK = threading.Lock()
"""Held while a game is made and compiled, and while one is started and reset: TextWorld parses its logic with one
parser per process (tatsu's), which two threads must not share. Two sessions created at once (the service's threads;
found by `python -m envservice.check --hacks textworld`, issue #69) failed in reset with a parse error, an IndexError
or a TypeError."""


def _generation_lock(key: str) -> threading.Lock:
    with _GENERATION_LOCKS_GUARD:
        return _GENERATION_LOCKS.setdefault(key, threading.Lock())


def _game_options(seed: int, rooms: int, objects: int, quest_length: int) -> GameOptions:
    """TextWorld's generator options for a seed and size."""
    options = GameOptions()
    options.seeds = seed
    options.nb_rooms, options.nb_objects, options.quest_length = rooms, objects, quest_length
    return options


def _generate(task: Task, path: Path) -> None:
    """Make and compile the game in a temporary folder, then move it in place (the .z8 last: it marks done)."""
    size = game_size(task.params)
    options = _game_options(game_seed(task), size["rooms"], size["objects"], size["quest_length"])
    options.force_recompile = True
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".tmp-") as tmp:
        options.path = os.path.join(tmp, path.name)
        compiled = Path(compile_game(make_game(options), options))
        os.replace(compiled.with_suffix(".json"), path.with_suffix(".json"))
        os.replace(compiled, path)


def clean_text(text: str) -> str:
    """Drop the ASCII-art banner of the first observation and the trailing '>' prompt line."""
    lines = text.split("\n")
    while lines and set(lines[0]) <= _BANNER_CHARS:
        lines.pop(0)
    cleaned = "\n".join(lines)
    prompt = cleaned.rfind("\n>")
    if prompt != -1:
        cleaned = cleaned[:prompt]
    return cleaned.strip()


INPUT_BYTES = 198
"""Jericho's input buffer (`jericho.jericho.INPUT_BUFFER_SIZE`): it cuts longer commands there, bytewise."""

NOT_TEXT = "I did not understand that command: it is not valid text (it holds an unpaired surrogate)."


def game_command(action: str) -> str | None:
    """The command the interpreter is given, or None for an action that is not encodable text.

    Control characters become spaces (a NUL ends Jericho's C string early: the interpreter then waits for the
    rest of the line forever or crashes the process) and whitespace runs, newlines included, one space. The
    command is cut to `INPUT_BYTES` on a character boundary (Jericho cuts bytewise and then fails to decode a
    split character). Lone surrogates cannot be encoded as UTF-8: None.
    """
    text = " ".join("".join(" " if unicodedata.category(ch) == "Cc" else ch for ch in action).split())
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return data[:INPUT_BYTES].decode("utf-8", errors="ignore").strip()


class TextWorldEnv(TextEnv):
    """A generated TextWorld game; actions are parser commands ('go east', 'take key', 'open chest')."""

    description = ("TextWorld (textworld 1.7.0): generated text adventures with a quest; actions are parser "
                   "commands such as 'go east', 'take apple', 'open box', 'eat apple'.")
    splits = {"train": [f"game-{i}" for i in range(10_000)], "test": [f"game-{i}" for i in range(1_000)]}
    params = {
        name: Param(f"{name.replace('_', ' ').capitalize()} of the generated game, {low}..{high} (default {default}).",
                    int)
        for name, (default, low, high) in SIZE_PARAMS.items()
    }

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        """The generated game's content (`game_fingerprint`), without compiling it."""
        return game_fingerprint(task)

    def __init__(self) -> None:
        self._env: textworld.Environment | None = None
        self._state: textworld.GameState | None = None
        self._policy: list[str] = []

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Load (generating on first use) the task's game and start it."""
        path = ensure_game(task)
        self.close()
        with warnings.catch_warnings(), _TEXTWORLD_LOCK:  # jericho warns it cannot track TextWorld games; TextWorld does
            warnings.filterwarnings("ignore", message=".*is not fully supported")
            self._env = textworld.start(str(path), request_infos=_REQUEST_INFOS)
            self._state = self._env.reset()
        self._policy = list(self._state["policy_commands"])
        info = {"game": task.name, "objective": self._state["objective"], "max_score": self._state["max_score"],
                STATE_KEY: self._state_key()}
        return clean_text(self._state.feedback), info

    def step(self, action: str) -> StepResult:
        """Run one command; reward is the score gained over the game's maximum score."""
        command = game_command(action)
        if command is None:
            info = {"won": bool(self._state["won"]), "lost": bool(self._state["lost"]), "invalid": True,
                    STATE_KEY: self._state_key()}
            return NOT_TEXT, 0.0, False, False, info
        before = self._state["score"]
        self._state, score, done = self._env.step(command)
        reward = (score - before) / max(1, self._state["max_score"])
        info = {"won": bool(self._state["won"]), "lost": bool(self._state["lost"]), STATE_KEY: self._state_key()}
        return clean_text(self._state.feedback), float(reward), bool(done), False, info

    def _state_key(self) -> str:
        """The game's true facts (where the player and things are, what is open): its state, which the feedback
        ("You open the locker.", "That's not a verb I recognise.") only describes in part (see `STATE_KEY`)."""
        return content_digest("textworld-state", sorted(map(str, self._state["facts"])))

    def evaluate(self) -> tuple[float, bool]:
        """Score: the game's score over its maximum; success when the quest is won."""
        score = self._state["score"] / max(1, self._state["max_score"])
        return min(1.0, max(0.0, float(score))), bool(self._state["won"])

    def gold_actions(self) -> list[str]:
        """TextWorld's walkthrough for the game as it was at reset (an oracle for tests)."""
        return list(self._policy)

    def close(self) -> None:
        """Close the game interpreter."""
        if self._env is not None:
            self._env.close()
            self._env = None
