"""`EnvClient` retry rules with a scripted transport, and the command-line checks of `python -m envservice`.

The step tests run on both of the client's ways to step: alone through /step, and batched through /steps
(`EnvClient(batch_steps=True)`), where the same answers come back inside a batch (`ScriptedAdapter`)."""

from __future__ import annotations

import pytest
import requests
from requests.adapters import BaseAdapter

from envservice.__main__ import is_loopback, main, parse_env_ids
from envservice.client import EnvClient
from envservice.errors import EnvServiceError

OK_STEP = {"observation": "o", "reward": 0.0, "terminated": False, "truncated": False, "info": {}}


class ScriptedAdapter(BaseAdapter):
    """Answers requests from a script of (status, body) pairs or exceptions, and records them.

    A POST /steps gets the scripted /step answer as the service would send it: a step's outcome or error inside a
    200 batch; a 503 (refused before anything ran) stays the whole request's answer."""

    def __init__(self, script: list) -> None:
        super().__init__()
        self.script, self.calls, self.paths, self.proxies = list(script), 0, [], []

    def send(self, request, **kwargs) -> requests.Response:
        self.calls += 1
        self.paths.append(request.path_url)
        self.proxies.append(kwargs.get("proxies"))
        item = self.script.pop(0)
        if isinstance(item, Exception):
            raise item
        status, body, *whole = item  # a third element: the whole request's answer, never put in a batch
        if request.path_url == "/steps" and status != 503 and not whole:
            status, body = 200, {"results": [{"status": status, "step" if status == 200 else "error": body}]}
        response = requests.Response()
        response.status_code, response._content = status, requests.compat.json.dumps(body).encode()
        response.headers["Content-Type"] = "application/json"
        response.request = request
        return response

    def close(self) -> None:
        pass


@pytest.fixture(params=[False, True], ids=["step", "steps"])
def batched(request: pytest.FixtureRequest) -> bool:
    """Whether the client steps through /steps (True) or /step."""
    return request.param


def _client(script: list, retries: int = 3, batched: bool = False) -> tuple[EnvClient, ScriptedAdapter]:
    client = EnvClient("http://envservice.test", retries=retries, backoff_s=0.001, batch_steps=batched)
    adapter = ScriptedAdapter(script)
    client._http.mount("http://", adapter)
    return client, adapter


CAPACITY = (503, {"code": "capacity", "message": "full"})
REFUSED = requests.ConnectionError("HTTPConnectionPool: Max retries exceeded (NewConnectionError: Connection refused)")


def test_retries_503_then_succeeds(batched: bool) -> None:
    client, adapter = _client([CAPACITY, CAPACITY, (200, OK_STEP)], batched=batched)
    assert client.step("s", "a").observation == "o" and adapter.calls == 3


def test_gives_up_after_bounded_retries_with_the_last_error(batched: bool) -> None:
    client, adapter = _client([CAPACITY] * 3, retries=2, batched=batched)
    with pytest.raises(EnvServiceError) as failure:
        client.step("s", "a")
    assert failure.value.status == 503 and adapter.calls == 3


def test_does_not_retry_4xx(batched: bool) -> None:
    client, adapter = _client([(409, {"code": "episode_over", "message": "over"}), (200, OK_STEP)], batched=batched)
    with pytest.raises(EnvServiceError) as failure:
        client.step("s", "a")
    assert failure.value.code.value == "episode_over" and adapter.calls == 1


def test_busy_is_asked_again_as_nothing_ran(batched: bool) -> None:
    client, adapter = _client([(409, {"code": "busy", "message": "busy"}), (200, OK_STEP)], batched=batched)
    assert client.step("s", "a").observation == "o" and adapter.calls == 2


def test_step_retries_refused_connection_but_not_a_dropped_one(batched: bool) -> None:
    client, adapter = _client([REFUSED, (200, OK_STEP)], batched=batched)
    assert client.step("s", "a").observation == "o" and adapter.calls == 2
    dropped = requests.ConnectionError("Connection aborted: RemoteDisconnected")
    client, adapter = _client([dropped, (200, OK_STEP)], batched=batched)
    with pytest.raises(requests.ConnectionError):
        client.step("s", "a")  # the action may have been applied: repeating it could act twice
    assert adapter.calls == 1
    client, adapter = _client([dropped, (200, {"score": 1.0, "success": True})])
    assert client.evaluate("s").success and adapter.calls == 2  # evaluate is safe to repeat


def test_a_service_without_the_batch_route_is_stepped_through_step() -> None:
    no_route = (404, {"code": "not_found", "message": "no route POST /steps"}, "whole")
    client, adapter = _client([no_route, (200, OK_STEP), (200, OK_STEP)], batched=True)
    assert client.step("s", "a").observation == "o" and client.step("s", "b").observation == "o"
    assert adapter.paths == ["/steps", "/step", "/step"] and client.steps is None


def test_the_proxy_the_environment_names_at_start_is_used_for_every_request(monkeypatch, batched: bool) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.test:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    client, adapter = _client([(200, OK_STEP), (200, OK_STEP)], batched=batched)
    monkeypatch.delenv("HTTP_PROXY")  # read once, when the client was made (not on every request)
    client.step("s", "a")
    client.step("s", "b")
    assert [proxies.get("http") for proxies in adapter.proxies] == ["http://proxy.test:3128"] * 2


def test_response_is_validated_with_the_protocol_model(batched: bool) -> None:
    client, _ = _client([(200, {**OK_STEP, "extra": 1})], batched=batched)
    with pytest.raises(Exception, match="extra"):
        client.step("s", "a")


def test_cli_refuses_non_loopback_without_token(monkeypatch) -> None:
    monkeypatch.delenv("ENVSERVICE_TOKEN", raising=False)
    with pytest.raises(SystemExit, match="refusing to bind non-loopback host '0.0.0.0' without a token"):
        main(["--host", "0.0.0.0", "--port", "0"])
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("example.org")


def test_cli_unknown_env_lists_valid_ids() -> None:
    with pytest.raises(SystemExit, match=r"unknown id\(s\) \['chess'\]; valid ids: alfworld, appworld, babyai, code, frozenlake, sciworld, search, sokoban, "
                       r"tau2_airline, tau2_retail, terminal, textarena-guess-number, textarena-lights-out, textarena-mastermind, textcraft, textworld"):
        parse_env_ids("babyai,chess")
    assert parse_env_ids("textcraft, babyai") == ["textcraft", "babyai"]
