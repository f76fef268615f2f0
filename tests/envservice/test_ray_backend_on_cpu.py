"""`--backend ray` on a local Ray (2 CPUs): envs live in Ray actors; a dying or hung actor is contained.

The app runs in-process (FastAPI TestClient) with a `RayBackend` of 2 actors; the faulty test env
(`envservice/envs/testing.py`) is registered here and imported by the actors from its entry point.
"""

from __future__ import annotations

import os
import time
from typing import Iterator

import pytest
from fastapi.testclient import TestClient

from envservice.envs.frozenlake import shortest_path_actions
from envservice import registry
from envservice.envs.testing import ENTRY_POINT as FAULTY
from envservice.protocol import CreateResponse, ErrorResponse
from envservice.server import EnvServiceConfig, create_app

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow, pytest.mark.startup]  # Ray's start: the full run only

STEP_TIMEOUT_S = 5.0


def _start_local_ray(attempts: int = 3) -> None:
    """ray.init with a retry: on a busy 2-core machine the first start can time out."""
    for attempt in range(attempts):
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            return
        except Exception:
            ray.shutdown()
            if attempt == attempts - 1:
                raise


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    from envservice.ray_hosts import RayBackend

    _start_local_ray()
    registry.register("faulty", FAULTY)  # registered by the test, never by the library
    backend = RayBackend(2, STEP_TIMEOUT_S, actor_options={"num_cpus": 0.5})  # room for a replacement actor
    app = create_app(EnvServiceConfig(env_ids=["frozenlake", "faulty"], backend=backend))
    try:
        with TestClient(app, raise_server_exceptions=False) as test_client:
            yield test_client
    finally:
        registry.unregister("faulty")
        ray.shutdown()


def _create(client: TestClient, env_id: str = "faulty", **fields) -> CreateResponse:
    response = client.post("/create", json={"env_id": env_id, **fields})
    assert response.status_code == 200, response.text
    return CreateResponse.model_validate(response.json())


def _step(client: TestClient, session_id: str, action: str):
    return client.post("/step", json={"session_id": session_id, "action": action})


def test_frozenlake_oracle_episode_through_ray_actors(client) -> None:
    probe = _create(client)
    assert probe.info["pid"] != os.getpid()  # envs run in an actor process, not here
    created = _create(client, "frozenlake", task_id=9, seed=0, params={"size": 6})
    for action in shortest_path_actions(created.info["map"]):
        step = _step(client, created.session_id, action).json()
    assert step["terminated"] and step["reward"] == 1.0
    assert client.post("/evaluate", json={"session_id": created.session_id}).json()["success"] is True
    for session_id in (probe.session_id, created.session_id):
        client.post("/release", json={"session_id": session_id})


def test_a_dying_actor_ends_only_its_own_session(client) -> None:
    doomed, other = _create(client), _create(client)
    assert doomed.info["pid"] != other.info["pid"]
    response = _step(client, doomed.session_id, "exit")
    error = ErrorResponse.model_validate(response.json())
    assert (response.status_code, error.code.value) == (500, "env_error")
    assert f"pid {doomed.info['pid']}" in error.message and "died (ActorDiedError" in error.message
    assert _step(client, other.session_id, "inc").json()["info"]["pid"] == other.info["pid"]
    fresh = _create(client)  # on the replacement actor
    assert fresh.info["pid"] not in (doomed.info["pid"], other.info["pid"])
    assert _step(client, fresh.session_id, "inc").json()["observation"] == "value 1"
    assert client.get("/healthz").json()["sessions"] == 2
    for session_id in (other.session_id, fresh.session_id):
        client.post("/release", json={"session_id": session_id})


def test_hung_step_is_env_timeout_and_the_actor_is_replaced(client) -> None:
    hung, other = _create(client), _create(client)
    started = time.monotonic()
    response = _step(client, hung.session_id, "hang")
    assert STEP_TIMEOUT_S <= time.monotonic() - started < STEP_TIMEOUT_S + 10
    error = ErrorResponse.model_validate(response.json())
    assert (response.status_code, error.code.value) == (504, "env_timeout")
    assert "was killed and restarted" in error.message
    assert _step(client, other.session_id, "inc").status_code == 200
    fresh = _create(client)
    assert fresh.info["pid"] != hung.info["pid"]
    for session_id in (other.session_id, fresh.session_id):
        client.post("/release", json={"session_id": session_id})


def test_calls_waiting_for_a_busy_actor_are_not_taken_for_hung_ones(client, step_all_at_once) -> None:
    """#33 finding 4, Ray backend: an actor runs `max_concurrency` calls and queues the rest, and Ray's timeout
    counted from submission. One actor running one call at a time, four 1 s steps at once, a 2.5 s limit: the
    third and fourth used to pass the limit in the actor's queue, and the actor was killed with every session on
    it. Now the service sends the actor only what it can run, and each call has 2.5 s from its start."""
    from envservice.envs.base import Task
    from envservice.latency import InjectedLatency, LatencySpec
    from envservice.ray_hosts import RayBackend

    latency = InjectedLatency.from_specs(LatencySpec("fixed", {"seconds": 1.0}), None)
    backend = RayBackend(1, 2.5, actor_options={"num_cpus": 0.25, "max_concurrency": 1}, latency=latency)
    try:
        envs, answers = step_all_at_once(backend, "faulty")
        assert answers == ["value 1"] * 4
        assert len({env.reset(Task(split="train", index=0, name="count", seed=0))[1]["pid"] for env in envs}) == 1
    finally:
        backend.shutdown()
