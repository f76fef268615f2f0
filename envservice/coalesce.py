"""`Coalescer`: concurrent calls of many threads sent together, a few requests at a time.

The rollout steps each episode on its own thread through one shared `EnvClient`; at 1 000 episodes most of a
step's cost was the HTTP request around it (envservice/step_batch.py). A `Coalescer` turns the calls that
arrive while a request is out into one request: a calling thread whose item is waiting, when fewer than
`max_in_flight` requests are out, sends every waiting item (up to `max_items` and `max_bytes`) itself and hands
each item's outcome to its caller. No thread of its own: with no load, a call is sent at once by its own thread,
as a lone request would be; under load, the calls that queue behind the request out leave together.

A request out for longer than `hold_s` stops holding calls back: it is waiting for slow env steps (a browser, a
sandboxed command), not for the service's CPU, and the steps behind it should not wait for those. So batching
adds at most `hold_s` to any call, and a cheap env's calls, answered well within it, leave together.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, Sequence, TypeVar

T = TypeVar("T")


@dataclass
class _Waiting(Generic[T]):
    """One call: its item, its outcome once sent, and the event its thread waits on."""

    item: T
    size: int
    outcome: Any = None
    done: bool = False
    wake: threading.Event = field(default_factory=threading.Event)


class Coalescer(Generic[T]):
    """Sends items through `send(items) -> outcomes` (one outcome per item, in order; an outcome that is an
    exception is raised to that item's caller, and so is an exception `send` raises, to every caller of the batch).

    Args:
        send: sends one batch; called on a calling thread, never while the coalescer's lock is held.
        max_items: most items in one batch.
        max_bytes: most bytes in one batch, by the sizes `call` is given (an item larger alone goes alone).
        max_in_flight: batches out for less than `hold_s` at once; calls arriving meanwhile wait and leave together.
        hold_s: seconds a batch out holds the next calls back (module docstring).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, send: Callable[[list[T]], Sequence[Any]], max_items: int, max_bytes: int,
                 max_in_flight: int = 1, hold_s: float = 0.05, clock: Callable[[], float] = time.monotonic) -> None:
        if max_items < 1 or max_bytes < 1 or max_in_flight < 1 or not hold_s > 0:
            raise ValueError(f"max_items, max_bytes, max_in_flight must be >= 1 and hold_s > 0, got {max_items}, "
                             f"{max_bytes}, {max_in_flight}, {hold_s}")
        self._send, self.max_items, self.max_bytes = send, max_items, max_bytes
        self.max_in_flight, self.hold_s, self._clock = max_in_flight, hold_s, clock
        self._lock = threading.Lock()
        self._waiting: list[_Waiting[T]] = []
        self._sent_at: list[float] = []  # when each batch out was sent
        self.batches = 0
        """Batches sent so far."""
        self.items = 0
        """Items sent so far (items / batches: how many calls one request carried on average)."""

    def call(self, item: T, size: int = 1) -> Any:
        """Send `item` (of `size` bytes) with whatever else is waiting; its outcome, or raise its exception."""
        mine = _Waiting(item, size)
        with self._lock:
            self._waiting.append(mine)
        while True:
            with self._lock:
                if mine.done:
                    break
                held_for = self._held_for()
                batch, sent_at = self._take() if held_for == 0 else (None, 0.0)
                if batch is None:
                    mine.wake.clear()  # set again by a batch that answered `mine`, or ended and leaves room
            if batch is None:
                mine.wake.wait(held_for)  # None: until woken (`mine` was taken by another thread's batch)
            else:
                self._send_batch(batch, sent_at)
        if isinstance(mine.outcome, BaseException):
            raise mine.outcome
        return mine.outcome

    def __getstate__(self) -> dict[str, Any]:
        """Its settings only (a copy, e.g. in another process, starts with no call waiting or out)."""
        return {"send": self._send, "max_items": self.max_items, "max_bytes": self.max_bytes,
                "max_in_flight": self.max_in_flight, "hold_s": self.hold_s, "clock": self._clock}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(**state)  # type: ignore[misc]

    def pending(self) -> int:
        """Calls waiting to be sent."""
        with self._lock:
            return len(self._waiting)

    def _held_for(self) -> float | None:
        """(Lock held) 0 when a batch may leave now; else the seconds until the batches out stop holding it back,
        or None when nothing waits to be sent."""
        if not self._waiting:
            return None
        now = self._clock()
        holding = sorted(sent for sent in self._sent_at if now - sent < self.hold_s)
        if len(holding) < self.max_in_flight:
            return 0
        return holding[len(holding) - self.max_in_flight] + self.hold_s - now

    def _take(self) -> tuple[list[_Waiting[T]], float]:
        """(Lock held) the next batch, counted out, and when it was: the oldest waiting calls within both limits."""
        count, size = 1, self._waiting[0].size
        while count < min(len(self._waiting), self.max_items) and size + self._waiting[count].size <= self.max_bytes:
            size += self._waiting[count].size
            count += 1
        batch, self._waiting = self._waiting[:count], self._waiting[count:]
        sent_at = self._clock()
        self._sent_at.append(sent_at)
        self.batches += 1
        self.items += count
        return batch, sent_at

    def _send_batch(self, batch: list[_Waiting[T]], sent_at: float) -> None:
        outcomes: Sequence[Any] | None = None
        try:
            outcomes = self._send([waiting.item for waiting in batch])
            if len(outcomes) != len(batch):
                raise RuntimeError(f"a batch of {len(batch)} items got {len(outcomes)} outcomes")
        except Exception as exc:  # every caller of the batch gets it, not just the thread that sent it
            outcomes = [exc] * len(batch)
        finally:
            if outcomes is None:  # interrupted (KeyboardInterrupt): the others must not wait for ever
                outcomes = [RuntimeError("the thread sending this batch was interrupted")] * len(batch)
            self._answer(batch, outcomes, sent_at)

    def _answer(self, batch: list[_Waiting[T]], outcomes: Sequence[Any], sent_at: float) -> None:
        with self._lock:
            self._sent_at.remove(sent_at)
            # Room for one more batch: its oldest caller sends it, woken first, so that the next request leaves
            # before this batch's callers take the interpreter (the service would wait for it meanwhile).
            if self._waiting:
                self._waiting[0].wake.set()
            for waiting, outcome in zip(batch, outcomes):
                waiting.outcome, waiting.done = outcome, True
                waiting.wake.set()
