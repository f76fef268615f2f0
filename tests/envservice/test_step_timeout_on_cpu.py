"""The per-call time limit (`--step-timeout`) without worker processes: the in-process backend, the typed
client error, the episode's `timeout` termination, and the command-line checks of the placement flags."""

from __future__ import annotations

import re
import time

import pytest
import requests

from envservice import registry
from envservice.__main__ import parse_args
from envservice.backends import InProcessBackend
from envservice.client import EnvClient
from envservice.errors import EnvServiceError, EnvTimeoutError
from envservice.protocol import ERROR_STATUS, ErrorCode, ErrorResponse
from beyond_agent.rollout.episode_loop import EpisodeLoop, EpisodeConfig, EpisodeSpec

pytestmark = pytest.mark.timeout(60)


def test_inprocess_hung_step_is_504_env_timeout_and_only_that_session_closes(make_client, test_envs, wait_for):
    gated = test_envs["gated"]
    gated.gate.clear()
    backend = InProcessBackend(step_timeout_s=0.5)
    client = make_client(backend=backend)
    hung, healthy = (client.post("/create", json={"env_id": env_id}).json()["session_id"]
                     for env_id in ("gated", "counting"))
    started = time.monotonic()
    response = client.post("/step", json={"session_id": hung, "action": "wait"})  # blocks on the gate
    assert time.monotonic() - started < 3.0
    error = ErrorResponse.model_validate(response.json())
    assert (response.status_code, error.code) == (504, ErrorCode.env_timeout)
    assert f"did not finish step within 0.5 s (--step-timeout); session {hung} was closed" in error.message
    assert "its thread could not be stopped" in error.message
    assert client.post("/step", json={"session_id": hung, "action": "inc"}).status_code == 404
    assert client.post("/step", json={"session_id": healthy, "action": "inc"}).json()["observation"] == "value 1"
    assert backend._threads.stuck == 1
    gated.gate.set()  # the stuck thread returns and leaves the pool
    assert wait_for(lambda: backend._threads.stuck == 0, 5)


def test_no_limit_runs_env_calls_on_the_request_thread(test_envs) -> None:
    env = InProcessBackend(step_timeout_s=0).build(registry.get("counting"))
    assert type(env).__name__ == "CountingEnv"  # no wrapper, no thread hand-off


def test_client_raises_env_timeout_error_and_does_not_retry(monkeypatch) -> None:
    calls = []

    def answer(method, url, **kwargs):
        calls.append(url)
        response = requests.Response()
        response.status_code = 504
        response._content = b'{"code": "env_timeout", "message": "env did not finish step within 1 s"}'
        return response

    client = EnvClient("http://envservice.test", retries=3, backoff_s=0.001)
    monkeypatch.setattr(client._http, "request", answer)
    with pytest.raises(EnvTimeoutError) as failure:
        client.step("s", "go")
    assert isinstance(failure.value, EnvServiceError) and failure.value.status == 504
    assert ERROR_STATUS[ErrorCode.env_timeout] == 504 and len(calls) == 1  # a step may have been applied


class _HungEnvClient:
    """An EnvClient stand-in whose create answers the service's env_timeout (or another given error)."""

    def __init__(self, error: Exception | None = None):
        self.error = error or EnvTimeoutError(ErrorCode.env_timeout, "env 'babyai' did not finish reset within 60 s")

    def create(self, *args):
        raise self.error

    def release(self, session_id):
        raise AssertionError("no session was created")


def test_env_timeout_ends_the_episode_with_timeout_not_env_error() -> None:
    config = EpisodeConfig(max_prompt_length=64, max_response_length=64, max_tokens_per_turn=8)
    result = EpisodeLoop(EpisodeSpec("babyai"), _HungEnvClient(), None, None, config, max_rounds=4).run()
    assert (result.termination, result.infra_failure, result.reward) == ("timeout", True, 0.0)
    assert "EnvTimeoutError" in result.error and "did not finish reset" in result.error


def test_client_read_timeout_ends_the_episode_with_timeout() -> None:
    # Our own request deadline (beyond_agent.env.timeout_s) passing is a hung env too, not an env_error.
    config = EpisodeConfig(max_prompt_length=64, max_response_length=64, max_tokens_per_turn=8)
    client = _HungEnvClient(requests.ReadTimeout("read timed out after 90 s"))
    result = EpisodeLoop(EpisodeSpec("babyai"), client, None, None, config, max_rounds=4).run()
    assert (result.termination, result.infra_failure) == ("timeout", True) and "ReadTimeout" in result.error


@pytest.mark.parametrize("argv, message", [
    (["--backend", "threads"], "--backend 'threads' is unknown; valid backends: inprocess, process, ray"),
    (["--workers", "2"], "--workers 2 is invalid: it needs --backend process or ray"),
    (["--backend", "process", "--workers", "0"], "--workers 0 is invalid"),
    (["--backend", "process", "--ray-address", "auto"], "--ray-address / --ray-resources need --backend ray"),
    (["--step-timeout", "-1"], "--step-timeout -1 is invalid; give seconds > 0, or 0 for no limit"),
    (["--backend", "ray", "--ray-resources", "[1]"], "--ray-resources must be a JSON object"),
])
def test_cli_placement_flags_are_checked(argv, message) -> None:
    with pytest.raises(SystemExit, match=re.escape(message)):
        parse_args(argv)
    assert parse_args(["--backend", "process", "--workers", "3"]).workers == 3
