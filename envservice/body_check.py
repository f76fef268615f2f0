"""The JSON check every request body passes before validation, and where it runs (`BodyChecker`).

The check (`refusal_reason`) refuses what Python's `json` would read other than the client meant — NaN or
Infinity, a key given twice (the last silently winning) — and objects wider than MAX_OBJECT_KEYS keys (30 000
bad `params` entries used to cost seconds of validation). It has to parse the body to know.

Where: parsing is synchronous and holds the interpreter; a 600 KB body of 30 000 entries takes ~30 ms, and 32
of them at once from one greedy client made every other client wait about a second a request. So a body over
LARGE_BODY_BYTES is checked in a helper process (the event loop only waits for the verdict), and one at a time
per client host, so that a host with many large bodies queues behind itself, not in front of the others; its
waiting bodies are not even read (uvicorn stops reading a connection whose body is not consumed).

How much: a host's large-body checks may keep the helper busy at most `large_body_share` of the time: a check
that took c CPU seconds makes that host's next large body wait c * (1/share - 1). Why: where the helper shares a
core with the service, its parsing delays the service's own work even at the lowest priority, so an honest
client's p99 grows with the share of the time the helper runs (a pinned soak's greedy phase with all three greedy
kinds, two runs each on one machine: 2.08x and 2.04x quiet at a 2 % share, 1.67x and 1.73x at 0.5 %). And a host
that sends bodies this costly is flooding, not acting: 30 000 entries take 12 ms to parse in the helper (without
the cycle collector; the next such body of that host then waits 2.4 s), the longest action the protocol allows
(100 000 characters) 0.07 ms, so at the default 0.5 % one host may still send ~70 of those a second; an LLM takes
seconds to write one. A body that passes the check is charged the same: costly valid JSON is parsed again by the
app, on the event loop.
"""

from __future__ import annotations

import asyncio
import gc
import json
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from envservice.errors import clip

MAX_OBJECT_KEYS = 256
"""The widest JSON object a request body may hold (the protocol's objects have a handful of keys)."""
LARGE_BODY_BYTES = 64 * 1024
"""Bodies over this size are checked in the helper process, one at a time per client host."""
LARGE_BODY_SHARE = 0.005
"""Default share of the time one client host's large-body checks may keep the helper busy (`--large-body-share`)."""
FORGET_AFTER_HOSTS = 1024
"""Past this many hosts with a pending wait, the hosts whose wait is over are forgotten."""


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


def timed_refusal_reason(body: bytes) -> tuple[str | None, float]:
    """`refusal_reason(body)` and the CPU seconds it took."""
    started = time.thread_time()
    reason = refusal_reason(body)
    return reason, time.thread_time() - started


class BodyChecker:
    """Runs `refusal_reason` on the event loop for small bodies and in one helper process for large ones.

    The helper is started on the first large body and stopped by `close()`; if it dies it is started again
    for the next one (the body at hand is then checked on the loop, so an answer is never lost).

    large_body_share: the share of the time one client host's large-body checks may keep the helper busy (module
    docstring); 0 for no limit.
    """

    def __init__(self, large_body_share: float = LARGE_BODY_SHARE) -> None:
        if not 0 <= large_body_share <= 1:
            raise ValueError(f"large_body_share {large_body_share!r} is invalid; give a fraction in [0, 1] "
                             "(0: no limit)")
        self.large_body_share = large_body_share
        self._pool: ProcessPoolExecutor | None = None
        self._host_turns: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # host -> (its turn, [holders + waiters])
        self._next_check_at: dict[str, float] = {}  # host -> loop time before which its next large body waits

    async def reason(self, body: bytes, host: str | None = None) -> str | None:
        """`refusal_reason(body)`, checked where its size says (module docstring); a large body's check is
        charged to `host` (its next large body waits, `turn`) when one is given."""
        if len(body) <= LARGE_BODY_BYTES:
            return refusal_reason(body)
        loop = asyncio.get_running_loop()
        try:
            reason, cpu_s = await loop.run_in_executor(self._helper(), timed_refusal_reason, body)
        except BrokenProcessPool:
            self._pool = None
            reason, cpu_s = timed_refusal_reason(body)
        if host is not None:
            self.charge(host, cpu_s, loop.time())
        return reason

    def charge(self, host: str, cpu_s: float, now: float) -> None:
        """Count a check of `cpu_s` CPU seconds, done at loop time `now`, against `host`'s share."""
        if not self.large_body_share:
            return
        if len(self._next_check_at) > FORGET_AFTER_HOSTS:
            self._next_check_at = {name: at for name, at in self._next_check_at.items() if at > now}
        self._next_check_at[host] = now + cpu_s * (1 / self.large_body_share - 1)

    @asynccontextmanager
    async def turn(self, host: str, content_length: int | None) -> AsyncIterator[None]:
        """Hold `host`'s one turn for a body over LARGE_BODY_BYTES or of unknown length (None: chunked), once the
        host's share allows it (read the body and check it inside, charging the check to `host`); others pass."""
        if content_length is not None and content_length <= LARGE_BODY_BYTES:
            yield
            return
        lock, users = self._host_turns.setdefault(host, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                await self._wait_for_share(host)
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._host_turns[host]

    async def _wait_for_share(self, host: str) -> None:
        loop = asyncio.get_running_loop()
        wait_s = self._next_check_at.get(host, 0.0) - loop.time()
        if wait_s > 0:
            await asyncio.sleep(wait_s)
        self._next_check_at.pop(host, None)

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
    collections, 15.9 s of a 30 s phase). It also ends itself once its service is gone, however the service
    ended (a SIGKILLed service once left its helper orphaned for 11 minutes)."""
    gc.disable()
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True, name="parent-watch").start()
    if hasattr(os, "SCHED_IDLE"):  # Linux
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    else:
        os.nice(19)


def _exit_with_parent(parent: int, interval_s: float = 0.5) -> None:
    """Exit this process as soon as `parent` is no longer its parent (it died: the process was re-parented).
    A watch rather than PR_SET_PDEATHSIG, which fires when the *thread* that started the helper ends."""
    while os.getppid() == parent:
        time.sleep(interval_s)
    os._exit(0)
