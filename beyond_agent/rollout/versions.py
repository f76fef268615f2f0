"""Policy versions for asynchronous rollout: which weights produced each generated turn.

In async mode episodes are played while the actor trains, and the trainer pushes new weights to the
rollout server between steps. `PolicyVersionGate` makes that push happen between generation requests,
never inside one, so every generated token has exactly one policy version:

- every `generate` call goes through `gate.request()`, which waits while an update is in progress and
  tags the turn with the version it was sampled with;
- `gate.updating(version)` (the trainer's weight sync) stops new requests, waits until the requests in
  flight have finished, lets the sync run, then publishes the new version;
- with `partial_rollout=False`, an episode is the unit instead: `gate.episode()` is held for the whole
  episode, and an update first waits for every running episode to finish on the old weights (and keeps
  new episodes from starting meanwhile). With `partial_rollout=True` an episode that spans an update
  simply continues on the new weights; its turns record both versions.

Version numbers are verl's global steps: the weights after training step t are version t, the initial
weights version 0.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

from beyond_agent.rollout.episode_loop import GeneratedTurn, GenerateFn


@dataclass
class VersionedTurn:
    """A generated turn plus the policy version of the weights that sampled every one of its tokens."""

    token_ids: list[int]
    logprobs: list[float] | None
    policy_version: int
    """verl global step whose weights produced this turn (0: the initial weights)."""


class PolicyVersionGate:
    """Serialises weight updates against generation (see the module docstring). Thread-safe."""

    def __init__(self, version: int = 0, partial_rollout: bool = True):
        self.partial_rollout = partial_rollout
        """True: an update waits for requests in flight; False: it waits for whole episodes."""
        self._version = version
        self._condition = threading.Condition()
        self._updating = False  # an update is pending or running
        self._syncing = False  # generation has drained and the weights are being replaced
        self._requests = 0
        self._episodes = 0
        self._observers = threading.local()  # per thread: who is told each request's version (`observing`)
        self.update_wait_s = 0.0
        """Seconds updates spent waiting for generation to drain, summed (reset by `take_update_wait`)."""

    @property
    def version(self) -> int:
        """The version of the weights the server holds now."""
        with self._condition:
            return self._version

    @contextmanager
    def request(self) -> Iterator[int]:
        """Hold one generation request; yields the version it runs on."""
        with self._condition:
            # Partial rollout: a pending update stops new requests at once. Whole episodes: a running episode
            # must be able to finish (the update waits for it), so only the sync itself stops its requests.
            self._condition.wait_for(lambda: not (self._syncing if not self.partial_rollout else self._updating))
            self._requests += 1
            version = self._version
        observer = getattr(self._observers, "observer", None)
        if observer is not None:  # told outside the gate's lock: the observer may take its own
            observer(version)
        try:
            yield version
        finally:
            with self._condition:
                self._requests -= 1
                self._condition.notify_all()

    @contextmanager
    def observing(self, observer: Callable[[int], None]) -> Iterator[None]:
        """Tell `observer` the version of every request this thread makes meanwhile (an episode's turns: the
        async pool learns which version a running episode sampled with, before it ends)."""
        previous = getattr(self._observers, "observer", None)
        self._observers.observer = observer
        try:
            yield
        finally:
            self._observers.observer = previous

    @contextmanager
    def episode(self) -> Iterator[None]:
        """Hold one episode (only counted when `partial_rollout` is False: then updates wait for it)."""
        if self.partial_rollout:
            yield
            return
        with self._condition:
            self._condition.wait_for(lambda: not self._updating)
            self._episodes += 1
        try:
            yield
        finally:
            with self._condition:
                self._episodes -= 1
                self._condition.notify_all()

    @contextmanager
    def updating(self, new_version: int) -> Iterator[None]:
        """Run a weight update: drain generation, run the body, publish `new_version` (even if it failed,
        the server may hold new weights; a failed sync fails the training step anyway)."""
        started = time.monotonic()
        with self._condition:
            self._condition.wait_for(lambda: not self._updating)
            self._updating = True
            self._condition.wait_for(lambda: self._requests == 0 and self._episodes == 0)
            self._syncing = True
            self.update_wait_s += time.monotonic() - started
        try:
            yield
        finally:
            with self._condition:
                self._version = new_version
                self._updating = self._syncing = False
                self._condition.notify_all()

    def take_update_wait(self) -> float:
        """Seconds updates waited for generation since the last call."""
        with self._condition:
            waited, self.update_wait_s = self.update_wait_s, 0.0
            return waited

    def generate_fn(self, generate: GenerateFn) -> GenerateFn:
        """`generate` with every request held by this gate and its turn tagged with the version."""

        def versioned_generate(request_id: str, prompt_ids: list[int], max_tokens: int, **options) -> VersionedTurn:
            with self.request() as version:
                turn: GeneratedTurn = generate(request_id, prompt_ids, max_tokens, **options)  # options: `seed`
            return VersionedTurn(list(turn.token_ids), turn.logprobs, version)

        return versioned_generate
