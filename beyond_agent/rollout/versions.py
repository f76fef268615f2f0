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
- with `partial_rollout="token"` a turn is the unit no longer: an update interrupts the requests in flight
  (the backend's `interrupt`, vLLM's abort), each comes back with the tokens sampled so far, and the turn is
  continued from them on the new weights. Its kept ids and log-probs are the sampled ones, each token's
  version is recorded (`VersionedTurn.token_versions`), and the turn's version is its oldest token's, so the
  staleness bound and the drop rules count a turn as stale as its oldest token.

Version numbers are verl's global steps: the weights after training step t are version t, the initial
weights version 0.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Iterator

from beyond_agent.rollout.episode_loop import GeneratedTurn, GenerateFn
from beyond_agent.rollout.llm import LLMError, request_seed

logger = logging.getLogger(__name__)

PARTIAL_ROLLOUTS = (False, True, "token")
"""`beyond_agent.async_rollout.partial_rollout`: what an update waits for (module docstring): whole episodes
(false), requests in flight (true), or nothing it cannot interrupt ("token")."""

TOKEN_MODE_NEEDS_INTERRUPT = (
    "beyond_agent.async_rollout.partial_rollout=token needs a way to interrupt the requests in flight: vLLM servers over "
    "HTTP (AsyncLLMServerManager.interrupt) or, in training, verl's servers (training.wrap_weight_sync); this gate "
    "was given none")

MAX_CONTINUATIONS = 16
"""Most times one turn is continued after an interrupt; past it the turn fails as an LLM error (a server that
aborts every request must not loop an episode forever)."""

INTERRUPT_EVERY_S = 0.5
"""While an update waits in token mode, how often it interrupts again (a request that reached the server just
after an interrupt is caught by the next)."""


@dataclass
class VersionedTurn:
    """A generated turn plus the policy version of the weights that sampled each of its tokens."""

    token_ids: list[int]
    logprobs: list[float] | None
    policy_version: int
    """The oldest version among its tokens' (verl global step; 0: the initial weights): a turn is as stale as its
    oldest token."""
    token_versions: list[int] = field(default_factory=list)
    """One per token id: the version that sampled it (two versions only when an update interrupted the turn)."""
    stop_reason: str = "stop"
    """Why the turn ended, as the LLM front says (`llm.STOP_REASONS`); "aborted" only when it could not be
    continued."""
    latency_s: float = 0.0
    """Seconds its generation requests took, summed."""


class PolicyVersionGate:
    """Serialises weight updates against generation (see the module docstring). Thread-safe."""

    def __init__(self, version: int = 0, partial_rollout: bool | str = True,
                 interrupt: Callable[[], None] | None = None):
        if not (isinstance(partial_rollout, bool) or partial_rollout == "token"):
            raise ValueError(f"partial_rollout must be one of {PARTIAL_ROLLOUTS}; got {partial_rollout!r}")
        self.partial_rollout = partial_rollout
        """True: an update waits for requests in flight; False: it waits for whole episodes; "token": it
        interrupts the requests in flight, which continue on the new weights."""
        self.interrupt = interrupt
        """Aborts every request in flight at the LLM servers (token mode): the HTTP front's, or in training the
        trainer's, which reaches verl's servers (`training.interrupt_servers`)."""
        self._version = version
        self._condition = threading.Condition()
        self._updating = False  # an update is pending or running
        self._syncing = False  # generation has drained and the weights are being replaced
        self._requests = 0
        self._episodes = 0
        self._observers = threading.local()  # per thread: who is told each request's version (`observing`)
        self.update_wait_s = 0.0
        """Seconds updates spent waiting for generation to drain, summed (reset by `take_update_wait`)."""
        self.interrupted_turns = 0
        """Turns an update interrupted and the gate continued (token mode; reset by `take_interrupted_turns`)."""

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
        try:
            self._drain()
        except BaseException:  # no update: generation goes on
            with self._condition:
                self._updating = False
                self._condition.notify_all()
            raise
        with self._condition:
            self._syncing = True
            self.update_wait_s += time.monotonic() - started
        try:
            yield
        finally:
            with self._condition:
                self._version = new_version
                self._updating = self._syncing = False
                self._condition.notify_all()

    def _drain(self) -> None:
        """Wait until no request and no held episode is in flight; in token mode, interrupting the requests (outside
        the gate's lock: an interrupted request's thread takes it to leave) until none is left."""
        drained = lambda: self._requests == 0 and self._episodes == 0  # noqa: E731
        while True:
            with self._condition:
                if self.partial_rollout != "token":
                    self._condition.wait_for(drained)
                if drained():
                    return
            if self.interrupt is None:
                raise RuntimeError(TOKEN_MODE_NEEDS_INTERRUPT)
            try:
                self.interrupt()
            except Exception as error:  # the update still happens: it waits for the requests instead
                logger.warning("interrupting the requests in flight failed (%s: %s); the weight update waits for "
                               "them to finish", type(error).__name__, error)
                with self._condition:
                    self._condition.wait_for(drained)
                return
            with self._condition:
                self._condition.wait_for(drained, INTERRUPT_EVERY_S)

    def take_interrupted_turns(self) -> int:
        """Turns interrupted and continued since the last call."""
        with self._condition:
            interrupted, self.interrupted_turns = self.interrupted_turns, 0
            return interrupted

    def take_update_wait(self) -> float:
        """Seconds updates waited for generation since the last call."""
        with self._condition:
            waited, self.update_wait_s = self.update_wait_s, 0.0
            return waited

    def generate_fn(self, generate: GenerateFn) -> GenerateFn:
        """`generate` with every request held by this gate and each token tagged with its version; in token mode
        an interrupted turn is continued from its sampled tokens, at most MAX_CONTINUATIONS times."""
        token_mode = self.partial_rollout == "token"
        keep = {"keep_aborted": True} if token_mode else {}  # an interrupted turn comes back, to be continued

        def versioned_generate(request_id: str, prompt_ids: list[int], max_tokens: int, **options) -> VersionedTurn:
            turn = VersionedTurn([], [], 0)
            for continuation in range(MAX_CONTINUATIONS + 1):
                with self.request() as version:
                    part: GeneratedTurn = generate(request_id, prompt_ids + turn.token_ids,
                                                   max_tokens - len(turn.token_ids),
                                                   **continued(options, continuation), **keep)
                add_part(turn, part, version)
                if turn.stop_reason != "aborted" or not token_mode:
                    break
                if len(turn.token_ids) >= max_tokens:  # interrupted as it used its last token
                    turn.stop_reason = "length"
                    break
                if continuation == 0:
                    with self._condition:
                        self.interrupted_turns += 1
            else:
                raise LLMError("server", f"request {request_id!r} was interrupted {MAX_CONTINUATIONS + 1} times")
            return turn

        return versioned_generate


def continued(options: dict, continuation: int) -> dict:
    """A continuation's request options: its own sampling seed, derived from the turn's (the same seed would draw
    the first part's random numbers again)."""
    if continuation == 0 or options.get("seed") is None:
        return options
    return {**options, "seed": request_seed(options["seed"], "continued", continuation)}


def add_part(turn: VersionedTurn, part: GeneratedTurn, version: int) -> None:
    """Append one request's answer to a turn, its ids and log-probs exactly as sampled."""
    ids = list(part.token_ids)
    if not turn.token_ids:
        turn.policy_version = version  # the first request's version: the oldest
    turn.token_ids += ids
    turn.logprobs = None if turn.logprobs is None or part.logprobs is None else turn.logprobs + list(part.logprobs)
    turn.token_versions += [version] * len(ids)
    turn.stop_reason = getattr(part, "stop_reason", "stop")
    turn.latency_s += getattr(part, "latency_s", 0.0)
