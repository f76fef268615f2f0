"""Sessions: server-created ids, capacity limits, idle reaping and per-session error isolation.

Thread model: FastAPI runs the sync endpoints in a thread pool. A manager-wide lock guards only the
session table (never held while an environment runs); each session has its own lock, so one slow
environment does not block the others. A call on a session that is busy with another call is refused at
once (`busy`, retryable) instead of waiting for the lock: a waiter would hold one of the pool's threads, and
100 calls queued on one slow session once took every thread from every other client. Any exception raised inside an environment closes and drops that
one session and becomes an `env_error`; the service keeps serving the rest.

Placement and time limits: environments are built by an `EnvBackend` (`envservice.backends`):
in this process (default), in worker processes or in Ray actors. A backend returns an object with the
`reset/step/evaluate/close` methods and enforces the per-call limit itself; a call past it raises
`EnvCallTimeout`, which closes that session and answers `env_timeout`. A lost worker (`WorkerLost`) is
an `env_error` like any env exception; a backend that can tell when a worker dies
(`add_loss_listener`) has the dead worker's sessions dropped at once, so they stop counting against capacity.

Accounting: every session ends exactly once, by one of `CLOSED_BY`; the manager counts sessions created and
closed by each cause (`created == open + sum(closed)`, served by /healthz) and remembers the last
`REMEMBERED_CLOSED` closed ids, so that a release of a session that is already closed (a retried release
whose first reply was lost, or a session the reaper took) succeeds and says how it had been closed.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
from collections import Counter, OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from envservice import registry
from envservice.backends import EnvBackend, EnvCallTimeout, InProcessBackend, RemoteEnvError, TurnOutcome, WorkerLost
from envservice.envs.base import Task, TextEnv
from envservice.errors import EnvServiceError, clip
from envservice.protocol import (
    CreateRequest,
    CreateResponse,
    ErrorCode,
    EvaluateResponse,
    ReleaseResponse,
    StepResponse,
)

logger = logging.getLogger("envservice")

__all__ = ["EnvBackend", "InProcessBackend", "Session", "SessionManager", "CLOSED_BY"]

CLOSED_BY = ("release", "reaper", "env_error", "env_timeout", "worker_lost", "shutdown")
"""How a session can end: its release, the idle reaper, an env exception, an env call past the time limit,
the death of the worker that held it, or the service's shutdown."""
REMEMBERED_CLOSED = 20_000
"""Closed session ids remembered (with how they closed) for idempotent releases; ~150 bytes each, ~3 MB in all."""


@dataclass
class Session:
    """One open episode: its environment, task, step count and state flags."""

    session_id: str
    registration: registry.Registration
    env: TextEnv
    task: Task
    last_used: float
    steps: int = 0
    over: bool = False
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class SessionManager:
    """Owns all sessions of a service: create, step, evaluate, release, and reap idle ones."""

    def __init__(
        self,
        env_ids: Iterable[str],
        *,
        max_sessions: int = 4096,
        idle_timeout_s: float = 600.0,
        backend: EnvBackend | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.env_ids = [registry.get(env_id).env_id for env_id in env_ids]
        self.max_sessions = max_sessions
        self.idle_timeout_s = idle_timeout_s
        self.backend = backend or InProcessBackend()
        self._clock = clock
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._reserved: dict[str, int] = {}
        self._closed_ids: OrderedDict[str, str] = OrderedDict()  # session id -> how it closed (oldest first)
        self._created = 0
        self._closed_by_cause: Counter[str] = Counter()
        self._reaper: threading.Thread | None = None
        self._stop = threading.Event()
        add_loss_listener = getattr(self.backend, "add_loss_listener", None)  # optional, as `preload` is
        if add_loss_listener is not None:
            add_loss_listener(self.drop_lost_sessions)

    # ---- public operations -------------------------------------------------------------------------

    def create(self, request: CreateRequest) -> CreateResponse:
        """Build and reset an environment for a new session (capacity is reserved first)."""
        registration = self._registration(request.env_id)
        task = registration.env_class().resolve_task(request.task_id, request.split, request.seed, request.params)
        self._reserve(registration)
        try:
            env, observation, info = self._build_and_reset(registration, task)
        except BaseException:
            with self._lock:
                self._reserved[registration.env_id] -= 1
            raise
        session = Session(uuid.uuid4().hex, registration, env, task, self._clock())
        with self._lock:  # the reservation becomes the session in one step
            self._reserved[registration.env_id] -= 1
            self._sessions[session.session_id] = session
            self._created += 1
        return CreateResponse(
            session_id=session.session_id, env_id=registration.env_id, task_id=task.name,
            seed=task.seed, observation=observation, info=info,
        )

    def step(self, session_id: str, action: str) -> StepResponse:
        """Apply one action; refused once the episode is over; an env exception ends this session only."""
        session = self._get(session_id)
        with self._session_lock(session, "step"):
            self._check_steppable(session)
            return self._stepped(session, lambda: session.env.step(action))

    def steps_in_turn(self, requests: Sequence[tuple[str, str]], budget_s: float | None = None,
                      ) -> list[tuple[StepResponse | EnvServiceError, float] | None]:
        """Several sessions' steps (session id, action), one after another in the caller's thread, each answered
        as `step` answers it (the same checks, session lock, limits, error isolation and accounting), with how
        long it took. Where the backend offers it (`steps_in_turn`), the env calls of the steps run as one job
        of its call threads, each under its own time limit: one hand-off for them all instead of one per step
        (why: at 1 000 sessions of a cheap env the hand-offs were half the service's CPU). The sessions of that
        job stay locked until it ends, so a concurrent call on one of them answers `busy`, as during its step.

        None for a step this call left out: `budget_s` had passed before it started (the caller runs it
        otherwise, with `step`)."""
        answers: list[tuple[StepResponse | EnvServiceError, float] | None] = [None] * len(requests)
        steps_in_turn = getattr(self.backend, "steps_in_turn", None)  # optional, as `preload` is
        started = time.perf_counter()
        held: list[tuple[int, Session, str]] = []
        try:
            for index, (session_id, action) in enumerate(requests):
                if budget_s is not None and time.perf_counter() - started > budget_s:
                    break
                try:
                    session = self._get(session_id)
                    if not session.lock.acquire(blocking=False):
                        raise _busy(session_id, "step")
                except EnvServiceError as error:
                    answers[index] = (error, 0.0)
                    continue
                held.append((index, session, action))
                try:
                    self._check_steppable(session)
                except EnvServiceError as error:
                    answers[index] = (error, 0.0)
                    held.pop()
                    session.lock.release()
            outcomes = steps_in_turn([(session.env, action) for _, session, action in held],
                                     budget_s) if held and steps_in_turn is not None else None
            for position, (index, session, action) in enumerate(held):
                answers[index] = self._answer_in_turn(session, action, None if outcomes is None else
                                                      outcomes[position], budget_s, started)
        finally:
            for _, session, _ in held:
                session.lock.release()
        return answers

    def _answer_in_turn(self, session: Session, action: str, outcome: TurnOutcome | None, budget_s: float | None,
                        started: float) -> tuple[StepResponse | EnvServiceError, float] | None:
        """One step of `steps_in_turn` (its session locked and checked): answered from its outcome in the job,
        or stepped here when there was no job; None when the budget left it out."""
        if outcome is None and budget_s is not None and time.perf_counter() - started > budget_s:
            return None
        call = outcome.result if outcome is not None else lambda: session.env.step(action)
        step_started = time.perf_counter()
        try:
            answer: StepResponse | EnvServiceError = self._stepped(session, call)
        except EnvServiceError as error:
            answer = error
        return answer, outcome.seconds if outcome is not None else time.perf_counter() - step_started

    def _check_steppable(self, session: Session) -> None:
        """Refuse a step of a session that closed while the call waited, or whose episode is over."""
        self._check_open(session)
        if session.over:
            raise EnvServiceError(
                ErrorCode.episode_over,
                f"session {session.session_id} already ended after {session.steps} steps; call /evaluate or /release",
            )

    def _stepped(self, session: Session, env_step: Callable[[], Any]) -> StepResponse:
        """A step's answer from the env's step (the session's lock held and the session checked): an env
        exception or timeout ends this session only (`_guarded`), the limits apply, the session was used now."""
        response = self._guarded(session, "step", lambda: _step_response(env_step()))
        self._apply_limits(session, response)
        session.last_used = self._clock()
        return response

    def evaluate(self, session_id: str) -> EvaluateResponse:
        """Score the episode (allowed during and after it)."""
        session = self._get(session_id)
        with self._session_lock(session, "evaluate"):
            self._check_open(session)
            response = self._guarded(session, "evaluate", lambda: _evaluate_response(session.env.evaluate()))
            session.last_used = self._clock()
            return response

    def refuse_if_busy(self, session_id: str, call: str) -> None:
        """Raise what `call` would answer at once, without running it: `busy` for a session answering another
        call, the unknown-session error for an id that is not open. For the event loop: a greedy client's
        refusals then never take a pool thread (they used to, and the honest clients' calls waited for the
        interpreter behind 32 threads answering 409s). A call that passes still takes the lock in its thread,
        so a session that became busy meanwhile is refused there."""
        if self._get(session_id).lock.locked():
            raise _busy(session_id, call)

    @staticmethod
    @contextmanager
    def _session_lock(session: Session, call: str):
        """The session's lock, or `busy` at once when another call holds it (module docstring)."""
        if not session.lock.acquire(blocking=False):
            raise _busy(session.session_id, call)
        try:
            yield
        finally:
            session.lock.release()

    def release(self, session_id: str) -> ReleaseResponse:
        """Close the session's environment and forget the session.

        Idempotent: a session that is already closed (released before, reaped, failed) is released again
        with `already_closed` and how it closed; only a session id never created (or forgotten long ago) is a 404.
        """
        with self._lock:
            session = self._sessions.get(session_id)
        if session is not None and self._discard(session, "release"):
            self._close_env(session)
            return ReleaseResponse(session_id=session_id, released=True)
        with self._lock:  # closed before, or by a concurrent call just now
            closed_by = self._closed_ids.get(session_id)
        if closed_by is not None:
            return ReleaseResponse(session_id=session_id, released=True, already_closed=True, closed_by=closed_by)
        raise self._unknown_session(session_id)

    def env_id_of(self, session_id: str) -> str | None:
        """The env id of an open session; None for an id that is not open."""
        with self._lock:
            session = self._sessions.get(session_id)
        return None if session is None else session.registration.env_id

    def count(self) -> int:
        """Sessions currently open."""
        with self._lock:
            return len(self._sessions)

    def ledger(self) -> dict[str, Any]:
        """Sessions created, closed by each cause of `CLOSED_BY` (those that happened) and open, read at one
        instant: `created == open + sum(closed)` always holds."""
        with self._lock:
            return {"created": self._created, "closed": dict(self._closed_by_cause), "open": len(self._sessions)}

    def drop_lost_sessions(self) -> list[str]:
        """Drop the sessions whose env reports `lost` (its worker died): they free their capacity at once.

        Called by the backend when a worker dies; their next call answers `unknown_session` saying why.
        """
        with self._lock:
            lost = [s for s in self._sessions.values() if getattr(s.env, "lost", False)]
        dropped = []
        for session in lost:
            # A busy session is left to its in-flight call, which fails with the worker and ends the session
            # itself (and says why: env_error or env_timeout); waiting for its lock here could deadlock, as this
            # may run on that very call's thread.
            if not session.lock.acquire(blocking=False):
                continue
            try:
                if self._discard(session, "worker_lost"):
                    self._close_env(session, lock_held=True)
                    dropped.append(session.session_id)
            finally:
                session.lock.release()
        if dropped:
            logger.warning("dropped %d session(s) of a worker that died", len(dropped))
        return dropped

    def reap_idle(self) -> list[str]:
        """Release sessions unused for longer than `idle_timeout_s`; returns their ids."""
        deadline = self._clock() - self.idle_timeout_s
        with self._lock:
            idle = [s for s in self._sessions.values() if s.last_used < deadline]
        reaped = []
        for session in idle:
            if session.lock.acquire(blocking=False):  # busy sessions are not idle
                session.lock.release()
                if session.last_used < deadline and self._discard(session, "reaper"):
                    self._close_env(session)
                    reaped.append(session.session_id)
        if reaped:
            logger.info("reaped %d idle session(s)", len(reaped))
        return reaped

    def start_reaper(self, interval_s: float | None = None) -> None:
        """Run `reap_idle` in a daemon thread every `interval_s` (default: a quarter of the idle timeout)."""
        interval = interval_s if interval_s is not None else max(0.05, min(self.idle_timeout_s / 4, 30.0))
        self._stop.clear()
        self._reaper = threading.Thread(target=self._reap_loop, args=(interval,), name="envservice-reaper", daemon=True)
        self._reaper.start()

    def shutdown(self) -> None:
        """Stop the reaper and release every session."""
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5)
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            if self._discard(session, "shutdown"):
                self._close_env(session)
        backend_shutdown = getattr(self.backend, "shutdown", None)
        if backend_shutdown is not None:
            backend_shutdown()

    # ---- internals ---------------------------------------------------------------------------------

    def _registration(self, env_id: str) -> registry.Registration:
        if env_id not in self.env_ids:
            raise EnvServiceError(
                ErrorCode.unknown_env, f"env_id={env_id!r} is not served here", valid_choices=self.env_ids
            )
        return registry.get(env_id)

    def _reserve(self, registration: registry.Registration) -> None:
        env_id = registration.env_id
        with self._lock:
            total = len(self._sessions) + sum(self._reserved.values())
            of_env = sum(1 for s in self._sessions.values() if s.registration.env_id == env_id)
            if total >= self.max_sessions:
                raise EnvServiceError(ErrorCode.capacity, f"the service is full ({self.max_sessions} sessions)")
            if of_env + self._reserved.get(env_id, 0) >= registration.max_sessions:
                raise EnvServiceError(
                    ErrorCode.capacity, f"env_id={env_id!r} is full ({registration.max_sessions} sessions)"
                )
            self._reserved[env_id] = self._reserved.get(env_id, 0) + 1

    def _build_and_reset(self, registration: registry.Registration, task: Task) -> tuple[TextEnv, str, dict]:
        env = None
        try:
            env = self.backend.build(registration)
            observation, info = env.reset(task)
            if not isinstance(observation, str) or not isinstance(info, dict):
                raise TypeError(f"reset returned ({type(observation).__name__}, {type(info).__name__}), "
                                "expected (str, dict)")
            return env, observation, info
        except EnvServiceError:
            _close_quietly(env, registration.env_id)
            raise
        except EnvCallTimeout as exc:
            _close_quietly(env, registration.env_id)
            raise _timeout_error(registration.env_id, "reset", exc, "the session was not created") from exc
        except Exception as exc:
            _close_quietly(env, registration.env_id)
            _log_failure(registration.env_id, "reset", "a new session", exc)
            raise EnvServiceError(
                ErrorCode.env_error, f"env {registration.env_id!r} failed in reset: {_reason(exc)}") from exc

    def _guarded(self, session: Session, what: str, call: Callable[[], Any]) -> Any:
        """Run an env call; on an exception drop the session and raise `env_error`."""
        env_id = session.registration.env_id
        try:
            return call()
        except EnvServiceError:
            raise
        except EnvCallTimeout as exc:
            self._drop(session, "env_timeout")
            raise _timeout_error(env_id, what, exc, f"session {session.session_id} was closed") from exc
        except Exception as exc:
            _log_failure(env_id, what, f"session {session.session_id}", exc)
            self._drop(session, "worker_lost" if isinstance(exc, WorkerLost) else "env_error")
            raise EnvServiceError(
                ErrorCode.env_error,
                f"env {env_id!r} failed in {what}: {_reason(exc)}; session {session.session_id} was closed",
            ) from exc

    def _drop(self, session: Session, closed_by: str) -> None:
        """Forget a failed session and close its env (its lock is held by the caller)."""
        if self._discard(session, closed_by):
            self._close_env(session, lock_held=True)

    def _apply_limits(self, session: Session, response: StepResponse) -> None:
        session.steps += 1
        response.info["steps"] = session.steps
        if session.steps >= session.registration.max_steps and not response.terminated and not response.truncated:
            response.truncated = True
            response.info["truncation"] = "max_steps"
        session.over = response.terminated or response.truncated

    def _get(self, session_id: str) -> Session:
        with self._lock:
            session = self._sessions.get(session_id)
        if session is None:
            raise self._unknown_session(session_id)
        return session

    def _discard(self, session: Session, closed_by: str) -> bool:
        """Remove an open session from the table and record how it closed; False if it was gone already."""
        with self._lock:
            if self._sessions.pop(session.session_id, None) is None:
                return False
            self._record_closed(session.session_id, closed_by)
            return True

    def _record_closed(self, session_id: str, closed_by: str) -> None:
        """Count a closed session and remember it for idempotent releases (holds `_lock`)."""
        self._closed_by_cause[closed_by] += 1
        self._closed_ids[session_id] = closed_by
        if len(self._closed_ids) > REMEMBERED_CLOSED:
            self._closed_ids.popitem(last=False)

    def _unknown_session(self, session_id: str) -> EnvServiceError:
        """The 404 of a session that is not open, saying how it closed when that is remembered."""
        with self._lock:
            closed_by = self._closed_ids.get(session_id)
        how = f"it was closed ({closed_by})" if closed_by else "never created, or closed long ago"
        return EnvServiceError(ErrorCode.unknown_session, f"session_id={clip(session_id)!r} is not open: {how}")

    def _check_open(self, session: Session) -> None:
        if session.closed:  # released while this request waited for the session lock
            raise self._unknown_session(session.session_id)

    @staticmethod
    def _close_env(session: Session, lock_held: bool = False) -> None:
        if lock_held:
            session.closed = True
            _close_quietly(session.env, session.registration.env_id)
            return
        with session.lock:
            session.closed = True
            _close_quietly(session.env, session.registration.env_id)

    def _reap_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            try:
                self.reap_idle()
            except Exception:  # the reaper must outlive one bad close
                logger.exception("idle reaping failed")


def _reason(exc: Exception) -> str:
    """How an env failure reads in a message: a lost worker says itself what happened."""
    return str(exc) if isinstance(exc, WorkerLost) else repr(exc)


def _log_failure(env_id: str, what: str, where: str, exc: Exception) -> None:
    """Log an env failure; a worker's own traceback replaces the local one, which says nothing."""
    remote_traceback = getattr(exc, "traceback_text", "")
    logger.error("env %s failed in %s (%s): %s%s", env_id, what, where, _reason(exc),
                 f"\n{remote_traceback}" if remote_traceback else "",
                 exc_info=not isinstance(exc, (WorkerLost, RemoteEnvError)))


def _timeout_error(env_id: str, what: str, exc: EnvCallTimeout, outcome: str) -> EnvServiceError:
    logger.error("env %s: %s timed out after %g s (%s); %s", env_id, what, exc.seconds, exc.detail, outcome)
    return EnvServiceError(
        ErrorCode.env_timeout,
        f"env {env_id!r} did not finish {what} within {exc.seconds:g} s (--step-timeout); {outcome}; {exc.detail}",
    )


def _close_quietly(env: TextEnv | None, env_id: str) -> None:
    if env is None:
        return
    try:
        env.close()
    except Exception:
        logger.exception("env %s failed in close", env_id)


def _step_response(result: Any) -> StepResponse:
    """Check an env's step tuple and wrap it (a wrong shape or type is the env's fault)."""
    if not isinstance(result, tuple) or len(result) != 5:
        raise TypeError(f"step returned {type(result).__name__}, expected a 5-tuple")
    observation, reward, terminated, truncated, info = result
    if not isinstance(observation, str):
        raise TypeError(f"step observation is {type(observation).__name__}, expected str")
    if not isinstance(reward, (int, float)) or isinstance(reward, bool) or not math.isfinite(reward):
        raise TypeError(f"step reward is {reward!r}, expected a finite float")
    if not isinstance(terminated, bool) or not isinstance(truncated, bool) or not isinstance(info, dict):
        raise TypeError("step flags must be bool and info a dict")
    return StepResponse(observation=observation, reward=float(reward), terminated=terminated,
                        truncated=truncated, info=dict(info))


def _evaluate_response(result: Any) -> EvaluateResponse:
    score, success = result
    if not isinstance(success, bool) or not isinstance(score, (int, float)) or not 0.0 <= score <= 1.0:
        raise TypeError(f"evaluate returned ({score!r}, {success!r}), expected (score in [0, 1], bool)")
    return EvaluateResponse(score=float(score), success=success)


def _busy(session_id: str, call: str) -> EnvServiceError:
    return EnvServiceError(ErrorCode.busy, f"session {session_id} is answering another call; /{call} was not run: "
                           "retry once that call is back")
