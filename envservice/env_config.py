"""Environments declared in a YAML file instead of code: `python -m envservice --env-config envs.yaml`.

Each top-level key is an env id; its entry names a class (`kind:` for the shipped configurable ones, or
`class: module:Class` for any `TextEnv`) and the class's settings:

    webshop:                         # a WebShop server of AgentGym's, already running
      kind: agentgym
      config: {url: "http://127.0.0.1:36001", env_type: webshop, splits: {train: "0:6000", test: "6000:6500"}}
      max_steps: 10                  # optional: the registration's step and session limits
      max_sessions: 64
    frozenlake8:                     # any Gymnasium env with text observations, no code
      kind: gymnasium
      config: {gym_id: FrozenLake-v1, make_kwargs: {map_name: 8x8}, action_names: [left, down, right, up]}

String values may name environment variables: `$NAME`, `${NAME}` or `${NAME:-default}` (the launcher
passes `.env`'s values on), e.g. `url: ${WEBSHOP_URL:-http://127.0.0.1:36001}`; an unset one with no default
is an error naming it.

Every entry is checked when the file is read (the class imported, its config validated), so a typo stops
the service at start-up with a message naming the file, the env id and the field, never at the first
episode.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Mapping

import yaml

from envservice import registry

KINDS: Mapping[str, str] = {
    "agentgym": "envservice.remote.agentgym:AgentGymEnv",
    "openenv": "envservice.remote.openenv_env:OpenEnvEnv",
    "gymnasium": "envservice.envs.gymnasium_text:GymnasiumTextEnv",
    "mcp": "envservice.remote.mcp_env:MCPEnv",
}
"""The configurable classes an entry can name by `kind:` (else it names `class: module:Class`)."""

ENTRY_KEYS = ("kind", "class", "config", "max_steps", "max_sessions")
"""The keys an env entry may have."""


VARIABLE = re.compile(r"\$(?:\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}|([A-Za-z_][A-Za-z0-9_]*))")
"""`$NAME`, `${NAME}` or `${NAME:-default}` in a string value."""


def expand_variables(text: str, variables: Mapping[str, str], strict: bool = False) -> str:
    """`text` with `$NAME`, `${NAME}` and `${NAME:-default}` replaced from `variables` (an unset or empty name
    takes its default). An unset name with no default becomes empty, or with `strict` raises `KeyError(name)`."""
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(3)
        if variables.get(name):
            return variables[name]
        if match.group(2) is not None:
            return match.group(2)
        if strict:
            raise KeyError(name)
        return ""

    return VARIABLE.sub(value, text)


def _expanded(value: Any, where: str) -> Any:
    """A config value with environment variables expanded in every string inside it."""
    if isinstance(value, str):
        try:
            return expand_variables(value, os.environ, strict=True)
        except KeyError as exc:
            raise EnvConfigError(f"{where}: ${{{exc.args[0]}}} is not set; set it (e.g. in .env) or give a "
                                 f"default: ${{{exc.args[0]}:-value}}") from None
    if isinstance(value, dict):
        return {key: _expanded(item, f"{where}.{key}") for key, item in value.items()}
    if isinstance(value, list):
        return [_expanded(item, f"{where}[{index}]") for index, item in enumerate(value)]
    return value


class EnvConfigError(ValueError):
    """The env-config file is wrong; the message names the file, the env id and the field."""


def load_env_config(path: str | Path) -> list[registry.Registration]:
    """Register every env of the YAML file at `path` and return the registrations, in file order.

    Raises `EnvConfigError` (naming the file, env id and field) for a file that cannot be read, an unknown
    key or kind, a class that cannot be imported, a bad config, or an id that is registered already.
    """
    path = Path(path)
    entries = _read_mapping(path)
    registrations = []
    for env_id, entry in entries.items():
        registrations.append(_register_entry(path, str(env_id), entry))
    return registrations


def _read_mapping(path: Path) -> dict[str, Any]:
    """The file's top-level mapping of env id -> entry."""
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise EnvConfigError(f"--env-config {path}: cannot read it ({exc.strerror or exc})") from None
    except yaml.YAMLError as exc:
        raise EnvConfigError(f"--env-config {path}: not valid YAML ({exc})") from None
    if not isinstance(data, dict) or not data:
        raise EnvConfigError(f"--env-config {path}: expected a mapping of env ids to entries "
                             f"({{kind|class, config, max_steps, max_sessions}}), got {type(data).__name__}")
    return data


def _register_entry(path: Path, env_id: str, entry: Any) -> registry.Registration:
    """Check one entry, register it, and build its configured class once to validate the config."""
    where = f"--env-config {path}: {env_id}"
    if not isinstance(entry, dict):
        raise EnvConfigError(f"{where}: expected a mapping with keys {', '.join(ENTRY_KEYS)}, got {entry!r}")
    unknown = sorted(set(entry) - set(ENTRY_KEYS))
    if unknown:
        raise EnvConfigError(f"{where}: unknown key(s) {unknown}; valid keys: {', '.join(ENTRY_KEYS)}")
    entry_point = _entry_point(where, entry)
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise EnvConfigError(f"{where}.config: expected a mapping of settings, got {config!r}")
    config = _expanded(config, f"{where}.config")
    try:
        registration = registry.register(env_id, entry_point, max_steps=entry.get("max_steps"),
                                         max_sessions=entry.get("max_sessions"), origin=f"--env-config {path}",
                                         config=config)
    except ValueError as exc:
        raise EnvConfigError(f"{where}: {exc}") from None
    try:
        registration.env_class()
    except Exception as exc:  # the import failed or the class refused the config: name the entry, then unregister
        registry.unregister(env_id)
        cause = exc.__cause__ if isinstance(exc.__cause__, ValueError) else exc
        raise EnvConfigError(f"{where}: {cause}") from None
    return registration


def _entry_point(where: str, entry: Mapping[str, Any]) -> str:
    """The `module:Class` an entry names through `kind:` or `class:` (exactly one of them)."""
    kind, class_path = entry.get("kind"), entry.get("class")
    if (kind is None) == (class_path is None):
        raise EnvConfigError(f"{where}: give exactly one of `kind:` ({', '.join(KINDS)}) or `class: module:Class`")
    if kind is not None:
        if kind not in KINDS:
            raise EnvConfigError(f"{where}.kind: {kind!r} is unknown; valid kinds: {', '.join(KINDS)}")
        return KINDS[kind]
    return str(class_path)
