"""Fair sharing of the event loop between client hosts: at most N requests of one host on the loop at once, and a
heavy host makes room for a light host while that one is active.

Why: the service parses, checks, validates and routes every request on its one event loop, one callback at a
time in arrival order. A host with many connections keeps as many requests in that queue, and another host's
request waits behind all of them at each of its steps: in a soak's greedy phase (bench/soak.py --service-cpus 0),
32 raw-socket connections from one host took an honest client's p99 latency from 2.1 to 32.6 ms. Three rules:

- **Slots.** With at most `per_host` requests of a host on the loop, that host's other requests wait unread (their
  connections' reading is paused, the bytes stay in the kernel), so another host's request waits behind at most
  `per_host` of them. Alone this left a flood of cheap requests at 3.3x quiet: while one host keeps the loop busy
  without a pause, a light host's request still waits at each of its steps, the env call's hand-over to a pool
  thread and back included.
- **One slot beside a light host.** A *light* host has at most `per_host` requests in progress or waiting (an
  interactive client, an evaluator, a health probe). While a light host with fewer requests than a heavier host
  started one less than SHARING_WINDOW_S ago, the heavier host gets one slot on the loop, not `per_host`.
- **Giving way.** While such a light host has a request in progress that started less than `give_way_s` ago, the
  heavier host's next request waits until it is answered, `give_way_s` at most. The loop then runs dry of the heavy
  host's work while the light host's request is served, and the heavy host loses at most `give_way_s` per request.

A trainer alone, or heavy hosts side by side (each with more than `per_host` requests), are never held back by the
last two rules. A request holds its `LoopSlot` on the loop from its first byte until its answer starts, or until it
hands its env call to the thread pool (`release_loop_slot`, from the route), whichever comes first: an env call
waits off the loop, so a host's slow env steps never hold its slots. It stays in progress (`LoopSlot.close`) until
its answer has gone out. Clients behind one proxy or NAT are one host (`--loop-slots-per-host 0` turns all three
rules off).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import math
from dataclasses import dataclass
from typing import Any, Callable

LOOP_SLOTS_PER_HOST = 4
"""Default of `--loop-slots-per-host`."""
GIVE_WAY_S = 0.002
"""How long, at most, a heavier host's request waits for a light host's request in progress."""
SHARING_WINDOW_S = 0.1
"""A light host that started a request less than this ago holds a heavier host to one slot."""
FORGET_AFTER_HOSTS = 64
"""Past this many hosts remembered, those not heard from within SHARING_WINDOW_S are forgotten."""
LOOP_SLOT_STATE = "envservice.loop_slot"
"""The key of a request's LoopSlot in its ASGI scope's "state" (put there by the connection layer)."""

_current_slot: contextvars.ContextVar[LoopSlot | None] = contextvars.ContextVar("envservice_loop_slot", default=None)


class LoopSlot:
    """One request's place among its host's (`HostSlots`): on the loop until `release`, in progress until `close`."""

    def __init__(self, slots: HostSlots, host: str) -> None:
        self._slots, self._host, self._on_loop, self._open = slots, host, True, True

    def release(self) -> None:
        """Leave the loop (the env call goes to the pool, or the answer starts); again is a no-op."""
        if self._on_loop:
            self._on_loop = False
            self._slots._left_loop(self._host)

    def close(self) -> None:
        """The request is over (its answer went out, or its connection closed); again is a no-op."""
        self.release()
        if self._open:
            self._open = False
            self._slots._finished(self._host)


@dataclass
class _Waiter:
    """A request waiting for a slot: who to call with it, and since when it gives way (None: it does not yet)."""

    when_free: Callable[[LoopSlot], None]
    giving_way_since: float | None = None


class HostSlots:
    """Per client host, slots on the event loop under the module's three rules; a request that may not start yet
    waits in its host's queue (first come, first served within a host).

    `per_host` 0 means no limit (every request gets a slot at once, nothing is counted); `give_way_s` 0 turns the
    two rules for light hosts off. Event-loop only: no lock. `clock` and `call_later` default to the running
    loop's (tests pass their own)."""

    def __init__(self, per_host: int, give_way_s: float = GIVE_WAY_S, clock: Callable[[], float] | None = None,
                 call_later: Callable[[float, Callable[[], None]], Any] | None = None) -> None:
        if per_host < 0:
            raise ValueError(f"loop slots per host must be >= 0 (0: no limit), got {per_host}")
        if give_way_s < 0:
            raise ValueError(f"give_way_s must be >= 0 (0: never give way), got {give_way_s}")
        self.per_host, self.give_way_s = per_host, give_way_s
        self._clock, self._call_later = clock, call_later
        self._on_loop: collections.Counter[str] = collections.Counter()
        self._in_progress: collections.Counter[str] = collections.Counter()
        self._last_start: dict[str, float] = {}
        self._waiting: dict[str, collections.deque[_Waiter]] = {}
        self._timer: Any = None
        self._timer_due = 0.0

    def take(self, host: str, when_free: Callable[[LoopSlot], None]) -> LoopSlot | None:
        """A slot now, or None: then `when_free(slot)` is called with one as soon as the host may go on
        (unless `cancel(host, when_free)` is called first)."""
        if not self.per_host:
            return LoopSlot(self, host)
        now, waiter = self._now(), _Waiter(when_free)
        if not self._waiting.get(host) and self._wait_until(host, waiter, now) is None:
            return self._start(host, now)
        self._waiting.setdefault(host, collections.deque()).append(waiter)
        if self._on_loop[host] < self.per_host:  # held back by a light host: look again soon (never from here)
            self._look_again_at(now, now)
        return None

    def cancel(self, host: str, when_free: Callable[[LoopSlot], None]) -> None:
        """Leave the host's queue (a waiting connection closed); no-op if not in it."""
        queue = self._waiting.get(host)
        if queue is None:
            return
        for waiter in queue:
            if waiter.when_free == when_free:
                queue.remove(waiter)
                break
        if not queue:
            del self._waiting[host]

    def held(self, host: str) -> int:
        """The host's requests on the loop now."""
        return self._on_loop[host]

    def in_progress(self, host: str) -> int:
        """The host's requests that got a slot and are not answered yet."""
        return self._in_progress[host]

    def waiting(self, host: str) -> int:
        """The host's requests waiting for a slot."""
        return len(self._waiting.get(host, ()))

    # ---- the rules -----------------------------------------------------------------------------------

    def _load(self, host: str) -> int:
        return self._in_progress[host] + len(self._waiting.get(host, ()))

    def _held_back(self, host: str, now: float) -> tuple[float | None, bool]:
        """How lighter light hosts (load at most per_host) hold `host` back now, in one pass over the hosts: until
        when it has one slot (None: it has per_host), and whether it gives way to a request of theirs in progress
        that started less than give_way_s ago."""
        if not self.give_way_s:
            return None, False
        load, one_slot_until, gives_way = self._load(host), None, False
        for other, started in self._last_start.items():
            other_load = self._load(other)
            if other == host or not other_load < load or other_load > self.per_host:
                continue
            if now - started < SHARING_WINDOW_S and self.per_host > 1:
                one_slot_until = max(one_slot_until or 0.0, started + SHARING_WINDOW_S)
            if now - started < self.give_way_s and self._in_progress[other]:
                gives_way = True
        return one_slot_until, gives_way

    def _wait_until(self, host: str, head: _Waiter, now: float) -> float | None:
        """None if the host's first waiting request `head` may start now; else when to look again (math.inf: when
        one of the host's requests leaves the loop). Marks when `head` began to give way."""
        one_slot_until, gives_way = self._held_back(host, now)
        if self._on_loop[host] >= (self.per_host if one_slot_until is None else 1):
            return one_slot_until if one_slot_until is not None and self._on_loop[host] < self.per_host else math.inf
        if gives_way:
            if head.giving_way_since is None:
                head.giving_way_since = now
            if now - head.giving_way_since < self.give_way_s:
                return head.giving_way_since + self.give_way_s
        return None

    # ---- bookkeeping ---------------------------------------------------------------------------------

    def _start(self, host: str, now: float) -> LoopSlot:
        self._on_loop[host] += 1
        self._in_progress[host] += 1
        self._last_start[host] = now
        if len(self._last_start) > FORGET_AFTER_HOSTS:
            self._last_start = {name: at for name, at in self._last_start.items()
                                if now - at < SHARING_WINDOW_S or self._in_progress[name]}
        return LoopSlot(self, host)

    def _left_loop(self, host: str) -> None:
        self._count_down(self._on_loop, host)

    def _finished(self, host: str) -> None:
        self._count_down(self._in_progress, host)

    def _count_down(self, counter: collections.Counter[str], host: str) -> None:
        """One less of `host`'s in `counter` (forgotten at 0), then let waiting requests start if they may."""
        if not self.per_host:
            return
        counter[host] -= 1
        if not counter[host]:
            del counter[host]
        self._admit()

    def _admit(self) -> None:
        """Start waiting requests while their hosts have room, lightest host first. A host's first waiter gives
        way for give_way_s at most from when it first had to; a timer looks again when that time is up, or when a
        host held to one slot gets its others back."""
        if not self._waiting:  # the common case: nobody waits
            return
        now, next_look = self._now(), None
        for host in sorted(self._waiting, key=self._load):
            queue = self._waiting[host]
            while queue:
                wait_until = self._wait_until(host, queue[0], now)
                if wait_until is not None:
                    if wait_until != math.inf:
                        next_look = wait_until if next_look is None else min(next_look, wait_until)
                    break
                head = queue.popleft()
                head.when_free(self._start(host, now))
            if not queue:
                del self._waiting[host]
        if next_look is not None:
            self._look_again_at(next_look, now)

    def _look_again_at(self, when: float, now: float) -> None:
        """Run `_admit` at `when` (one timer for all hosts, at the earliest time asked for)."""
        if self._timer is not None:
            if self._timer_due <= when:
                return
            self._timer.cancel()
        call_later = self._call_later or asyncio.get_running_loop().call_later
        self._timer, self._timer_due = call_later(max(0.0, when - now), self._timer_fired), when

    def _timer_fired(self) -> None:
        self._timer = None
        self._admit()

    def _now(self) -> float:
        return self._clock() if self._clock is not None else asyncio.get_running_loop().time()


def set_current_slot(slot: LoopSlot | None) -> None:
    """Make `slot` the current request's (called in the request's own task, so it is seen only there)."""
    _current_slot.set(slot)


def release_loop_slot() -> None:
    """Leave the loop with the current request's slot: called by a route just before its env call goes to the
    thread pool."""
    slot = _current_slot.get()
    if slot is not None:
        slot.release()
