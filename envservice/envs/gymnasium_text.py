"""Any Gymnasium env with a text rendering and named discrete actions, served from config alone.

    frozenlake-gym:                      # an env-config entry (python -m envservice --env-config envs.yaml)
      kind: gymnasium
      config:
        gym_id: FrozenLake-v1
        make_kwargs: {map_name: 4x4, is_slippery: false}
        action_names: [left, down, right, up]      # action i of the Discrete space is called action_names[i]
        splits: {train: 1000}                      # tasks per split (default {train: 1000, test: 100})

A task is one reset seed, so the same task is the same episode start every time (what GRPO's groups and `check_env`
need). Task i of the first split (train) resets with seed i (`seed-<i>`, as always). A later split (test, then val,
then other names) is held out by content: its task i (`<split>-<i>`) resets with the i-th seed from the split's own
offset (1 000 000 for test) whose start state no earlier split has (`held_out_seeds`). Disjoint seeds alone are not
disjoint tasks: FrozenLake-v1's fixed 4x4 map starts the same way for every seed, and 1000 Taxi-v4 seeds give 286
of its 300 starts, so there a test split has no task (FrozenLake) or 14 (Taxi), and its tasks beyond those are an
error that says so. A game with one start (FrozenLake's fixed maps, CliffWalking) can only have a train split. The
observation is the env's `render()` in `render_mode="ansi"` (as plain text: see `plain_text`), or what a user
function `renderer: "module:function"` (called as `function(env, observation)`) returns, followed by the action
names.
"""

from __future__ import annotations

import functools
import importlib
import re
from typing import Any, Callable, Mapping

import gymnasium as gym
import numpy as np

from envservice.envs.base import (STATE_KEY, Param, StepResult, Task, TextEnv, clip_text, content_digest,
                                  unseen_seeds)
from envservice.errors import EnvServiceError
from envservice.protocol import ErrorCode

SPLIT_SEED_OFFSET = 1_000_000
"""Seeds of a split start at its rank times this: splits never share a seed."""
HELD_OUT_SEED_SCAN = 20_000
"""Reset seeds a held-out split scans at most for start states that no earlier split has."""
SPLIT_RANKS = {"train": 0, "test": 1, "val": 2, "validation": 2}
"""Seed ranks of the usual split names; other names rank after them in sorted order (the config reaches
the class as canonical JSON with sorted keys, so the order the YAML gave is not kept)."""
DEFAULT_SPLITS = {"train": 1000, "test": 100}
_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_HIGHLIGHT = re.compile(r"\x1b\[[0-9;]*[1-9][0-9;]*m(.*?)\x1b\[0?m", re.DOTALL)
HIGHLIGHT_NOTE = "(the highlighted cell is in [brackets])"


def plain_text(rendering: str) -> str:
    """An ANSI rendering as plain text: a highlighted span (FrozenLake's agent cell) becomes `[span]`,
    other escapes are dropped, because a tokenizer sees no colours."""
    marked = _HIGHLIGHT.sub(lambda match: f"[{match.group(1)}]", rendering)
    text = _ANSI_ESCAPE.sub("", marked)
    return f"{text.rstrip()}\n{HIGHLIGHT_NOTE}" if marked != rendering else text


def load_renderer(reference: str) -> Callable[[Any, Any], str]:
    """The user's `function(env, observation) -> str` named by `"module:function"`."""
    module_name, sep, function_name = reference.partition(":")
    if not sep:
        raise ValueError(f"GymnasiumTextEnv: config.renderer={reference!r} must be 'ansi' or 'module:function'")
    try:
        return getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"GymnasiumTextEnv: config.renderer={reference!r} cannot be loaded: {exc}") from None


def make_env(config: Mapping[str, Any]) -> gym.Env:
    """`gym.make(gym_id, **make_kwargs)`, in `render_mode="ansi"` unless a user renderer draws the text."""
    kwargs = dict(config.get("make_kwargs") or {})
    if config.get("renderer", "ansi") == "ansi":
        kwargs.setdefault("render_mode", "ansi")
    return gym.make(config["gym_id"], **kwargs)


def _action_names(config: Mapping[str, Any]) -> list[str]:
    """The action names, checked against the env's action space (a Discrete one, one name per action)."""
    try:
        env = make_env(config)
    except Exception as exc:  # an unknown id or bad kwargs: say which field, with gymnasium's own reason
        raise ValueError(f"GymnasiumTextEnv: gym.make(config.gym_id={config['gym_id']!r}, **config.make_kwargs) "
                         f"failed: {exc}") from None
    try:
        space = env.action_space
        if not isinstance(space, gym.spaces.Discrete):
            raise ValueError(f"GymnasiumTextEnv: {config['gym_id']} has a {type(space).__name__} action space; "
                             "only Discrete action spaces can be named as text actions")
        names = [str(name).strip().lower() for name in config["action_names"]]
        if len(names) != space.n or len(set(names)) != len(names) or not all(names):
            raise ValueError(f"GymnasiumTextEnv: config.action_names has {len(names)} names; "
                             f"{config['gym_id']}'s action space has {space.n} actions: give one distinct name each")
        return names
    finally:
        env.close()


class GymnasiumTextEnv(TextEnv):
    """A Gymnasium env served as a text env; configure it with `gym_id` and `action_names` (see module)."""

    description = "a Gymnasium env with text rendering (configure gym_id and action_names)"
    config_fields = {
        "gym_id": Param("the Gymnasium id, e.g. FrozenLake-v1 (its package must be installed)"),
        "make_kwargs": Param("keyword arguments of gym.make, e.g. {map_name: 8x8}", dict),
        "action_names": Param("a name per action of the Discrete action space, in index order", list),
        "renderer": Param("'ansi' (env.render() in render_mode='ansi', the default) or 'module:function' "
                          "called as function(env, observation) -> str"),
        "splits": Param("tasks (reset seeds) per split, e.g. {train: 1000, test: 100}", dict),
        "success_return": Param("an episode whose summed reward reaches this is a success (default 1.0)", float),
        "description": Param("one line for GET /envs"),
    }
    required_config = ("gym_id", "action_names")

    @classmethod
    def configured_attributes(cls, config: Mapping[str, Any]) -> dict[str, Any]:
        """Checks the env (id, action space, names, renderer) once, and derives splits and description."""
        names = _action_names(config)
        if config.get("renderer", "ansi") != "ansi":
            load_renderer(config["renderer"])
        counts = config.get("splits") or DEFAULT_SPLITS
        if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in counts.values()):
            raise ValueError(f"GymnasiumTextEnv: config.splits={counts!r} must map split names to task counts >= 1")
        ranks = {split: SPLIT_RANKS.get(split, 3 + k) for k, split in enumerate(sorted(counts))}
        order = tuple(sorted(counts, key=ranks.__getitem__))
        first_seed = ranks[order[0]] * SPLIT_SEED_OFFSET
        splits = {split: [f"seed-{first_seed + i}" if split == order[0] else f"{split}-{i}"
                          for i in range(counts[split])] for split in order}
        description = config.get("description") or f"{config['gym_id']} (Gymnasium) with actions {', '.join(names)}"
        return {"splits": splits, "description": description, "action_names": tuple(names),
                "seed_starts": {split: ranks[split] * SPLIT_SEED_OFFSET for split in order}}

    action_names: tuple[str, ...] = ()
    """The configured action names (index i names action i)."""
    seed_starts: Mapping[str, int] = {}
    """First reset seed of each split, in split order (train first); see the module docstring."""
    fingerprint_folds = ("what the reset observation does not show (Blackjack's cards to come): a task is its start "
                         "state",)

    @classmethod
    def task_fingerprint(cls, task: Task) -> str:
        """The start state the task resets to (the observation Gymnasium's `reset` returns with its seed)."""
        return start_digests(cls)[task.split][cls.reset_seed(task)]

    @classmethod
    def reset_seed(cls, task: Task) -> int:
        """The reset seed of `task`: its index in the first split; in a later split, the index-th of
        `held_out_seeds` (an `unknown_task` error when the game has fewer start states that are the split's own)."""
        first = next(iter(cls.seed_starts))
        if task.split == first:
            return cls.seed_starts[first] + task.index
        seeds = held_out_seeds(cls)[task.split]
        if task.index >= len(seeds):
            raise cls._too_few_starts(task.split, len(seeds))
        return seeds[task.index]

    @classmethod
    def _too_few_starts(cls, split: str, found: int) -> EnvServiceError:
        """The error for a task of a held-out split beyond the `found` start states that are the split's own."""
        earlier = list(cls.seed_starts)[:list(cls.seed_starts).index(split)]
        game = f"{cls.config['gym_id']} (make_kwargs {dict(cls.config.get('make_kwargs') or {})})"
        scanned = f"in {HELD_OUT_SEED_SCAN} reset seeds scanned"
        if not found:
            return EnvServiceError(ErrorCode.unknown_task, f"{game} has no start state that no {'/'.join(earlier)} "
                                   f"task has ({scanned}): its {split} split cannot be held out; give config.splits "
                                   f"a {earlier[0]} split only")
        return EnvServiceError(ErrorCode.unknown_task, f"{game} has only {found} start states that no "
                               f"{'/'.join(earlier)} task has ({scanned}): {split} task_id must be below {found} "
                               f"(fewer {earlier[0]} tasks in config.splits leave more)")

    def __init__(self) -> None:
        self.env: gym.Env | None = None
        self.episode_return, self.ended = 0.0, False
        self.state_key = ""
        """The digest of the game's latest observation (see `STATE_KEY`): the state, for the fully observed
        games this class serves (Taxi, FrozenLake, CliffWalking, Blackjack); a rejected action keeps it."""
        renderer = self.config.get("renderer", "ansi")
        self.renderer = None if renderer == "ansi" else load_renderer(renderer)

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Reset with the task's seed (see the module docstring); the first observation as text."""
        seed = self.reset_seed(task)
        if self.env is None:
            self.env = make_env(self.config)
        observation, _ = self.env.reset(seed=seed)
        self.episode_return, self.ended = 0.0, False
        self.state_key = content_digest("gymnasium-observation", start_content(observation))
        return self._text(observation), {"reset_seed": seed, STATE_KEY: self.state_key}

    def step(self, action: str) -> StepResult:
        """Apply the named action; an unknown name is an observation listing the valid ones."""
        name = action.strip().lower()
        if name not in self.action_names:
            return (f"Invalid action {clip_text(action)!r}. Valid actions: {', '.join(self.action_names)}.",
                    0.0, False, False, {"invalid_action": True, STATE_KEY: self.state_key})
        observation, reward, terminated, truncated, _ = self.env.step(self.action_names.index(name))
        self.episode_return += float(reward)
        self.ended = bool(terminated or truncated)
        self.state_key = content_digest("gymnasium-observation", start_content(observation))
        return self._text(observation), float(reward), bool(terminated), bool(truncated), {STATE_KEY: self.state_key}

    def evaluate(self) -> tuple[float, bool]:
        """(episode return / success_return, clamped to [0, 1]; whether it reached success_return)."""
        target = float(self.config.get("success_return", 1.0))
        score = min(1.0, max(0.0, self.episode_return / target)) if target > 0 else float(self.episode_return >= 0)
        return score, self.episode_return >= target

    def close(self) -> None:
        """Close the Gymnasium env."""
        if self.env is not None:
            self.env.close()
            self.env = None

    def _text(self, observation: Any) -> str:
        """The rendering of the current state, then the valid actions."""
        if self.renderer is not None:
            picture = str(self.renderer(self.env, observation))
        else:
            picture = plain_text(str(self.env.render()))
        return f"{picture.rstrip()}\nActions: {', '.join(self.action_names)}"


def start_content(observation: Any) -> Any:
    """A Gymnasium observation as plain, comparable Python values (arrays by dtype, shape and bytes: `repr`
    shortens large arrays)."""
    if isinstance(observation, np.ndarray):
        return "array", observation.dtype.str, observation.shape, observation.tobytes()
    if isinstance(observation, np.generic):
        return observation.item()
    if isinstance(observation, Mapping):
        return tuple(sorted((str(key), start_content(value)) for key, value in observation.items()))
    if isinstance(observation, (list, tuple)):
        return tuple(start_content(value) for value in observation)
    return observation


@functools.lru_cache(maxsize=None)
def start_digests(cls: type[GymnasiumTextEnv]) -> dict[str, dict[int, str]]:
    """Per split, reset seed -> digest of the start state, for every seed the split's tasks use (computed once
    per configured class: the first split's seeds, then each later split's scan in `held_out_seeds`)."""
    env = make_env(cls.config)

    def digest(seed: int) -> str:
        return content_digest(start_content(env.reset(seed=seed)[0]))

    try:
        splits = iter(cls.seed_starts.items())
        first, start = next(splits)
        found = {first: {seed: digest(seed) for seed in range(start, start + len(cls.splits[first]))}}
        seen = set(found[first].values())
        for split, start in splits:  # starts no earlier split has, each new to this split
            found[split] = unseen_seeds(digest, seen, start, len(cls.splits[split]), HELD_OUT_SEED_SCAN)
        return found
    finally:
        env.close()


@functools.lru_cache(maxsize=None)
def held_out_seeds(cls: type[GymnasiumTextEnv]) -> dict[str, tuple[int, ...]]:
    """The reset seeds of each split after the first, in task order: from the split's own offset on, each seed
    whose start state no earlier split's task has and differs from the split's earlier ones.

    Why: tasks are reset seeds, and seeds of a game with few start states repeat starts (1000 Taxi-v4 seeds give
    286 of its 300), so disjoint seed ranges are not disjoint tasks.
    """
    return {split: tuple(seeds) for split, seeds in list(start_digests(cls).items())[1:]}
