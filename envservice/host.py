"""`EnvHost`: the side of a worker (a process or a Ray actor) that owns env instances keyed by a handle.

The service sends it `(method, key, args)` requests and gets `(ok, payload)` replies. Both are plain
picklable values: an env class travels as its `"module:Class"` entry point and is imported where it runs,
so a worker needs nothing registered. An exception inside an env becomes an `(False, error)` reply;
nothing a single env does (short of killing the process) stops the host from serving the others.

Besides the env calls (reset, step, evaluate, close), `preload` imports env classes ahead of the first
reset and `imported` says which modules this worker holds.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import traceback
from typing import Any, Sequence

from envservice.envs.base import Task, TextEnv
from envservice.errors import EnvServiceError
from envservice.latency import sleep_for
from envservice.registry import load_env_class

logger = logging.getLogger("envservice")

Reply = tuple[bool, Any]
"""(True, result) or (False, error) where error is `("service", code, message, valid_choices)` for an
`EnvServiceError` raised by the env, else `("env", repr of the exception, traceback text)`."""


def entry_point_of(env_class: type[TextEnv]) -> str:
    """The reference a worker imports to build `env_class`: `"module:Class"`, or for a configured class
    `"module:Class#<config JSON>"` (see `registry.configured_class`)."""
    return env_class.__dict__.get("class_reference") or f"{env_class.__module__}:{env_class.__qualname__}"


class EnvHost:
    """Env instances of one worker, keyed by the service's handle; `handle()` runs one request.

    Thread-safe for different keys (the service never sends two calls for one key at once).
    """

    def __init__(self) -> None:
        self._envs: dict[str, TextEnv] = {}
        self._lock = threading.Lock()

    def handle(self, method: str, key: str, args: tuple) -> Reply:
        """Run `method` for the env of `key`; exceptions become error replies."""
        try:
            return True, getattr(self, f"_{method}")(key, *args)
        except EnvServiceError as exc:
            return False, ("service", exc.code.value, exc.message, exc.valid_choices)
        except Exception as exc:
            return False, ("env", repr(exc), traceback.format_exc())

    def count(self) -> int:
        """Env instances held now."""
        with self._lock:
            return len(self._envs)

    def close_all(self) -> None:
        """Close every env (the worker is going away); a failing close does not stop the others."""
        with self._lock:
            envs, self._envs = list(self._envs.values()), {}
        for env in envs:
            try:
                env.close()
            except Exception:  # the worker is going away anyway; say which env failed to close
                logger.exception("env %s failed in close while its worker stopped", type(env).__name__)

    def pid(self) -> int:
        """The process id of this host (tests and logs use it)."""
        return os.getpid()

    def _preload(self, _key: str, entry_points: Sequence[str]) -> dict[str, str]:
        """Import each entry point's class now, so that no first reset (under the step limit) pays for it.

        Returns {entry point: repr of the exception} for those that failed; a failure is not an error reply.
        """
        failures: dict[str, str] = {}
        for entry_point in entry_points:
            try:
                load_env_class(entry_point)
            except Exception as exc:
                failures[entry_point] = repr(exc)
        return failures

    def _imported(self, _key: str, module_names: Sequence[str]) -> list[str]:
        """Which of `module_names` this worker has imported (diagnostics and tests of the preload)."""
        return [name for name in module_names if name in sys.modules]

    def _reset(self, key: str, entry_point: str, task: Task, delay_s: float = 0.0) -> tuple[str, dict]:
        """Build the handle's env on its first reset, sleep the injected create delay (`envservice.latency`:
        here, so that it counts toward the call's limit), then reset it."""
        with self._lock:
            env = self._envs.get(key)
        if env is None:  # the first reset of a handle builds its env (under the same time limit)
            env = load_env_class(entry_point)()
            with self._lock:
                self._envs[key] = env
        sleep_for(delay_s)
        return env.reset(task)

    def _step(self, key: str, action: str, delay_s: float = 0.0) -> Any:
        """Sleep the injected step delay (see `_reset`), then step the handle's env."""
        env = self._env(key)
        sleep_for(delay_s)
        return env.step(action)

    def _evaluate(self, key: str) -> Any:
        return self._env(key).evaluate()

    def _close(self, key: str) -> None:
        with self._lock:
            env = self._envs.pop(key, None)
        if env is not None:
            env.close()

    def _env(self, key: str) -> TextEnv:
        with self._lock:
            env = self._envs.get(key)
        if env is None:
            raise KeyError(f"no env for handle {key!r} on this worker (pid {os.getpid()})")
        return env
