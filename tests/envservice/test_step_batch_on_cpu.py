"""POST /steps (`envservice.step_batch`): each step answered as its own /step would be, bounded before it runs,
slow steps run at once; and the client's `Coalescer`, which turns concurrent calls into batches."""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

import pytest

from envservice import registry
from envservice.coalesce import Coalescer
from envservice.envs.base import StepResult
from envservice.protocol import MAX_BATCH_STEPS, StepBatchResponse

pytestmark = pytest.mark.timeout(60)


def _create(client, env_id: str = "counting") -> str:
    response = client.post("/create", json={"env_id": env_id})
    assert response.status_code == 200, response.text
    return response.json()["session_id"]


def _steps(client, *steps: tuple[str, str]):
    return client.post("/steps", json={"steps": [{"session_id": s, "action": a} for s, a in steps]})


def _as_step_answers(response) -> list[tuple[int, dict[str, Any]]]:
    """(status, body) of each outcome, as /step would have answered it (without the request id)."""
    assert response.status_code == 200, response.text
    results = StepBatchResponse.model_validate(response.json()).results
    return [(r.status, r.step.model_dump() if r.error is None else r.error.model_dump(exclude={"request_id"}))
            for r in results]


def _step_answer(client, session_id: str, action: str) -> tuple[int, dict[str, Any]]:
    response = client.post("/step", json={"session_id": session_id, "action": action})
    body = response.json()
    body.pop("request_id", None)
    return response.status_code, ({"valid_choices": None, "detail": None, **body} if response.status_code != 200
                                  else body)


def test_each_step_of_a_batch_answers_what_its_own_step_would(make_client, test_envs) -> None:
    client = make_client()
    fresh, ended, crashing = _create(client), _create(client), _create(client)
    for _ in range(3):
        client.post("/step", json={"session_id": ended, "action": "inc"})
    answers = _as_step_answers(_steps(client, (fresh, "inc"), (fresh, "inc"), ("nope", "inc"), (ended, "inc"),
                                      (crashing, "boom")))
    assert answers[0] == (200, {"observation": "value 1", "reward": 0.0, "terminated": False, "truncated": False,
                                "info": {"steps": 1}})
    # The same session's second step in one batch is refused as a concurrent /step is: `busy`, nothing ran.
    assert answers[1][0] == 409 and answers[1][1]["code"].value == "busy"
    assert "has an earlier step in this batch" in answers[1][1]["message"]
    assert _step_answer(client, fresh, "inc")[1]["observation"] == "value 2"  # one inc ran, not two
    assert answers[2] == _step_answer(client, "nope", "inc")  # unknown session: the same 404 and message
    assert answers[3] == _step_answer(client, ended, "inc")  # the episode is over: the same 409 and message
    # An env that raises ends that session only, as /step does: env_error, accounted for as one.
    status, error = answers[4]
    assert status == 500 and error["code"].value == "env_error" and "simulated crash" in error["message"]
    health = client.get("/healthz").json()
    assert health["closed"] == {"env_error": 1} and health["sessions"] == 2
    assert _step_answer(client, fresh, "jump")[0] == 200  # the batch's other sessions go on


def test_a_batch_is_refused_whole_before_it_runs_when_a_step_is_malformed_or_it_is_too_long(
        make_client, test_envs) -> None:
    client = make_client()
    session = _create(client)
    for steps, field in (([], "steps"), ([{"session_id": session, "action": "inc"}] * (MAX_BATCH_STEPS + 1), "steps"),
                         ([{"session_id": session, "action": "inc"}, {"session_id": session, "action": 3}],
                          "steps.1.action")):
        response = client.post("/steps", json={"steps": steps})
        assert response.status_code == 422 and response.json()["code"] == "invalid_request", response.text
        assert f"body.{field}" in response.json()["message"]
    assert _step_answer(client, session, "inc")[1]["observation"] == "value 1"  # no refused batch ran a step


def _barrier_class() -> type:
    """A fresh 'barrier' env class: 'meet' returns only once as many steps as its `barrier` has parties wait at
    once (steps run one after another break it after 5 s: an env error); 'slow' sleeps 50 ms (over
    `SLOW_STEP_S`)."""
    from envservice.envs.base import Task, TextEnv

    class Barrier(TextEnv):
        description = "test env: steps that must run at the same time"
        splits = {"train": ["meet"]}
        params: dict = {}
        barrier = threading.Barrier(2)

        def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
            return "ready", {}

        def step(self, action: str) -> StepResult:
            if action == "slow":
                time.sleep(0.05)
            else:
                type(self).barrier.wait(timeout=5)
            return "met", 0.0, False, False, {}

        def evaluate(self) -> tuple[float, bool]:
            return 0.0, False

    return Barrier


@pytest.fixture
def barrier() -> Iterator[type]:
    """Registers the 'barrier' env (8 sessions) for one test; yields its class, whose `barrier` the test sets."""
    env_class = _barrier_class()
    registry.register("barrier", env_class, max_steps=50, max_sessions=8)
    yield env_class
    registry.unregister("barrier")


def test_steps_left_when_a_slow_step_used_the_serial_budget_run_at_once(make_client, barrier) -> None:
    client = make_client(env_ids=["barrier"])
    sessions = [_create(client, "barrier") for _ in range(3)]
    barrier.barrier = threading.Barrier(2)
    # The slow step runs first, alone, past the serial budget; the two steps after it start together, so they meet.
    answers = _as_step_answers(_steps(client, (sessions[0], "slow"), (sessions[1], "meet"), (sessions[2], "meet")))
    assert [status for status, _ in answers] == [200, 200, 200], answers


def test_steps_of_an_env_known_to_be_slow_start_at_once(make_client, barrier) -> None:
    client = make_client(env_ids=["barrier"])
    sessions = [_create(client, "barrier") for _ in range(4)]
    for session in sessions:  # the service learns that this env's steps are slow
        assert client.post("/step", json={"session_id": session, "action": "slow"}).status_code == 200
    assert _as_step_answers(_steps(client, (sessions[0], "slow")))[0][0] == 200
    barrier.barrier = threading.Barrier(4)
    answers = _as_step_answers(_steps(client, *((session, "meet") for session in sessions)))
    assert [status for status, _ in answers] == [200] * 4, answers


# ---- the client's Coalescer ---------------------------------------------------------------------------------


class RecordingSend:
    """A `send` that records its batches and answers each item with its upper-case; the first batch waits for
    `release` (so that the calls after it queue up)."""

    def __init__(self, hold_first: bool = True) -> None:
        self.batches: list[list[str]] = []
        self.release = threading.Event()
        self.hold_first = hold_first

    def __call__(self, items: list[str]) -> list[Any]:
        self.batches.append(list(items))
        if self.hold_first and len(self.batches) == 1:
            assert self.release.wait(10)
        return [ValueError(f"bad {item}") if item.startswith("bad") else item.upper() for item in items]


def _calls_in_threads(coalescer: Coalescer, items: list[str]) -> tuple[list[threading.Thread], dict[str, Any]]:
    results: dict[str, Any] = {}

    def call(item: str) -> None:
        try:
            results[item] = coalescer.call(item, len(item))
        except Exception as exc:  # noqa: BLE001 - recorded for the test to check
            results[item] = exc

    threads = [threading.Thread(target=call, args=(item,)) for item in items]
    return threads, results


def _wait_until(condition, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < end, "condition not met in time"
        time.sleep(0.005)


def _first_batch_out(coalescer: Coalescer, send: RecordingSend, item: str) -> tuple[threading.Thread, dict]:
    """Call `item` on a thread and wait until its batch is out (held there by `send` until `send.release`)."""
    threads, results = _calls_in_threads(coalescer, [item])
    threads[0].start()
    _wait_until(lambda: len(send.batches) == 1)
    return threads[0], results


def test_calls_made_while_a_batch_is_out_leave_together_each_with_its_own_outcome() -> None:
    send = RecordingSend()
    coalescer = Coalescer(send, max_items=10, max_bytes=1000, max_in_flight=1, hold_s=60)
    first, results = _first_batch_out(coalescer, send, "a")
    later, later_results = _calls_in_threads(coalescer, ["b", "bad", "d"])
    for thread in later:
        thread.start()
    _wait_until(lambda: coalescer.pending() == 3)  # held back by the batch out
    send.release.set()
    for thread in [first, *later]:
        thread.join(10)
    assert sorted(send.batches[1]) == ["b", "bad", "d"] and len(send.batches) == 2
    assert results == {"a": "A"} and later_results["b"] == "B" and later_results["d"] == "D"
    assert isinstance(later_results["bad"], ValueError)  # an item's own failure reaches its caller only
    assert (coalescer.batches, coalescer.items) == (2, 4)


def test_a_batch_out_past_the_hold_time_no_longer_holds_calls_back() -> None:
    send = RecordingSend()
    coalescer = Coalescer(send, max_items=10, max_bytes=1000, max_in_flight=1, hold_s=0.05)
    first, results = _first_batch_out(coalescer, send, "slow")
    assert coalescer.call("next") == "NEXT"  # answered while the first batch is still out
    assert not send.release.is_set() and first.is_alive()
    send.release.set()
    first.join(10)
    assert results == {"slow": "SLOW"}


def test_batches_keep_to_the_item_and_byte_limits_and_a_failed_send_reaches_every_caller() -> None:
    send = RecordingSend()
    coalescer = Coalescer(send, max_items=2, max_bytes=6, max_in_flight=1, hold_s=60)
    _first_batch_out(coalescer, send, "w")
    # Queued in this order, they leave as: two items (the item limit); "rr" alone (with "sssss" it would be 7 > 6
    # bytes); "sssss" alone; "tttttttt" alone, over the byte limit by itself.
    items = ["p", "q", "rr", "sssss", "tttttttt"]
    for item in items:
        thread, _ = _calls_in_threads(coalescer, [item])
        thread[0].start()
        _wait_until(lambda n=items.index(item) + 1: coalescer.pending() == n)
    send.release.set()
    _wait_until(lambda: coalescer.pending() == 0 and len(send.batches) == 5)
    assert send.batches[1:] == [["p", "q"], ["rr"], ["sssss"], ["tttttttt"]]

    def broken(items: list[str]) -> list[Any]:
        raise ConnectionError("the service went away")

    failing = Coalescer(broken, max_items=4, max_bytes=100)
    with pytest.raises(ConnectionError, match="went away"):
        failing.call("x")


# ---- steps in turn: one hand-off for a batch's serial steps -----------------------------------------------------


def test_in_turn_calls_share_one_thread_and_a_stuck_one_times_out_alone() -> None:
    """`_CallThreads.run_in_turn`: the calls run one after another on one pool thread; the one past its limit gets
    its own `EnvCallTimeout` (its thread is left stuck) and the calls after it still run, on another thread."""
    from envservice.backends import EnvCallTimeout, _CallThreads

    threads, release, ran_on = _CallThreads(4), threading.Event(), []

    def record(value: str):
        def call() -> str:
            ran_on.append(threading.get_ident())
            return value
        return call

    def hang() -> str:
        release.wait(10)
        return "late"

    try:
        outcomes = threads.run_in_turn([record("a"), record("b"), hang, record("c")], timeout_s=0.3)
        assert [outcome.value for outcome in outcomes] == ["a", "b", None, "c"]
        assert isinstance(outcomes[2].error, EnvCallTimeout) and outcomes[2].seconds == 0.3
        assert ran_on[0] == ran_on[1] != ran_on[2] and threading.get_ident() not in ran_on  # one hand-off, then one more
        assert threads.stuck == 1
    finally:
        release.set()
    _wait_until(lambda: threads.stuck == 0)  # the stuck call returned: its thread left, nothing was answered twice
    threads.stop()


def test_in_turn_calls_not_started_within_the_budget_are_left_to_the_caller() -> None:
    from envservice.backends import _CallThreads

    threads = _CallThreads(2)
    outcomes = threads.run_in_turn([lambda: time.sleep(0.05) or 1, lambda: 2, lambda: 3], timeout_s=5, budget_s=0.01)
    assert outcomes[0].value == 1 and outcomes[1:] == [None, None]  # the caller runs them otherwise
    threads.stop()


def test_a_stuck_step_of_a_batch_ends_its_own_session_and_the_steps_after_it_are_answered(make_client,
                                                                                          test_envs) -> None:
    """Three serial steps under a 0.5 s limit, the middle one stuck: it answers `env_timeout` and closes its session
    only; the step before it and the one after it (run once the stuck one was given up) answer as /step would."""
    from envservice.backends import InProcessBackend

    gated_env = test_envs["gated"]
    gated_env.gate.clear()
    client = make_client(backend=InProcessBackend(step_timeout_s=0.5))
    before, gated, after = _create(client), _create(client, "gated"), _create(client)
    try:
        answers = _as_step_answers(_steps(client, (before, "inc"), (gated, "wait"), (after, "inc")))
    finally:
        gated_env.gate.set()
    assert answers[0] == answers[2] == (200, {"observation": "value 1", "reward": 0.0, "terminated": False,
                                              "truncated": False, "info": {"steps": 1}})
    status, error = answers[1]
    assert status == 504 and error["code"].value == "env_timeout" and "within 0.5 s" in error["message"]
    health = client.get("/healthz").json()
    assert health["closed"] == {"env_timeout": 1} and health["sessions"] == 2
    assert _step_answer(client, after, "inc")[1]["observation"] == "value 2"
