"""Config sections as dataclasses: the one way our YAML sections are read.

Each section of the recipe's config (`beyond_agent:`, `beyond_agent.env`, `beyond_agent.async_rollout`, ...)
is a frozen dataclass whose field defaults are the section's defaults, stated once; its `__post_init__`
validates the values. `from_section(cls, node, where)` builds one from the composed config: a key the YAML
leaves out takes the dataclass default, a key the dataclass does not have is refused with the valid ones.
tests/trainer/test_config_schema_on_cpu.py checks that the shipped YAML states the same defaults.
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any, Mapping, TypeVar

T = TypeVar("T")


def section_keys(cls: type) -> tuple[str, ...]:
    """The keys a section of type `cls` accepts, in declaration order."""
    return tuple(field.name for field in fields(cls) if field.init)


def section_defaults(cls: type) -> dict[str, Any]:
    """The default of every key that has one (a key without one must be given)."""
    found = {}
    for field in fields(cls):
        if field.init and field.default is not MISSING:
            found[field.name] = field.default
        elif field.init and field.default_factory is not MISSING:
            found[field.name] = field.default_factory()
    return found


def from_section(cls: type[T], node: Mapping[str, Any] | None, where: str) -> T:
    """`cls` built from the config section `node` (None or absent: every default); `where` is the section's
    config path, named in errors. Raises ValueError on an unknown or a missing key."""
    values = dict(node or {})
    valid = section_keys(cls)
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {unknown}; valid keys: {', '.join(valid)}")
    defaults = section_defaults(cls)
    missing = [key for key in valid if key not in values and key not in defaults]
    if missing:
        raise ValueError(f"{where}.{missing[0]} is required")
    return cls(**values)
