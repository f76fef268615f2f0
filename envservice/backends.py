"""Where env instances live and how long one env call may take: the service's placement backends.

- `InProcessBackend` (default): envs are objects in the service process. With a time limit, each call
  runs on a pool of daemon threads so the request can answer `env_timeout`; a stuck thread cannot be
  killed, so it is logged and replaced (it keeps its CPU and memory until the env returns).
- `ProcessBackend` (`envservice.workers`): envs live in N worker processes.
- `RayBackend` (`envservice.ray_hosts`): envs live in N Ray actors, possibly on other nodes.

The two worker backends share `PooledBackend`: each session's env is a `RemoteEnv` handle placed on the
least-loaded worker. A worker that dies ends only its own sessions (`WorkerLost` -> `env_error`) and is
replaced. A call past the limit kills its worker (`EnvCallTimeout` -> `env_timeout`): that frees the
stuck env for real, at the price of the worker's other sessions, which end with `env_error`.

`preload(entry_points)` (called by the server at start-up) imports the env classes on every worker, outside
any call's time limit, and again on each replacement worker, so that no first reset pays for an import.

Injected latency (`--step-delay`, `envservice.latency`): every backend sleeps the drawn delay where the env
call runs, inside the call's time limit (in-process: the env is wrapped in `DelayedEnv` under the limit;
workers: the delay travels with the request and the `EnvHost` sleeps it before the env method).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Protocol, Sequence

from envservice import registry
from envservice.envs.base import Task, TextEnv
from envservice.errors import EnvServiceError
from envservice.host import Reply, entry_point_of
from envservice.latency import DelayedEnv, InjectedLatency

logger = logging.getLogger("envservice")

DEFAULT_STEP_TIMEOUT_S = 60.0
BETWEEN_CALLS_S = 0.01
"""How soon `_CallThreads.run_in_turn` looks again at a job seen between two calls (the next one starts at once,
and its limit counts from then)."""
STUCK_THREAD = "its thread could not be stopped and keeps running in the service (use --backend process to kill " \
               "stuck env calls)"
PRELOAD_TIMEOUT_S = 600.0
"""How long a worker may take to import the preloaded env classes (imports are slow; no step limit applies)."""


class EnvCallTimeout(Exception):
    """An env call did not return within the limit; `detail` says what happened to whatever ran it."""

    def __init__(self, seconds: float, detail: str) -> None:
        super().__init__(f"no answer within {seconds:g} s; {detail}")
        self.seconds, self.detail = seconds, detail


class WorkerLost(Exception):
    """The worker that held an env is gone (it crashed, was killed or stopped); its envs are lost."""


class RemoteEnvError(Exception):
    """An exception raised by an env inside a worker; its repr is the original one plus where it ran."""

    def __init__(self, original: str, where: str, traceback_text: str = "") -> None:
        super().__init__(original)
        self.original, self.where, self.traceback_text = original, where, traceback_text

    def __repr__(self) -> str:
        return f"{self.original} (in {self.where})"


class EnvBackend(Protocol):
    """Builds environment instances for sessions (the manager also accepts a backend with `build` only:
    `preload` and `shutdown` are optional)."""

    def build(self, registration: registry.Registration) -> TextEnv:
        """A new environment instance (or a proxy with the same methods) for one session."""

    def describe(self) -> str:
        """One phrase for logs and the ready line, e.g. 'process, 4 workers'."""

    def shutdown(self) -> None:
        """Free what the backend holds (worker processes, actors, threads); called once sessions are closed."""

    def preload(self, entry_points: Sequence[str]) -> dict[str, str]:
        """Optional: import these `"module:Class"` env classes wherever envs run, before the first session.

        Called once at start-up; never raises for a failing import. Returns {entry point: why it failed}.
        """


# ---- in-process ---------------------------------------------------------------------------------------


class InProcessBackend:
    """Builds every environment in the service's own process.

    Args:
        step_timeout_s: limit of each reset/step/evaluate/close call; 0 runs calls on the request's own
            thread with no limit (the fastest path).
        threads: daemon threads that run env calls when a limit is set (above the server's 40 request threads).
        latency: delays to inject into each step and create (`envservice.latency`); None injects none.
    """

    name = "inprocess"

    def __init__(self, step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S, threads: int = 64,
                 latency: InjectedLatency | None = None) -> None:
        self.step_timeout_s = step_timeout_s
        self.latency = latency
        self._threads = _CallThreads(threads) if step_timeout_s > 0 else None

    def build(self, registration: registry.Registration) -> TextEnv:
        """Instantiate the registered class here (wrapped to run under the time limit when one is set)."""
        env = registration.env_class()()
        if self.latency is not None:  # inside the timed wrapper: the delay counts toward the limit
            env = DelayedEnv(env, self.latency)  # type: ignore[assignment]
        if self._threads is None:
            return env
        return _TimedEnv(env, registration.env_id, self._threads, self.step_timeout_s)  # type: ignore[return-value]

    def steps_in_turn(self, steps: Sequence[tuple[Any, str]], budget_s: float | None = None,
                      ) -> list["TurnOutcome | None"] | None:
        """Several envs' steps (env, action) one after another as one job of the call threads: one hand-off for
        them all where `env.step` takes one each (`_CallThreads.run_in_turn`: each step keeps its own time limit,
        and one past it is that env's timeout alone). None when this backend runs no env under a limit (its
        steps take no hand-off: call `step`), or when a step is not one of its timed envs'."""
        if self._threads is None or not all(isinstance(env, _TimedEnv) for env, _ in steps):
            return None
        outcomes = self._threads.run_in_turn([env.step_call(action) for env, action in steps], self.step_timeout_s,
                                             budget_s)
        for (env, _), outcome in zip(steps, outcomes):
            if outcome is not None and isinstance(outcome.error, EnvCallTimeout):
                env.note_stuck("step")
        return outcomes

    def describe(self) -> str:
        """One phrase for logs and the ready line."""
        return "inprocess"

    def preload(self, entry_points: Sequence[str]) -> dict[str, str]:
        """Nothing to do: envs run in the service process, which imported their classes already."""
        return {}

    def shutdown(self) -> None:
        """Stop the idle call threads (stuck ones are daemons and die with the process)."""
        if self._threads is not None:
            self._threads.stop()


class _TimedEnv:
    """An in-process env whose calls run on `_CallThreads` under a time limit."""

    def __init__(self, env: TextEnv, env_id: str, threads: "_CallThreads", timeout_s: float) -> None:
        self.env, self.env_id, self._threads, self._timeout_s = env, env_id, threads, timeout_s
        self._timed_out = False

    def reset(self, task: Task) -> Any:
        return self._run("reset", lambda: self.env.reset(task))

    def step(self, action: str) -> Any:
        return self._run("step", self.step_call(action))

    def step_call(self, action: str) -> Callable[[], Any]:
        """The env's own step, unbounded: for a caller that runs it under the limit itself (`steps_in_turn`)."""
        return lambda: self.env.step(action)

    def evaluate(self) -> Any:
        return self._run("evaluate", self.env.evaluate)

    def close(self) -> None:
        if not self._timed_out:
            self._run("close", self.env.close)
            return
        # A call of this env is stuck: close it on a thread of its own (closing its subprocess or socket is
        # often what unblocks the stuck call) and answer the timeout now, not after another limit.
        threading.Thread(target=self._close_quietly, name="envservice-close-stuck", daemon=True).start()

    def _close_quietly(self) -> None:
        try:
            self.env.close()
        except Exception:
            logger.exception("env %s failed in close after a timeout", self.env_id)

    def _run(self, what: str, call: Callable[[], Any]) -> Any:
        try:
            return self._threads.run(call, self._timeout_s)
        except EnvCallTimeout:
            self.note_stuck(what)
            raise

    def note_stuck(self, what: str) -> None:
        """A call of this env (`what`) ran past the limit: its close must not wait for it (see `close`)."""
        self._timed_out = True
        logger.error("env %s: %s is stuck past %g s; its thread cannot be killed and keeps running "
                     "(%d stuck now); --backend process would kill it", self.env_id, what,
                     self._timeout_s, self._threads.stuck)


class _CallThreads:
    """Daemon threads, started on demand up to `size`, that run env calls so that the caller can stop waiting.

    A call past its limit leaves its thread stuck: the job is marked abandoned and the pool may start one
    more thread in its place; when the stuck call returns at last, its thread leaves.
    """

    def __init__(self, size: int) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._size, self.stuck = size, 0
        self._live, self._idle = 0, 0  # threads alive (stuck ones included), threads free for a job

    def run(self, call: Callable[[], Any], timeout_s: float) -> Any:
        """`call()` on a pool thread; `EnvCallTimeout` when it has not returned `timeout_s` after it started.

        The limit counts from the call's start, not from its submission: a call queued behind `size` busy
        threads is waiting, not hanging (each busy one is bounded by its own limit, so the queue drains)."""
        job = _Job(call)
        self._submit(job)
        wait_s = timeout_s
        while True:
            try:
                return job.future.result(wait_s)
            except FutureTimeout:
                pass
            if job.started_at is None:  # still queued for a thread: waiting, not hanging
                continue
            wait_s = job.started_at + timeout_s - time.monotonic()
            if wait_s <= 0:
                break
        with self._lock:
            if job.future.done():  # it returned just now
                return job.future.result()
            if not job.future.cancel():  # it is running: its thread is stuck
                job.abandoned = True
                self.stuck += 1
        raise EnvCallTimeout(timeout_s, STUCK_THREAD)

    def run_in_turn(self, calls: Sequence[Callable[[], Any]], timeout_s: float,
                    budget_s: float | None = None) -> list["TurnOutcome | None"]:
        """The calls one after another on one pool thread: one hand-off for them all, where `run` takes one per
        call. Each is bounded by `timeout_s` from its own start, as with `run`: one past it gets an
        `EnvCallTimeout` outcome and leaves its thread stuck, and the calls after it go on, in turn, on another
        thread. With `budget_s`, a job leaves out (None) the calls it has not started `budget_s` after it began,
        for the caller to run otherwise."""
        outcomes: list[TurnOutcome | None] = [None] * len(calls)
        first = 0
        while first < len(calls):
            job = _InTurn(calls[first:], budget_s)
            self._submit(job)  # type: ignore[arg-type]
            stuck_at = self._supervise(job, timeout_s)
            outcomes[first:first + len(job.outcomes)] = job.outcomes
            if stuck_at is None:  # every call finished, or the budget left the rest out
                break
            outcomes[first + stuck_at] = TurnOutcome(error=EnvCallTimeout(timeout_s, STUCK_THREAD), seconds=timeout_s)
            first += stuck_at + 1
        return outcomes

    def _supervise(self, job: "_InTurn", timeout_s: float) -> int | None:
        """Wait for an in-turn job: None once it has finished, or the index of the call it is stuck in (then
        it starts no further call, and its thread counts as stuck, as in `run`)."""
        while True:
            with job.lock:
                started = job.current_started
                if started is None:  # queued (waiting, not hanging), or between two calls: look again soon
                    wait_s = timeout_s if job.started_at is None else BETWEEN_CALLS_S
                else:
                    wait_s = started + timeout_s - time.monotonic()
                if started is not None and wait_s <= 0:
                    job.stopped = True
                    with self._lock:
                        job.abandoned = True
                        self.stuck += 1
                    return len(job.outcomes)
            try:
                job.future.result(wait_s)
                return None
            except FutureTimeout:  # a call's limit (or a wait in the queue) passed: look again
                continue

    def stop(self) -> None:
        """Ask every thread to exit once it is free (stuck ones leave when their call returns)."""
        with self._lock:
            for _ in range(self._live):
                self._queue.put(None)

    def _submit(self, job: "_Job") -> None:
        with self._lock:
            if self._idle > 0:  # claim a free thread
                self._idle -= 1
            elif self._live < self._size + self.stuck:  # stuck threads do not count against the size
                self._live += 1
                threading.Thread(target=self._loop, name="envservice-env-call", daemon=True).start()
            # else: every thread is busy; the job waits in the queue for the first one free
        self._queue.put(job)

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            job.started_at = time.monotonic()
            if job.future.set_running_or_notify_cancel():
                try:
                    job.future.set_result(job.call())
                except BaseException as exc:
                    job.future.set_exception(exc)
            with self._lock:
                if job.abandoned:  # another thread may have taken this one's place
                    self.stuck -= 1
                    self._live -= 1
                    return
                self._idle += 1


class _Job:
    """One env call for `_CallThreads`."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self.call, self.future, self.abandoned = call, Future(), False
        self.started_at: float | None = None  # set by the thread that takes it


@dataclass
class TurnOutcome:
    """What one call of `_CallThreads.run_in_turn` returned or raised, and how long it ran."""

    value: Any = None
    error: BaseException | None = None
    seconds: float = 0.0

    def result(self) -> Any:
        """The call's value, or its exception raised again."""
        if self.error is not None:
            raise self.error
        return self.value


class _InTurn:
    """Calls run one after another by one thread of `_CallThreads` (a job: `call` runs them all); the thread
    records each outcome, the waiter (`_supervise`) watches each call's start against its limit."""

    def __init__(self, calls: Sequence[Callable[[], Any]], budget_s: float | None) -> None:
        self.calls, self.budget_s = calls, budget_s
        self.future, self.abandoned = Future(), False
        self.started_at: float | None = None  # set by the thread that takes the job
        self.lock = threading.Lock()
        self.outcomes: list[TurnOutcome] = []  # one per finished call, in order
        self.current_started: float | None = None  # when the call running now started (None between calls)
        self.stopped = False  # set by the waiter once a call ran past its limit

    def call(self) -> None:
        for call in self.calls:
            with self.lock:
                now = time.monotonic()
                if self.stopped or (self.budget_s is not None and self.outcomes
                                    and now - (self.started_at or now) > self.budget_s):
                    return
                self.current_started = now
            outcome = TurnOutcome()
            try:
                outcome.value = call()
            except BaseException as exc:  # the env's; its session's answer, never this job's other calls'
                outcome.error = exc
            with self.lock:
                if self.stopped:  # the waiter gave this call up as stuck and answered its timeout
                    return
                outcome.seconds = time.monotonic() - now
                self.outcomes.append(outcome)
                self.current_started = None


# ---- worker pools (process and Ray) ----------------------------------------------------------------


class WorkerHandle(Protocol):
    """The service's side of one worker (a process or a Ray actor) running an `EnvHost`."""

    index: int
    load: int
    """Env handles placed on it and not yet closed."""

    @property
    def alive(self) -> bool:
        """False once it died or was killed."""

    def request(self, method: str, key: str, args: tuple, timeout_s: float | None) -> Reply:
        """Send one request and wait for its reply; `WorkerLost` if it dies, `TimeoutError` after `timeout_s`."""

    def describe(self) -> str:
        """E.g. 'worker 1 (pid 4242)', for messages."""

    def kill(self, reason: str) -> None:
        """Stop it at once; `reason` becomes the `WorkerLost` message of its pending and later calls."""

    def stop(self) -> None:
        """Stop it gracefully (service shutdown)."""


class PooledBackend:
    """Places each session's env on the least-loaded of N workers and replaces workers that die.

    Subclasses implement `_start_worker(index) -> WorkerHandle`. `latency`: delays to inject into each step
    and create (drawn here, slept by the worker inside the call's limit); None injects none.
    """

    name = "pooled"

    def __init__(self, workers: int, step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
                 latency: InjectedLatency | None = None) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.step_timeout_s = step_timeout_s
        self.latency = latency
        self._lock = threading.Lock()
        self._stopping = False
        self._preload_entry_points: tuple[str, ...] = ()  # what `preload` imported; replacements import it too
        self._preloading: set[WorkerHandle] = set()  # workers importing it now (a death there disables it)
        self._loss_listeners: list[Callable[[], None]] = []
        self._workers: list[WorkerHandle] = [self._start_worker(i) for i in range(workers)]

    def _start_worker(self, index: int) -> WorkerHandle:
        """Start worker `index`; each placement defines it (ProcessBackend: a process, RayBackend: an actor)."""
        raise NotImplementedError(f"{type(self).__name__} must define _start_worker (see ProcessBackend, RayBackend)")

    def build(self, registration: registry.Registration) -> TextEnv:
        """A `RemoteEnv` handle on the least-loaded live worker (its env is built there by the first reset)."""
        with self._lock:
            worker = min(self._workers, key=lambda w: (not w.alive, w.load))
            worker.load += 1
        entry_point = entry_point_of(registration.env_class())
        return RemoteEnv(self, worker, registration.env_id, entry_point)  # type: ignore[return-value]

    def workers(self) -> list[WorkerHandle]:
        """The current workers (a copy)."""
        with self._lock:
            return list(self._workers)

    def describe(self) -> str:
        """One phrase for logs and the ready line, e.g. 'process, 4 workers'."""
        return f"{self.name}, {len(self._workers)} workers"

    def call(self, worker: WorkerHandle, method: str, key: str, args: tuple = ()) -> Any:
        """One env call on `worker` under the time limit; a stuck worker is killed and replaced."""
        timeout_s = self.step_timeout_s if self.step_timeout_s > 0 else None
        try:
            ok, payload = worker.request(method, key, args, timeout_s)
        except TimeoutError:
            name = worker.describe()
            logger.error("%s: a %s call ran past %g s; killing the worker (its other sessions end with env_error)",
                         name, method, timeout_s)
            self._kill(worker, f"{name} was killed because another session's {method} call ran past {timeout_s:g} s")
            raise EnvCallTimeout(timeout_s or 0.0, f"{name} was killed and restarted; "
                                                   "its other sessions end with env_error") from None
        except WorkerLost:
            self.replace(worker)
            raise
        if ok:
            return payload
        raise _reply_error(payload, worker.describe())

    def release(self, worker: WorkerHandle) -> None:
        """One handle on `worker` was closed."""
        with self._lock:
            worker.load -= 1

    def preload(self, entry_points: Sequence[str]) -> dict[str, str]:
        """Import `entry_points` on every worker in parallel, outside the step limit; failures are logged.

        Replacement workers (`replace`) import them too. Returns {entry point: why it failed} (the first
        worker's reason); a worker that dies while importing also disables preloading of its successors.
        """
        entry_points = tuple(entry_points)
        with self._lock:
            self._preload_entry_points = entry_points
            workers = list(self._workers)
        if not entry_points:
            return {}
        failures: dict[str, str] = {}
        with ThreadPoolExecutor(len(workers), thread_name_prefix="envservice-preload") as pool:
            for failed in pool.map(lambda worker: self._preload_worker(worker, entry_points), workers):
                for entry_point, reason in failed.items():
                    failures.setdefault(entry_point, reason)
        return failures

    def _preload_worker(self, worker: WorkerHandle, entry_points: tuple[str, ...]) -> dict[str, str]:
        """Import `entry_points` on one worker; {entry point: why it failed}, logged here."""
        with self._lock:
            self._preloading.add(worker)
        try:
            ok, payload = worker.request("preload", "", (entry_points,), PRELOAD_TIMEOUT_S)
        except WorkerLost as exc:  # stays in `_preloading`: `replace` sees it died importing
            self.replace(worker)
            failures = {entry_point: f"{worker.describe()} died while importing it: {exc}"
                        for entry_point in entry_points}
        except TimeoutError:
            failures = {entry_point: f"{worker.describe()} was still importing after {PRELOAD_TIMEOUT_S:g} s"
                        for entry_point in entry_points}
        else:
            failures = payload if ok else {entry_point: repr(_reply_error(payload, worker.describe()))
                                           for entry_point in entry_points}
        with self._lock:
            self._preloading.discard(worker)
            stopping = self._stopping
        if not stopping:  # a worker stopped by shutdown is no failure worth a warning
            for entry_point, reason in failures.items():
                logger.warning("preload: %s could not import %s: %s", worker.describe(), entry_point, reason)
        return failures

    def add_loss_listener(self, listener: Callable[[], None]) -> None:
        """Call `listener()` each time a worker is found dead, once its envs report `lost` (the session
        manager then drops their sessions at once instead of when each is next touched or reaped)."""
        self._loss_listeners.append(listener)

    def replace(self, worker: WorkerHandle) -> None:
        """Start a new worker in the place of a dead one (once, however many callers notice) and preload it."""
        with self._lock:
            if self._stopping or self._workers[worker.index] is not worker:
                return
            self._stop_preload_if_it_killed(worker)
            try:
                self._workers[worker.index] = self._start_worker(worker.index)
            except Exception:
                logger.exception("could not restart %s; will retry when it is used again", worker.describe())
                new_worker = None
            else:
                new_worker, entry_points = self._workers[worker.index], self._preload_entry_points
        self._tell_loss_listeners()
        if new_worker is None:
            return
        logger.warning("%s is gone; started %s in its place", worker.describe(), new_worker.describe())
        if entry_points:  # on a thread of its own: the caller may be answering a request (never under the lock)
            threading.Thread(target=self._preload_worker, args=(new_worker, entry_points),
                             name=f"envservice-preload-{worker.index}", daemon=True).start()

    def _tell_loss_listeners(self) -> None:
        """Run the loss listeners (never under `_lock`: they take the session manager's locks)."""
        for listener in list(self._loss_listeners):
            try:
                listener()
            except Exception:
                logger.exception("a worker-loss listener failed")

    def _stop_preload_if_it_killed(self, worker: WorkerHandle) -> None:
        """A worker that died while importing the preload list (an import that crashes the interpreter, say)
        would take each successor down the same way, in a loop: preload no more replacements. Holds the lock."""
        if worker not in self._preloading:
            return
        self._preloading.discard(worker)
        self._preload_entry_points = ()
        logger.error("%s died while preloading env classes; replacement workers are not preloaded (each env is "
                     "imported by its first reset instead)", worker.describe())

    def shutdown(self) -> None:
        """Stop every worker (their envs are gone with them); a second call does nothing."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
            workers = list(self._workers)
        for worker in workers:
            worker.stop()

    def _kill(self, worker: WorkerHandle, reason: str) -> None:
        worker.kill(reason)
        self.replace(worker)


class RemoteEnv:
    """A session's env living on a worker: the `TextEnv` methods, forwarded as requests."""

    def __init__(self, backend: PooledBackend, worker: WorkerHandle, env_id: str, entry_point: str) -> None:
        self.backend, self.worker, self.env_id, self.entry_point = backend, worker, env_id, entry_point
        self.key = uuid.uuid4().hex
        self._released = False

    @property
    def lost(self) -> bool:
        """True once the worker holding this env died or was killed: the env is gone with it."""
        return not self.worker.alive

    def reset(self, task: Task) -> Any:
        latency = self.backend.latency
        delay = (latency.create_delay(),) if latency is not None and latency.create is not None else ()
        return self.backend.call(self.worker, "reset", self.key, (self.entry_point, task, *delay))

    def step(self, action: str) -> Any:
        latency = self.backend.latency
        delay = (latency.step_delay(),) if latency is not None and latency.step is not None else ()
        return self.backend.call(self.worker, "step", self.key, (action, *delay))

    def evaluate(self) -> Any:
        return self.backend.call(self.worker, "evaluate", self.key)

    def close(self) -> None:
        """Close the env on its worker (nothing to do when the worker is gone)."""
        if self._released:
            return
        self._released = True
        self.backend.release(self.worker)
        if self.worker.alive:
            try:
                self.backend.call(self.worker, "close", self.key)
            except WorkerLost:  # it died since: the env is gone with it, which is what closing asked for
                pass


def _reply_error(payload: tuple, where: str) -> Exception:
    """The exception an error reply stands for."""
    if payload[0] == "service":
        _, code, message, valid_choices = payload
        return EnvServiceError(code, message, valid_choices=valid_choices)
    _, original, traceback_text = payload
    return RemoteEnvError(original, where, traceback_text)
