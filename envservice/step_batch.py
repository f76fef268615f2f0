"""Running the steps of one POST /steps: each as its own /step would, cheap ones one after another.

Why a batch route: at 1 000 sessions of a cheap env, a /step spent ~55 % of the service's CPU in HTTP/ASGI
machinery and ~30 % handing the call to a pool thread and back, ~2 % in the env (bench/envservice_load.py). A
batch pays both once for all its steps.

How the steps run: the steps of envs whose recent steps were slow (`StepCosts`, over `SLOW_STEP_S`: a browser, a
remote server, a worker process, a sandboxed command) start at once on `fan_out` threads, so they take about as
long as the slowest of them, as concurrent /step calls would. The other steps run one after another
(`SessionManager.steps_in_turn`: in-process envs under a time limit as one job of the call threads, one hand-off
for all of them) while the batch has taken less than `SERIAL_BUDGET_S`; those left then also run at once on
`fan_out`. Each step gets what `SessionManager.step` gives a /step: the same validation, session lock, limits, error
isolation and accounting. A session named twice in one batch answers `busy` the second time, as a concurrent /step
would (the client sends it again), so a batch never applies two actions to one session in an order the client
did not choose.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Executor, Future
from typing import Any, Sequence

from envservice.errors import EnvServiceError
from envservice.protocol import ErrorCode, StepRequest, StepResponse
from envservice.sessions import SessionManager

logger = logging.getLogger("envservice")

SERIAL_BUDGET_S = 0.02
"""Seconds a batch runs steps one after another before it runs the rest at once: 256 steps of a cheap env (~40 us
each, a few ms when many threads share the interpreter) stay in one thread."""
SLOW_STEP_S = 0.02
"""An env whose recent steps took longer than this (on average) has its steps started at once, not in series: well
above what a cheap step takes while it waits for the interpreter under load (a few ms), which must not count."""
FAN_OUT_THREADS = 32
"""Threads that run a batch's slow steps at once (shared by all batches of a service)."""


class StepCosts:
    """Each env's recent step time (an exponential average over its last ~10 steps), to tell slow envs apart."""

    WEIGHT = 0.1
    """Weight of the newest step in the average."""

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}  # written from many threads: a lost update only ages the average

    def record(self, env_id: str, seconds: float) -> None:
        """Count one step of `env_id` that took `seconds`."""
        previous = self._seconds.get(env_id)
        self._seconds[env_id] = seconds if previous is None else previous + self.WEIGHT * (seconds - previous)

    def slow(self, env_id: str | None) -> bool:
        """Whether `env_id`'s recent steps took over `SLOW_STEP_S` (an env not seen yet is not slow)."""
        return env_id is not None and self._seconds.get(env_id, 0.0) > SLOW_STEP_S


def run_steps(manager: SessionManager, steps: Sequence[StepRequest], fan_out: Executor, costs: StepCosts,
              request_id: str | None, serial_budget_s: float = SERIAL_BUDGET_S) -> dict[str, Any]:
    """The JSON body of a `StepBatchResponse`: each step's outcome, in the order of `steps`."""
    outcomes: list[Any] = [None] * len(steps)
    seen: set[str] = set()
    serial = []
    for index, request in enumerate(steps):
        env_id = manager.env_id_of(request.session_id)
        if request.session_id in seen:  # one action per session per batch (module docstring)
            outcomes[index] = _error_outcome(EnvServiceError(
                ErrorCode.busy, f"session {request.session_id} has an earlier step in this batch; this one was not "
                "run: send it again once that one is back"), request_id)
        elif costs.slow(env_id):
            outcomes[index] = fan_out.submit(_outcome, manager, request, env_id, costs, request_id)
        else:
            serial.append((index, env_id))
        seen.add(request.session_id)
    answers = _in_turn(manager, [steps[index] for index, _ in serial], serial_budget_s, request_id)
    for (index, env_id), answer in zip(serial, answers):
        if answer is None:  # left out by the budget: at once, beside the others
            outcomes[index] = fan_out.submit(_outcome, manager, steps[index], env_id, costs, request_id)
            continue
        result, seconds = answer
        if env_id is not None:
            costs.record(env_id, seconds)
        outcomes[index] = _answer_body(result, request_id)
    return {"results": [outcome.result() if isinstance(outcome, Future) else outcome for outcome in outcomes]}


def _in_turn(manager: SessionManager, steps: Sequence[StepRequest], budget_s: float, request_id: str | None) -> list:
    """`SessionManager.steps_in_turn` of these steps; a bug of the service there is each step's internal error
    (never the request's, whose other steps are answered)."""
    try:
        return manager.steps_in_turn([(step.session_id, step.action) for step in steps], budget_s)
    except Exception:
        logger.exception("internal error on the steps in turn of request %s", request_id)
        return [(_internal_error(request_id), 0.0)] * len(steps)


def _outcome(manager: SessionManager, request: StepRequest, env_id: str | None, costs: StepCosts,
             request_id: str | None) -> dict[str, Any]:
    """One step's outcome: what /step would have answered, as a `StepOutcome` body."""
    started = time.perf_counter()
    try:
        return _answer_body(manager.step(request.session_id, request.action), request_id)
    except EnvServiceError as error:
        return _error_outcome(error, request_id)
    except Exception:  # a bug of the service: this step's answer, never the other steps' or the request's
        logger.exception("internal error on a step of session %s (request %s)", request.session_id, request_id)
        return _error_outcome(_internal_error(request_id), request_id)
    finally:
        if env_id is not None:
            costs.record(env_id, time.perf_counter() - started)


def _answer_body(answer: StepResponse | EnvServiceError, request_id: str | None) -> dict[str, Any]:
    """A step's answer (its response, or the error /step would have raised) as a `StepOutcome` body."""
    if isinstance(answer, EnvServiceError):
        return _error_outcome(answer, request_id)
    return {"status": 200, "step": answer.model_dump(mode="json")}


def _internal_error(request_id: str | None) -> EnvServiceError:
    """What a step answers when the service itself failed on it (the traceback is in the log)."""
    return EnvServiceError(ErrorCode.internal_error, "the service failed on this step; its log has the traceback "
                           f"under request id {request_id}")


def _error_outcome(error: EnvServiceError, request_id: str | None) -> dict[str, Any]:
    body = error.to_response().model_copy(update={"request_id": request_id})
    return {"status": error.status, "error": body.model_dump(mode="json", exclude_none=True)}
