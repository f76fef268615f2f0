"""The HTTP service in-process (FastAPI TestClient): status codes, error bodies, isolation, limits, auth."""

from __future__ import annotations

import pytest

from envservice.protocol import CreateResponse, EnvList, ErrorResponse, EvaluateResponse, Health, StepResponse

pytestmark = pytest.mark.timeout(60)


def _error(response, status: int, code: str) -> ErrorResponse:
    assert response.status_code == status, response.text
    error = ErrorResponse.model_validate(response.json())
    assert error.code.value == code
    return error


def _create(client, env_id: str = "counting", **fields) -> CreateResponse:
    response = client.post("/create", json={"env_id": env_id, **fields})
    assert response.status_code == 200, response.text
    return CreateResponse.model_validate(response.json())


def _step(client, session_id: str, action: str):
    return client.post("/step", json={"session_id": session_id, "action": action})


def test_full_episode_create_step_evaluate_release(make_client, test_envs) -> None:
    client = make_client()
    created = _create(client, task_id=0, seed=4)
    assert (created.env_id, created.task_id, created.seed, created.observation) == ("counting", "count", 4, "value 0")
    for expected in (1, 2, 3):
        step = StepResponse.model_validate(_step(client, created.session_id, "inc").json())
        assert step.observation == f"value {expected}" and step.info["steps"] == expected
    assert step.terminated and not step.truncated and step.reward == 1.0
    evaluation = EvaluateResponse.model_validate(client.post("/evaluate", json={"session_id": created.session_id}).json())
    assert evaluation.success and evaluation.score == 1.0
    assert client.post("/release", json={"session_id": created.session_id}).json()["released"] is True


def test_unknown_env_is_404_listing_served_ids(make_client, test_envs) -> None:
    client = make_client(env_ids=["counting", "frozenlake"])
    error = _error(client.post("/create", json={"env_id": "chess"}), 404, "unknown_env")
    assert "env_id='chess'" in error.message and error.valid_choices == ["counting", "frozenlake"]


def test_unknown_task_split_and_params_name_the_field(make_client) -> None:
    client = make_client(env_ids=["frozenlake"])
    error = _error(client.post("/create", json={"env_id": "frozenlake", "task_id": 5000}), 400, "unknown_task")
    assert "task_id=5000" in error.message and "1000 tasks" in error.message
    error = _error(client.post("/create", json={"env_id": "frozenlake", "split": "dev"}), 400, "unknown_task")
    assert "split='dev'" in error.message and error.valid_choices == ["test", "train"]
    error = _error(client.post("/create", json={"env_id": "frozenlake", "task_id": "map-x"}), 400, "unknown_task")
    assert error.valid_choices[:2] == ["map-0", "map-1"]
    error = _error(client.post("/create", json={"env_id": "frozenlake", "params": {"colour": 1}}), 400, "bad_request")
    assert "colour" in error.message and error.valid_choices == ["around", "size", "slippery"]


def test_malformed_body_is_422_naming_the_fields(make_client) -> None:
    client = make_client()
    error = _error(client.post("/step", json={"session": "x"}), 422, "invalid_request")
    fields = {tuple(item["loc"]) for item in error.detail}
    assert {("body", "session_id"), ("body", "action"), ("body", "session")} <= fields
    assert "body.action: Field required" in error.message
    _error(client.post("/create", json={"env_id": "babyai", "seed": "abc"}), 422, "invalid_request")


def test_released_session_is_404_but_a_second_release_succeeds(make_client, test_envs) -> None:
    client = make_client()
    created = _create(client)
    first = client.post("/release", json={"session_id": created.session_id}).json()
    assert first == {"session_id": created.session_id, "released": True, "already_closed": False, "closed_by": None}
    for path, body in (("/step", {"action": "inc"}), ("/evaluate", {})):
        error = _error(client.post(path, json={"session_id": created.session_id, **body}), 404, "unknown_session")
        assert "it was closed (release)" in error.message
    # A retried release (its first reply lost) is a success that says the session was closed already.
    again = client.post("/release", json={"session_id": created.session_id})
    assert again.status_code == 200
    assert again.json() == {"session_id": created.session_id, "released": True, "already_closed": True,
                            "closed_by": "release"}
    _error(client.post("/release", json={"session_id": "never-created"}), 404, "unknown_session")


def test_step_after_end_is_409_but_evaluate_still_works(make_client, test_envs) -> None:
    client = make_client()
    created = _create(client)
    for _ in range(3):
        _step(client, created.session_id, "inc")
    error = _error(_step(client, created.session_id, "inc"), 409, "episode_over")
    assert "after 3 steps" in error.message
    assert client.post("/evaluate", json={"session_id": created.session_id}).json()["success"] is True


def test_max_steps_truncates_and_says_why(make_client, test_envs) -> None:
    client = make_client()
    created = _create(client)
    responses = [_step(client, created.session_id, "wait").json() for _ in range(5)]  # registered max_steps=5
    assert [r["truncated"] for r in responses] == [False] * 4 + [True]
    assert not responses[-1]["terminated"] and responses[-1]["info"]["truncation"] == "max_steps"
    _error(_step(client, created.session_id, "wait"), 409, "episode_over")


def test_env_exception_is_env_error_for_that_session_only(make_client, test_envs) -> None:
    client = make_client()
    crashing, healthy = _create(client), _create(client)
    error = _error(_step(client, crashing.session_id, "boom"), 500, "env_error")
    assert "simulated crash inside the env" in error.message
    _error(_step(client, crashing.session_id, "inc"), 404, "unknown_session")  # closed and dropped
    assert _step(client, healthy.session_id, "inc").json()["observation"] == "value 1"
    assert Health.model_validate(client.get("/healthz").json()).sessions == 1


def test_capacity_per_env_and_total_is_503(make_client, test_envs) -> None:
    client = make_client(max_sessions=4)
    sessions = [_create(client) for _ in range(3)]  # "counting" allows 3
    error = _error(client.post("/create", json={"env_id": "counting"}), 503, "capacity")
    assert "env_id='counting' is full (3 sessions)" in error.message
    _create(client, "frozenlake")
    error = _error(client.post("/create", json={"env_id": "frozenlake"}), 503, "capacity")
    assert "service is full (4 sessions)" in error.message
    client.post("/release", json={"session_id": sessions[0].session_id})
    _create(client)  # a released slot is free again


def test_envs_lists_tasks_limits_and_params(make_client) -> None:
    client = make_client(env_ids=["babyai", "textcraft", "frozenlake"])
    specs = {spec.id: spec for spec in EnvList.model_validate(client.get("/envs").json()).envs}
    assert list(specs) == ["babyai", "textcraft", "frozenlake"]
    assert specs["textcraft"].tasks == {"train": 335, "test": 84}
    assert specs["babyai"].tasks["train"] == 10 and specs["babyai"].max_steps == 128
    assert set(specs["frozenlake"].params) == {"size", "slippery", "around"}


def test_token_required_when_set(make_client) -> None:
    client = make_client(env_ids=["frozenlake"], token="s3cret")
    _error(client.get("/envs"), 401, "unauthorized")
    _error(client.post("/create", json={"env_id": "frozenlake"}, headers={"Authorization": "Bearer wrong"}),
           401, "unauthorized")
    assert client.get("/envs", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    assert client.get("/healthz").status_code == 200  # liveness stays open for launchers


def test_idle_sessions_are_reaped_and_closed(make_client, test_envs, wait_for) -> None:
    client = make_client(idle_timeout_s=0.3, reap_interval_s=0.05)
    closes = test_envs["counting"].closes
    created = _create(client)
    assert wait_for(lambda: client.get("/healthz").json()["sessions"] == 0, 5.0)
    # The reaper takes the session out of the table before it closes the env, so the count can reach 0 a
    # moment before `close()` has run: wait for the close too (CI caught 18 == 19 here).
    assert wait_for(lambda: test_envs["counting"].closes == closes + 1, 5.0)
    _error(_step(client, created.session_id, "inc"), 404, "unknown_session")
