"""Config sections as dataclasses: the one way our YAML sections are read.

Each section of the recipe's config (`beyond_agent:`, `beyond_agent.env`, `beyond_agent.rounds`, ...) is a
frozen dataclass whose field defaults are the section's defaults, stated once; its `__post_init__` validates
the values. `from_section(cls, node, where)` builds one from the composed config: a key the YAML leaves out
takes the dataclass default, a key the dataclass does not have is refused with the valid ones (and, where the
class lists it in `MOVED_KEYS`, with where that key is now). A field typed with a section class is a
sub-section: its mapping is read by the same rules, recursively, and its errors name its full path
(`beyond_agent.rounds.every`), so one call reads a whole section tree into one typed object.
tests/trainer/test_config_schema_on_cpu.py checks that the shipped YAML states the same defaults.
"""

from __future__ import annotations

import types
import typing
from dataclasses import MISSING, fields, is_dataclass
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


def subsections(cls: type) -> dict[str, type]:
    """The keys of `cls` that are sections themselves (typed with a dataclass, alone or `| None`), with their
    classes, in declaration order."""
    hints = typing.get_type_hints(cls)
    found = {}
    for field in fields(cls):
        hint = hints.get(field.name)
        options = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
            else (hint,)
        kinds = [kind for kind in options if isinstance(kind, type) and is_dataclass(kind)]
        if field.init and len(kinds) == 1:
            found[field.name] = kinds[0]
    return found


def from_section(cls: type[T], node: Mapping[str, Any] | None, where: str) -> T:
    """`cls` built from the config section `node` (None or absent: every default), its sub-sections read the
    same way; `where` is the section's config path, named in errors. Raises ValueError on an unknown or a
    missing key, or a sub-section that is not a mapping."""
    values = dict(node or {})
    valid = section_keys(cls)
    unknown = sorted(set(values) - set(valid))
    if unknown:
        moved = getattr(cls, "MOVED_KEYS", {})
        now = [f"{key} is now {moved[key]}" for key in unknown if key in moved]
        raise ValueError(f"{where} has unknown key(s) {unknown}; valid keys: {', '.join(valid)}"
                         + (f" ({'; '.join(now)})" if now else ""))
    defaults = section_defaults(cls)
    missing = [key for key in valid if key not in values and key not in defaults]
    if missing:
        raise ValueError(f"{where}.{missing[0]} is required")
    hints = typing.get_type_hints(cls)
    for key, kind in subsections(cls).items():
        if key in values:
            admits_none = type(None) in typing.get_args(hints[key])
            values[key] = _subsection(kind, values[key], f"{where}.{key}", admits_none)
    return cls(**values)


def _subsection(kind: type, value: Any, where: str, admits_none: bool) -> Any:
    """A sub-section's value as its class: a mapping is read; null is every default (or None where the field
    is `X | None`); an object of the class is kept."""
    if isinstance(value, kind) or (value is None and admits_none):
        return value
    if value is not None and not isinstance(value, Mapping):
        raise ValueError(f"{where} must be a mapping of its keys ({', '.join(section_keys(kind))}), got {value!r}")
    return from_section(kind, value, where)
