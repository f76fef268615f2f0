"""The JSON check every request body passes before validation, and where it runs (`BodyChecker`).

The check (`refusal_reason`) refuses what Python's `json` would read other than the client meant — NaN or
Infinity, a key given twice (the last silently winning) — and objects wider than MAX_OBJECT_KEYS keys (30 000
bad `params` entries used to cost seconds of validation). It has to parse the body to know.

Where: parsing is synchronous and holds the interpreter; a 600 KB body of 30 000 entries takes ~30 ms, and 32
of them at once from one greedy client made every other client wait about a second a request. So a body over
LARGE_BODY_BYTES is checked in a helper process (the event loop only waits for the verdict), and one at a time
per client host, so that a host with many large bodies queues behind itself, not in front of the others; its
waiting bodies are not even read (uvicorn stops reading a connection whose body is not consumed).
"""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from envservice.errors import clip

MAX_OBJECT_KEYS = 256
"""The widest JSON object a request body may hold (the protocol's objects have a handful of keys)."""
LARGE_BODY_BYTES = 64 * 1024
"""Bodies over this size are checked in the helper process, one at a time per client host."""


class _Refused(ValueError):
    """A JSON body refused before validation: read by Python but not as the client meant it, or too wide."""


def _refuse_constant(name: str) -> None:
    raise _Refused(f"the body holds {name}, which is not JSON (RFC 8259 has no NaN or Infinity)")


def _checked_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len(pairs) > MAX_OBJECT_KEYS:
        raise _Refused(f"an object of the body has {len(pairs)} keys; the protocol's objects have at most "
                       f"{MAX_OBJECT_KEYS}")
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        twice = sorted({key for key in keys if keys.count(key) > 1})
        raise _Refused(f"the body gives the key(s) {clip(repr(twice), 200)} more than once in one object")
    return dict(pairs)


def refusal_reason(body: bytes) -> str | None:
    """Why this body is refused before validation, or None (a body that is not JSON at all is left to the app's
    validation, which names the fault)."""
    if not body:
        return None
    try:
        json.loads(body, parse_constant=_refuse_constant, object_pairs_hook=_checked_object)
    except _Refused as error:
        return str(error)
    except (ValueError, RecursionError):
        return None
    return None


class BodyChecker:
    """Runs `refusal_reason` on the event loop for small bodies and in one helper process for large ones.

    The helper is started on the first large body and stopped by `close()`; if it dies it is started again
    for the next one (the body at hand is then checked on the loop, so an answer is never lost).
    """

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None
        self._host_turns: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # host -> (its turn, [holders + waiters])

    async def reason(self, body: bytes) -> str | None:
        """`refusal_reason(body)`, checked where its size says (module docstring)."""
        if len(body) <= LARGE_BODY_BYTES:
            return refusal_reason(body)
        try:
            return await asyncio.get_running_loop().run_in_executor(self._helper(), refusal_reason, body)
        except BrokenProcessPool:
            self._pool = None
            return refusal_reason(body)

    @asynccontextmanager
    async def turn(self, host: str, content_length: int) -> AsyncIterator[None]:
        """Hold `host`'s one turn for a body over LARGE_BODY_BYTES (read it and check it inside); others pass."""
        if content_length <= LARGE_BODY_BYTES:
            yield
            return
        lock, users = self._host_turns.setdefault(host, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._host_turns[host]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def _helper(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # spawn: a fresh interpreter that imports only this module, never a fork of a threaded server
            self._pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_helper_started)
        return self._pool


def _helper_started() -> None:
    """The helper process's settings: it runs only when nothing else wants the core, and without the cyclic
    garbage collector.

    Why: checking is bulk work the service's event loop must not wait behind where they share a core (at nice 10
    a soak's greedy phase still saw it take the core from the loop; SCHED_IDLE yields at once to any other
    task), and the parse results hold no reference cycles (reference counting frees them), while the collector's
    passes over the objects of 30 000-entry bodies were most of the helper's time (a soak's greedy phase: 732 full
    collections, 15.9 s of a 30 s phase)."""
    gc.disable()
    if hasattr(os, "SCHED_IDLE"):  # Linux
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19)
