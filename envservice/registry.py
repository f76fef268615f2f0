"""Environments registered by id with an entry point and the limits the service enforces.

Entry points are `"module:Class"` strings (imported on first use, so listing ids imports no env package)
or `TextEnv` subclasses (handy in tests, in-process only: worker processes and Ray actors import an env
by its module path). `ENVSERVICE_TEST_ENVS=1` also registers the deliberately faulty `faulty` env of
`envservice.envs.testing`, for the isolation tests.
"""

from __future__ import annotations

import importlib
import os
import threading
from dataclasses import dataclass
from typing import Union

from envservice.envs.base import TextEnv
from envservice.errors import EnvServiceError
from envservice.protocol import EnvSpec, ErrorCode

EntryPoint = Union[str, type[TextEnv]]


@dataclass(frozen=True)
class Registration:
    """One registered environment: how to build it and its limits."""

    env_id: str
    entry_point: EntryPoint
    max_steps: int
    max_sessions: int

    def env_class(self) -> type[TextEnv]:
        """The `TextEnv` subclass, importing its module on first use."""
        if not isinstance(self.entry_point, str):
            return self.entry_point
        module_name, _, class_name = self.entry_point.partition(":")
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except Exception as exc:  # a missing or broken package: say which env and why, not a bare 500
            raise EnvServiceError(
                ErrorCode.env_error,
                f"env {self.env_id!r} cannot be loaded: importing {self.entry_point!r} failed with {exc!r}; "
                "install the package it needs (README, 'Installing') or stop serving it",
            ) from exc
        if not (isinstance(cls, type) and issubclass(cls, TextEnv)):
            raise TypeError(f"entry point {self.entry_point!r} of {self.env_id!r} is not a TextEnv subclass")
        return cls

    def spec(self) -> EnvSpec:
        """The public description served by GET /envs."""
        cls = self.env_class()
        return EnvSpec(
            id=self.env_id,
            description=cls.description,
            tasks=cls.task_counts(),
            max_steps=self.max_steps,
            max_sessions=self.max_sessions,
            params=dict(cls.params),
        )


_REGISTRY: dict[str, Registration] = {}
_LOCK = threading.Lock()


def register(env_id: str, entry_point: EntryPoint, *, max_steps: int, max_sessions: int) -> Registration:
    """Register an environment id; re-registering an id is an error (call `unregister` first)."""
    if max_steps < 1 or max_sessions < 1:
        raise ValueError(f"{env_id!r}: max_steps ({max_steps}) and max_sessions ({max_sessions}) must be >= 1")
    registration = Registration(env_id, entry_point, max_steps, max_sessions)
    with _LOCK:
        if env_id in _REGISTRY:
            raise ValueError(f"environment id {env_id!r} is already registered")
        _REGISTRY[env_id] = registration
    return registration


def unregister(env_id: str) -> None:
    """Remove a registration (tests register throw-away environments)."""
    with _LOCK:
        _REGISTRY.pop(env_id, None)


def registered_ids() -> list[str]:
    """All registered ids, sorted."""
    with _LOCK:
        return sorted(_REGISTRY)


def get(env_id: str) -> Registration:
    """The registration of `env_id`; an unknown id is an `unknown_env` error listing the valid ids."""
    with _LOCK:
        registration = _REGISTRY.get(env_id)
    if registration is None:
        raise EnvServiceError(
            ErrorCode.unknown_env, f"env_id={env_id!r} is not registered", valid_choices=registered_ids()
        )
    return registration


def make(env_id: str) -> TextEnv:
    """A new instance of the environment registered as `env_id`."""
    return get(env_id).env_class()()


register("babyai", "envservice.envs.babyai:BabyAIEnv", max_steps=128, max_sessions=4096)
register("textcraft", "envservice.envs.textcraft:TextCraftEnv", max_steps=64, max_sessions=1024)
register("frozenlake", "envservice.envs.frozenlake:FrozenLakeEnv", max_steps=100, max_sessions=16384)
register("sciworld", "envservice.envs.sciworld:ScienceWorldTextEnv", max_steps=100, max_sessions=64)
register("textworld", "envservice.envs.textworld_env:TextWorldEnv", max_steps=100, max_sessions=1024)
register("alfworld", "envservice.envs.alfworld_env:AlfWorldEnv", max_steps=50, max_sessions=1024)
register("search", "envservice.envs.search:SearchQAEnv", max_steps=10, max_sessions=4096)
register("appworld", "envservice.envs.appworld_env:AppWorldEnv", max_steps=50, max_sessions=64)

if os.environ.get("ENVSERVICE_TEST_ENVS") == "1":  # deliberately faulty envs, for the isolation tests only
    from envservice.envs.testing import register_test_envs

    register_test_envs()
