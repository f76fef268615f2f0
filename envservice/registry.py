"""Environments registered by id: how to build each, and the limits the service enforces.

Three ways in, one table:
- the built-in envs, registered below;
- plugins: any installed distribution that declares an entry point in the group `envservice.envs`
  (`counter = "counter_env:CounterEnv"` in its pyproject's `[project.entry-points."envservice.envs"]`),
  discovered the first time the table is read, so `python -m envservice --envs counter` serves it with no
  edit of this repository;
- `register(env_id, entry_point)` from code (tests, notebooks), or `python -m envservice --register
  ID=module:Class` on the command line.

An entry point is a `"module:Class"` string, imported on first use (listing ids imports no env package),
or a `TextEnv` subclass (in-process only: worker processes and Ray actors import an env by its module
path). Limits come from the registration when it gives them, else from the class attributes `max_steps`
and `max_sessions` (see `TextEnv`).

A registration may also carry a `config` (settings of a configurable class such as a remote AgentGym
server or a Gymnasium game; `envservice.env_config` reads them from YAML). The env class is then
`Class.configure(config)`, and the reference that workers import it by is `"module:Class#<config JSON>"`,
so a worker process or Ray actor builds the same configured class with nothing registered.
"""

from __future__ import annotations

import functools
import importlib
import json
import logging
import threading
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any, Mapping, Union

from envservice.envs.base import TextEnv, param_description, param_type_name
from envservice.errors import EnvServiceError
from envservice.protocol import EnvSpec, ErrorCode

logger = logging.getLogger("envservice")

ENTRY_POINT_GROUP = "envservice.envs"
"""The entry-point group an installed package uses to register its envs."""
EntryPoint = Union[str, type[TextEnv]]


CONFIG_SEPARATOR = "#"
"""Separates a class reference's entry point from its config JSON: `"module:Class#{...}"`."""


def load_env_class(reference: str) -> type[TextEnv]:
    """The `TextEnv` subclass named by `"module:Class"` (`Class` may be dotted), or by `"module:Class#<config
    JSON>"`: that class configured with the JSON's settings (the same class object on every call)."""
    entry_point, separator, config_json = reference.partition(CONFIG_SEPARATOR)
    cls = _import_env_class(entry_point)
    return configured_class(cls, config_json) if separator else cls


@functools.lru_cache(maxsize=None)
def configured_class(cls: type[TextEnv], config_json: str) -> type[TextEnv]:
    """`cls.configure(config)` for a canonical config JSON, made once; it remembers its own reference."""
    configured = cls.configure(json.loads(config_json))
    configured.class_reference = f"{cls.__module__}:{cls.__qualname__}{CONFIG_SEPARATOR}{config_json}"
    return configured


def canonical_json(config: Mapping[str, Any]) -> str:
    """The one JSON text of a config (sorted keys), so that equal configs share one configured class."""
    return json.dumps(config, sort_keys=True, separators=(",", ":"))


def import_object(entry_point: str) -> Any:
    """The object a `"module:attribute"` entry point names (the attribute may be dotted, `module:Class.method`);
    ImportError or AttributeError when it is not there."""
    module_name, attribute = split_entry_point(entry_point)
    found = importlib.import_module(module_name)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found


def _import_env_class(entry_point: str) -> type[TextEnv]:
    cls = import_object(entry_point)
    if not (isinstance(cls, type) and issubclass(cls, TextEnv)):
        raise TypeError(f"entry point {entry_point!r} is not a TextEnv subclass (from envservice import TextEnv)")
    return cls


@dataclass(frozen=True)
class Registration:
    """One registered environment: how to build it, its limits, and where the registration came from."""

    env_id: str
    """The id clients create sessions with."""
    entry_point: EntryPoint
    """`"module:Class"`, or the class itself."""
    step_limit: int | None = None
    """Steps per episode at most; None: the class's `max_steps`."""
    session_limit: int | None = None
    """Sessions of this env open at once at most; None: the class's `max_sessions`."""
    origin: str = "code"
    """Who registered it: `built-in`, `plugin <distribution>`, `--register`, `--env-config FILE` or `code`."""
    config: Mapping[str, Any] | None = None
    """Settings of a configurable class (`TextEnv.config_fields`); None: the class as it is."""

    def env_class(self) -> type[TextEnv]:
        """The `TextEnv` subclass (configured when the registration has a config), imported on first use."""
        try:
            cls = self.entry_point if not isinstance(self.entry_point, str) else load_env_class(self.entry_point)
            return cls if self.config is None else configured_class(cls, canonical_json(self.config))
        except Exception as exc:  # a missing or broken package: say which env and why, not a bare 500
            raise EnvServiceError(
                ErrorCode.env_error,
                f"env {self.env_id!r} cannot be loaded: importing or configuring {self.entry_point!r} failed with "
                f"{exc!r}; install the package it needs (README, 'Installing'), fix its config, or stop serving it "
                f"(registered by: {self.origin})",
            ) from exc

    @property
    def max_steps(self) -> int:
        """The step limit in force (the registration's, else the class's)."""
        return self.step_limit or self.env_class().max_steps

    @property
    def max_sessions(self) -> int:
        """The session limit in force (the registration's, else the class's)."""
        return self.session_limit or self.env_class().max_sessions

    def spec(self) -> EnvSpec:
        """The public description served by GET /envs."""
        cls = self.env_class()
        return EnvSpec(id=self.env_id, description=cls.description, tasks=cls.task_counts(),
                       max_steps=self.max_steps, max_sessions=self.max_sessions,
                       params={name: param_description(p) for name, p in cls.params.items()},
                       param_types={name: param_type_name(p) for name, p in cls.params.items()})


_REGISTRY: dict[str, Registration] = {}
_LOCK = threading.RLock()
_plugins_loaded = False


def register(env_id: str, entry_point: EntryPoint, *, max_steps: int | None = None, max_sessions: int | None = None,
             origin: str = "code", config: Mapping[str, Any] | None = None) -> Registration:
    """Register an environment id; re-registering an id is an error (call `unregister` first)."""
    for name, value in (("max_steps", max_steps), ("max_sessions", max_sessions)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{env_id!r}: {name} must be >= 1 (an int, or None for the class's), got {value!r}")
    if isinstance(entry_point, str):
        split_entry_point(entry_point)
    registration = Registration(env_id, entry_point, max_steps, max_sessions, origin,
                                None if config is None else dict(config))
    with _LOCK:
        if env_id in _REGISTRY:
            raise ValueError(f"environment id {env_id!r} is already registered ({_REGISTRY[env_id].origin})")
        _REGISTRY[env_id] = registration
    return registration


def unregister(env_id: str) -> None:
    """Remove a registration (tests register throw-away environments)."""
    with _LOCK:
        _REGISTRY.pop(env_id, None)


def registered_ids() -> list[str]:
    """All registered ids (built-in, plugins, code), sorted."""
    with _LOCK:
        _load_plugins()
        return sorted(_REGISTRY)


def get(env_id: str) -> Registration:
    """The registration of `env_id`; an unknown id is an `unknown_env` error listing the valid ids."""
    with _LOCK:
        _load_plugins()
        registration = _REGISTRY.get(env_id)
    if registration is None:
        raise EnvServiceError(
            ErrorCode.unknown_env, f"env_id={env_id!r} is not registered", valid_choices=registered_ids()
        )
    return registration


def make(env_id: str) -> TextEnv:
    """A new instance of the environment registered as `env_id`."""
    return get(env_id).env_class()()


def register_from_text(assignment: str) -> Registration:
    """`ID=module:Class` (the `--register` flag) registered; a malformed one names the expected form."""
    env_id, sep, entry_point = assignment.partition("=")
    if not sep or not env_id.strip():
        raise ValueError(f"--register {assignment!r}: expected ID=package.module:ClassName")
    return register(env_id.strip(), entry_point.strip(), origin="--register")


def split_entry_point(entry_point: str) -> tuple[str, str]:
    """(module, class) of a `"module:Class"` entry point; a malformed one names the expected form."""
    module_name, sep, class_name = entry_point.partition(":")
    if not sep or not module_name.strip() or not class_name.strip():
        raise ValueError(f"entry point {entry_point!r} must look like 'package.module:ClassName'")
    return module_name.strip(), class_name.strip()


def _load_plugins() -> None:
    """Register every `envservice.envs` entry point of the installed distributions, once (under _LOCK).

    A plugin never breaks the service: an id that is taken, or a malformed value, is logged and skipped.
    """
    global _plugins_loaded
    if _plugins_loaded:
        return
    _plugins_loaded = True
    for point in entry_points(group=ENTRY_POINT_GROUP):
        origin = f"plugin {point.dist.name if point.dist else point.value}"
        if point.name in _REGISTRY:
            logger.warning("envservice.envs entry point %r (%s) skipped: the id is already registered (%s)",
                           point.name, origin, _REGISTRY[point.name].origin)
            continue
        try:
            register(point.name, point.value, origin=origin)
        except ValueError as exc:
            logger.warning("envservice.envs entry point %r (%s) skipped: %s", point.name, origin, exc)


register("babyai", "envservice.envs.babyai:BabyAIEnv", max_steps=128, max_sessions=4096, origin="built-in")
register("textcraft", "envservice.envs.textcraft:TextCraftEnv", max_steps=64, max_sessions=1024, origin="built-in")
register("frozenlake", "envservice.envs.frozenlake:FrozenLakeEnv", max_steps=100, max_sessions=16384,
         origin="built-in")
register("sciworld", "envservice.envs.sciworld:ScienceWorldTextEnv", max_steps=100, max_sessions=64,
         origin="built-in")
register("textworld", "envservice.envs.textworld_env:TextWorldEnv", max_steps=100, max_sessions=1024,
         origin="built-in")
register("alfworld", "envservice.envs.alfworld_env:AlfWorldEnv", max_steps=50, max_sessions=1024, origin="built-in")
register("search", "envservice.envs.search:SearchQAEnv", max_steps=10, max_sessions=4096, origin="built-in")
register("appworld", "envservice.envs.appworld_env:AppWorldEnv", max_steps=50, max_sessions=64, origin="built-in")
register("code", "envservice.envs.code_env:CodeEnv", max_steps=16, max_sessions=256, origin="built-in")
register("terminal", "envservice.envs.terminal_env:TerminalEnv", max_steps=20, max_sessions=256, origin="built-in")
register("tictactoe", "envservice.envs.two_player:TicTacToeEnv", max_steps=40, max_sessions=16384,
         origin="built-in")
for _domain in ("retail", "airline"):
    register(f"tau2_{_domain}", "envservice.envs.tau2_env:Tau2Env", origin="built-in", config={"domain": _domain})
