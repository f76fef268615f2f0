"""Plain data across a pipe: built-in values only, one JSON message per line, bounded before it is parsed.

A value is encoded as JSON with tags for what JSON lacks: a list is a JSON array, and a tuple, dict, set,
frozenset, bytes, complex or non-finite float is an object with one key naming the type (`{"tuple": [...]}`,
`{"dict": [[key, value], ...]}`, `{"float": "nan"}`), so every JSON object in a value is a tag. Decoding builds
only None, bool, int, float, str, bytes, complex, list, tuple, dict, set and frozenset: whatever the other side
wrote, what comes out compares with Python's own equality (2 == 2.0 still holds) and nothing else.

Imported by both sides of a HumanEval check (the candidate's and the checker's sandboxed processes) and by the
service; it imports only the standard library.
"""

from __future__ import annotations

import json
import math
import os
import select
import time
from typing import Any

MAX_MESSAGE_BYTES = 1 << 20
"""Longest message line read (a HumanEval value is a few hundred bytes); longer is refused unread."""
MAX_DEPTH = 100
"""Deepest nesting of containers a value may have."""

_TAGS = ("tuple", "dict", "set", "frozenset", "bytes", "complex", "float")
_NON_FINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


class NotPlain(ValueError):
    """A value, or a message, that is not plain data."""


def encode(value: Any, depth: int = 0) -> Any:
    """`value` as a JSON-ready tree (tags for what JSON lacks); NotPlain for anything that is not plain data."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, (bool, str)):
        return str.__str__(value) if isinstance(value, str) else value
    if isinstance(value, int):
        return int.__index__(value)
    if isinstance(value, float):
        number = float.__float__(value)
        return number if math.isfinite(number) else {"float": repr(number)}
    if isinstance(value, list):
        return [encode(item, depth + 1) for item in value]
    if isinstance(value, dict):
        return {"dict": [[encode(key, depth + 1), encode(item, depth + 1)] for key, item in value.items()]}
    for kind in (tuple, frozenset, set):  # frozenset before set: neither is the other's subclass, order for clarity
        if isinstance(value, kind):
            return {kind.__name__: [encode(item, depth + 1) for item in value]}
    if isinstance(value, bytes):
        return {"bytes": bytes(value).hex()}
    if isinstance(value, complex):
        return {"complex": [encode(value.real, depth + 1), encode(value.imag, depth + 1)]}
    raise NotPlain(f"a {type(value).__name__} is not plain data")


def decode(tree: Any, depth: int = 0) -> Any:
    """The built-in value a JSON tree from `encode` stands for; NotPlain for anything else."""
    if depth > MAX_DEPTH:
        raise NotPlain(f"nested deeper than {MAX_DEPTH}")
    if tree is None or type(tree) in (bool, int, float, str):
        return tree
    if type(tree) is list:
        return [decode(item, depth + 1) for item in tree]
    if type(tree) is not dict or len(tree) != 1 or next(iter(tree)) not in _TAGS:
        raise NotPlain(f"not a value: {_clip(tree)}")
    tag, body = next(iter(tree.items()))
    try:
        return _decode_tagged(tag, body, depth)
    except (TypeError, ValueError) as error:  # an unhashable key or member, bad hex, a bad float name
        raise NotPlain(f"bad {tag}: {error}") from None


def _decode_tagged(tag: str, body: Any, depth: int) -> Any:
    if tag == "float":
        if body not in _NON_FINITE:
            raise NotPlain(f"bad float {_clip(body)}")
        return _NON_FINITE[body]
    if tag == "bytes":
        if type(body) is not str:
            raise NotPlain("bytes must be hex text")
        return bytes.fromhex(body)
    if type(body) is not list:
        raise NotPlain(f"a {tag} must hold a list")
    items = [decode(item, depth + 1) for item in body]
    if tag == "complex":
        if len(items) != 2 or not all(type(part) in (int, float) for part in items):
            raise NotPlain("a complex must hold two numbers")
        return complex(items[0], items[1])
    if tag == "dict":
        if not all(type(pair) is list and len(pair) == 2 for pair in items):
            raise NotPlain("a dict must hold [key, value] pairs")
        return {key: value for key, value in items}
    return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)


def dumps(message: dict[str, Any]) -> bytes:
    """One message line: a JSON object (its values already encoded) and a newline."""
    return json.dumps(message, allow_nan=False, separators=(",", ":")).encode() + b"\n"


def loads(line: bytes) -> dict[str, Any]:
    """A message line's JSON object; NotPlain for anything else (too long, too deep, not JSON, not an object)."""
    if len(line) > MAX_MESSAGE_BYTES:
        raise NotPlain(f"a message of {len(line)} bytes, over {MAX_MESSAGE_BYTES}")
    try:
        message = json.loads(line)
    except (ValueError, RecursionError) as error:  # RecursionError: deep nesting; ValueError: huge ints too
        raise NotPlain(f"not JSON: {type(error).__name__}") from None
    if type(message) is not dict:
        raise NotPlain("a message must be a JSON object")
    return message


class LineReader:
    """Reads message lines from a file descriptor, each within a deadline and `MAX_MESSAGE_BYTES`."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = b""

    def read(self, deadline: float) -> bytes | None:
        """The next line (without its newline); None at end of stream. TimeoutError past `deadline`
        (time.monotonic()), NotPlain past the size bound."""
        while b"\n" not in self._buffer:
            if len(self._buffer) > MAX_MESSAGE_BYTES:
                raise NotPlain(f"a message longer than {MAX_MESSAGE_BYTES} bytes")
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self.fd], [], [], remaining)[0]:
                raise TimeoutError("no answer in time")
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line


def write_all(fd: int, data: bytes, deadline: float) -> None:
    """Write `data` to a pipe, each part within `deadline`: a peer that stops reading cannot block us for ever.
    TimeoutError past it; BrokenPipeError when the reader is gone."""
    view = memoryview(data)
    while view:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([], [fd], [], remaining)[1]:
            raise TimeoutError("the other side does not read")
        view = view[os.write(fd, view[:1 << 16]):]


def _clip(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
