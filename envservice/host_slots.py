"""Fair sharing of the event loop between client hosts: at most N requests of one host on the loop at once.

Why: the service parses, checks, validates and routes every request on its one event loop, one callback at a
time in arrival order. A host with many connections keeps as many requests in that queue, and another host's
request waits behind all of them at each of its steps: in a soak's greedy phase (bench/soak.py --service-cpus 0),
32 raw-socket connections from one host took an honest client's p99 latency from 2.1 to 32.6 ms (3.3 to 5.5 ms
with 4 slots per host). With at most `per_host` requests of a
host on the loop, that host's other requests wait unread (their connections' reading is paused, the bytes stay
in the kernel) and another host's request waits behind at most `per_host` of them.

A request holds its `LoopSlot` from its first byte until its answer starts, or until it hands its env call to
the thread pool (`release_loop_slot`, from the route), whichever comes first: an env call waits off the loop, so
a host's slow env steps never hold its slots, and a trainer with hundreds of sessions stepping at once is limited
only in how many of its requests are parsed at the same moment, which the one loop does one at a time anyway; an
answer that streams for a long time holds none either. Clients behind one proxy or NAT share one host's slots
(`--loop-slots-per-host 0` turns the limit off).
"""

from __future__ import annotations

import collections
import contextvars
from typing import Callable

LOOP_SLOTS_PER_HOST = 4
"""Default of `--loop-slots-per-host`."""
LOOP_SLOT_STATE = "envservice.loop_slot"
"""The key of a request's LoopSlot in its ASGI scope's "state" (put there by the connection layer)."""

_current_slot: contextvars.ContextVar[LoopSlot | None] = contextvars.ContextVar("envservice_loop_slot", default=None)


class LoopSlot:
    """One request's place on the event loop among its host's (`HostSlots`); given back at most once."""

    def __init__(self, slots: HostSlots, host: str) -> None:
        self._slots, self._host, self._held = slots, host, True

    def release(self) -> None:
        """Give the slot back (the host's next waiting request gets it); again is a no-op."""
        if self._held:
            self._held = False
            self._slots._give_back(self._host)


class HostSlots:
    """Per client host, `per_host` slots on the event loop; a request that finds none waits in its host's queue.

    `per_host` 0 means no limit (every request gets a slot at once, nothing is counted). Event-loop only: no lock.
    """

    def __init__(self, per_host: int) -> None:
        if per_host < 0:
            raise ValueError(f"loop slots per host must be >= 0 (0: no limit), got {per_host}")
        self.per_host = per_host
        self._held: collections.Counter[str] = collections.Counter()
        self._waiting: dict[str, collections.deque[Callable[[LoopSlot], None]]] = {}

    def take(self, host: str, when_free: Callable[[LoopSlot], None]) -> LoopSlot | None:
        """A slot now, or None: then `when_free(slot)` is called with one as soon as one of the host's slots frees
        (unless `cancel(host, when_free)` is called first)."""
        if not self.per_host:
            return LoopSlot(self, host)
        if self._held[host] < self.per_host and not self._waiting.get(host):
            self._held[host] += 1
            return LoopSlot(self, host)
        self._waiting.setdefault(host, collections.deque()).append(when_free)
        return None

    def cancel(self, host: str, when_free: Callable[[LoopSlot], None]) -> None:
        """Leave the host's queue (a waiting connection closed); no-op if not in it."""
        queue = self._waiting.get(host)
        if queue is not None and when_free in queue:
            queue.remove(when_free)
            if not queue:
                del self._waiting[host]

    def held(self, host: str) -> int:
        """Slots the host holds now."""
        return self._held[host]

    def waiting(self, host: str) -> int:
        """The host's requests waiting for a slot."""
        return len(self._waiting.get(host, ()))

    def _give_back(self, host: str) -> None:
        if not self.per_host:
            return
        queue = self._waiting.get(host)
        if queue:  # the slot passes straight to the host's next request
            when_free = queue.popleft()
            if not queue:
                del self._waiting[host]
            when_free(LoopSlot(self, host))
            return
        self._held[host] -= 1
        if not self._held[host]:
            del self._held[host]


def set_current_slot(slot: LoopSlot | None) -> None:
    """Make `slot` the current request's (called in the request's own task, so it is seen only there)."""
    _current_slot.set(slot)


def release_loop_slot() -> None:
    """Give back the current request's slot: called by a route just before its env call goes to the thread pool."""
    slot = _current_slot.get()
    if slot is not None:
        slot.release()
