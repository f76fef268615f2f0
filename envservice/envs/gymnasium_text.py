"""Any Gymnasium env with a text rendering and named discrete actions, served from config alone.

    frozenlake-gym:                      # an env-config entry (python -m envservice --env-config envs.yaml)
      kind: gymnasium
      config:
        gym_id: FrozenLake-v1
        make_kwargs: {map_name: 4x4, is_slippery: false}
        action_names: [left, down, right, up]      # action i of the Discrete space is called action_names[i]
        splits: {train: 1000, test: 200}           # tasks per split (default {train: 1000, test: 100})

A task is one reset seed: task i of a split resets with seed `offset(split) + i` (train 0, test 1 000 000), so the same task is the
same episode start every time (what GRPO's groups and `check_env` need), and train and test tasks never
share a seed. The observation is the env's `render()` in `render_mode="ansi"` (as plain text: see `plain_text`), or
what a user function `renderer: "module:function"` (called as `function(env, observation)`) returns,
followed by the action names.
"""

from __future__ import annotations

import importlib
import re
from typing import Any, Callable, Mapping

import gymnasium as gym

from envservice.envs.base import Param, StepResult, Task, TextEnv, clip_text

SPLIT_SEED_OFFSET = 1_000_000
"""Seeds of a split start at its rank times this: splits never share a seed."""
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
        splits = {split: [f"seed-{ranks[split] * SPLIT_SEED_OFFSET + i}" for i in range(n)]
                  for split, n in counts.items()}
        description = config.get("description") or f"{config['gym_id']} (Gymnasium) with actions {', '.join(names)}"
        return {"splits": splits, "description": description, "action_names": tuple(names)}

    action_names: tuple[str, ...] = ()
    """The configured action names (index i names action i)."""

    def __init__(self) -> None:
        self.env: gym.Env | None = None
        self.episode_return, self.ended = 0.0, False
        renderer = self.config.get("renderer", "ansi")
        self.renderer = None if renderer == "ansi" else load_renderer(renderer)

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        """Reset with the task's seed (see the module docstring); the first observation as text."""
        if self.env is None:
            self.env = make_env(self.config)
        seed = int(task.name.removeprefix("seed-"))
        observation, _ = self.env.reset(seed=seed)
        self.episode_return, self.ended = 0.0, False
        return self._text(observation), {"reset_seed": seed}

    def step(self, action: str) -> StepResult:
        """Apply the named action; an unknown name is an observation listing the valid ones."""
        name = action.strip().lower()
        if name not in self.action_names:
            return (f"Invalid action {clip_text(action)!r}. Valid actions: {', '.join(self.action_names)}.",
                    0.0, False, False, {"invalid_action": True})
        observation, reward, terminated, truncated, _ = self.env.step(self.action_names.index(name))
        self.episode_return += float(reward)
        self.ended = bool(terminated or truncated)
        return self._text(observation), float(reward), bool(terminated), bool(truncated), {}

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
