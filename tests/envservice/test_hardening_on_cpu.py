"""Regression tests of the bugs an independent attack on envservice found, each named after its bug.

In-process (FastAPI TestClient) where the app's answer is the point; over a real socket to a live
`python -m envservice` where the transport is (keep-alive after an error, a body refused before it is read,
a reply lost on the way back).
"""

from __future__ import annotations

import json
import socket
import time
from typing import Any, Callable, Iterator

import pytest
import requests
from requests.adapters import HTTPAdapter

from envservice.client import EnvClient
from envservice.envs.base import StepResult, Task, TextEnv
from envservice.process import EnvServiceProcess
from envservice.protocol import MAX_ACTION_CHARS, MAX_NAME_CHARS, MAX_SEED, ErrorResponse

pytestmark = pytest.mark.timeout(120)

TOKEN = "hardening-token"
LIMIT_BYTES = 64 * 1024


def _error(response, status: int, code: str) -> ErrorResponse:
    assert response.status_code == status, response.text
    error = ErrorResponse.model_validate(response.json())
    assert error.code.value == code, response.text
    assert response.headers["x-request-id"], "every answer carries a request id"
    return error


def _create(client, env_id: str = "counting", **fields) -> str:
    response = client.post("/create", json={"env_id": env_id, **fields})
    assert response.status_code == 200, response.text
    return response.json()["session_id"]


class SurrogateEnv(TextEnv):
    """An env whose observation holds a lone surrogate (what an env could produce from bad bytes)."""

    description = "test env: lone surrogate in its observation"
    splits = {"train": ["only"]}

    def reset(self, task: Task) -> tuple[str, dict[str, Any]]:
        return "start", {}

    def step(self, action: str) -> StepResult:
        return "half a character: \ud800", 0.0, False, False, {}

    def evaluate(self) -> tuple[float, bool]:
        return 0.0, False


# ---- one error format for everything ------------------------------------------------------------------


def test_unknown_route_and_wrong_method_answer_in_our_format(make_client) -> None:
    client = make_client()
    assert "routes: POST /create" in _error(client.get("/nope"), 404, "not_found").message
    error = _error(client.get("/step"), 405, "method_not_allowed")
    assert "GET /step is not allowed" in error.message and client.get("/step").headers["allow"] == "POST"


@pytest.mark.parametrize("body", [
    b'{"session_id": "s", "action": "\xff\xfe"}',  # not UTF-8
    b"[" * 100_000 + b"]" * 100_000,  # nesting deeper than the JSON parser recurses
    b'{"session_id": "s", "action": ' + b"9" * 5000 + b"}",  # an integer past Python's digit limit
    b'{"session_id": "s", "action": "x"',  # cut short
], ids=["not_utf8", "deep_nesting", "huge_integer", "truncated"])
def test_unparseable_body_is_an_error_in_our_format_not_the_frameworks(make_client, body: bytes) -> None:
    response = make_client().post("/step", content=body, headers={"content-type": "application/json"})
    assert response.status_code in (400, 422), response.text
    error = ErrorResponse.model_validate(response.json())  # our body: code and message, not {"detail": ...}
    assert error.code.value in ("bad_request", "invalid_request") and error.message
    assert len(response.content) < 5000, "the error quotes the body whole"


def test_internal_error_is_a_500_in_our_format_with_a_logged_request_id(make_client, caplog, monkeypatch) -> None:
    client = make_client()

    def broken() -> dict:
        raise RuntimeError("simulated bug in the service")

    with monkeypatch.context() as patch:
        patch.setattr(client.app.state.sessions, "ledger", broken)
        response = client.get("/healthz")
    error = _error(response, 500, "internal_error")
    assert error.request_id == response.headers["x-request-id"] and error.request_id in error.message
    assert any(error.request_id in record.getMessage() and record.exc_info for record in caplog.records)
    assert "simulated bug" not in response.text  # the traceback stays in the log


def test_lone_surrogate_in_observation_is_escaped_not_a_plain_text_500(make_client) -> None:
    from envservice import registry

    registry.register("surrogate", SurrogateEnv)
    try:
        client = make_client(env_ids=["surrogate"])
        session_id = _create(client, "surrogate")
        response = client.post("/step", json={"session_id": session_id, "action": "go"})
        assert response.status_code == 200, response.text
        assert "\\ud800" in response.text and response.json()["observation"] == "half a character: \ud800"
    finally:
        registry.unregister("surrogate")


# ---- bounded input, clipped echoes --------------------------------------------------------------------------


def test_overlong_action_and_id_are_422_naming_the_field_and_the_limit(make_client, test_envs) -> None:
    client = make_client()
    session_id = _create(client)
    error = _error(client.post("/step", json={"session_id": session_id, "action": "x" * (MAX_ACTION_CHARS + 1)}),
                   422, "invalid_request")
    assert "body.action" in error.message and str(MAX_ACTION_CHARS) in error.message
    error = _error(client.post("/release", json={"session_id": "s" * (MAX_NAME_CHARS + 1)}), 422, "invalid_request")
    assert "body.session_id" in error.message and str(MAX_NAME_CHARS) in error.message
    assert client.post("/step", json={"session_id": session_id, "action": "inc"}).json()["info"]["steps"] == 1


def test_huge_input_is_never_echoed_whole_in_errors(make_client, test_envs) -> None:
    client = make_client()
    long_name = "t" * MAX_NAME_CHARS
    response = client.post("/create", json={"env_id": "counting", "task_id": long_name})
    assert "…[+" in _error(response, 400, "unknown_task").message and len(response.content) < 3000
    # A body whose other field is huge: the 422's detail quotes its input clipped.
    response = client.post("/step", json={"action": "a" * 90_000})
    _error(response, 422, "invalid_request")
    assert len(response.content) < 3000, "the whole action came back in the error detail"
    response = client.post("/create", json={"env_id": "counting", "params": {"p" * 400: 1}})
    assert len(response.content) < 3000 and "…[+" in _error(response, 400, "bad_request").message


# ---- strict types ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fields", [
    {"task_id": True}, {"task_id": -1}, {"seed": "5"}, {"seed": -1}, {"seed": MAX_SEED + 1}, {"seed": 1.5},
    {"split": ""}, {"env_id": 7},
], ids=["bool_task", "negative_task", "string_seed", "negative_seed", "seed_too_big", "float_seed", "empty_split",
        "int_env"])
def test_loose_types_are_422_before_any_env_is_built(make_client, test_envs, fields: dict) -> None:
    CountingEnv = test_envs["counting"]
    client = make_client()
    closes = CountingEnv.closes
    error = _error(client.post("/create", json={"env_id": "counting", **fields}), 422, "invalid_request")
    field = next(iter(fields))
    assert f"body.{field}" in error.message
    assert client.get("/healthz").json()["created"] == 0 and CountingEnv.closes == closes


@pytest.mark.parametrize("params, says", [
    ({"slippery": "false"}, "params.slippery='false' must be a JSON boolean, not a string"),
    ({"slippery": 0}, "params.slippery=0 must be a JSON boolean, not an integer"),
    ({"size": "6"}, "params.size='6' must be a JSON integer, not a string"),
    ({"size": True}, "params.size=True must be a JSON integer, not a boolean"),
])
def test_env_params_are_checked_against_their_declared_types(make_client, params: dict, says: str) -> None:
    client = make_client(env_ids=["frozenlake"])
    assert says in _error(client.post("/create", json={"env_id": "frozenlake", "params": params}),
                          400, "bad_request").message
    types = client.get("/envs").json()["envs"][0]["param_types"]
    assert types == {"size": "integer", "slippery": "boolean", "around": "boolean"}


# ---- auth and limits before the body, over a real socket -------------------------------------------------------


@pytest.fixture(scope="module")
def guarded_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A live service with a token and a 64 KiB request limit."""
    log = tmp_path_factory.mktemp("hardening") / "service.log"
    with EnvServiceProcess(["frozenlake"], extra_args=["--token", TOKEN, "--max-request-bytes", str(LIMIT_BYTES)],
                           log_path=log, startup_timeout_s=60, env={"ENVSERVICE_TOKEN": ""}) as service:
        yield service.url


def _raw_exchange(url: str, head: str, body: bytes = b"", timeout_s: float = 5.0) -> tuple[float, str]:
    """Send a request head (and maybe part of a body) on a raw socket; (seconds to the answer, answer text)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        started = time.monotonic()
        sock.sendall(head.encode() + b"\r\n" + body)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _content_length(answer):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        return time.monotonic() - started, answer.decode("utf-8", "replace")


def _content_length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def test_unauthenticated_upload_is_refused_before_its_body_is_read(guarded_service: str) -> None:
    # The head announces 300 MiB and none of it is sent: an answer proves the server never waited for the body.
    head = "POST /step HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 314572800\r\n"
    seconds, answer = _raw_exchange(guarded_service, head)
    assert answer.startswith("HTTP/1.1 401") and seconds < 2, answer
    assert 'www-authenticate: bearer realm="envservice"' in answer.lower()
    assert '"code":"unauthorized"' in answer


def test_oversized_body_is_413_before_it_is_read(guarded_service: str) -> None:
    head = (f"POST /step HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {LIMIT_BYTES + 1}\r\n")
    seconds, answer = _raw_exchange(guarded_service, head, b'{"session_id": "')
    assert answer.startswith("HTTP/1.1 413") and seconds < 2, answer
    assert '"code":"too_large"' in answer and "--max-request-bytes" in answer


def test_chunked_body_over_the_limit_is_413_while_it_streams(guarded_service: str) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"session_id": "s", "action": "'
        for _ in range(64):  # 4 MiB in all, far past the 64 KiB limit
            yield b"x" * 65536

    response = requests.post(f"{guarded_service}/step", data=chunks(), timeout=10,
                             headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
    _error(response, 413, "too_large")


def test_docs_routes_need_the_token_and_healthz_does_not(guarded_service: str) -> None:
    for path in ("/openapi.json", "/docs", "/redoc", "/envs"):
        response = requests.get(guarded_service + path, timeout=5)
        _error(response, 401, "unauthorized")
        assert response.headers["www-authenticate"] == 'Bearer realm="envservice"'
        authorised = requests.get(guarded_service + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5)
        assert authorised.status_code == 200, path
    assert requests.get(guarded_service + "/healthz", timeout=5).status_code == 200


def test_lone_surrogate_in_action_is_422_never_reaches_the_env_and_keeps_the_connection(guarded_service: str) -> None:
    with EnvClient(guarded_service, token=TOKEN) as client:
        created = client.create("frozenlake", task_id=0, seed=0)
        http = requests.Session()
        http.headers["Authorization"] = f"Bearer {TOKEN}"
        body = '{"session_id": "%s", "action": "\\ud800"}' % created.session_id  # valid JSON, not valid text
        response = http.post(f"{guarded_service}/step", data=body, headers={"Content-Type": "application/json"})
        error = _error(response, 422, "invalid_request")
        assert "body.action" in error.message
        # The same keep-alive connection still works, and the refused step never reached the env.
        step = http.post(f"{guarded_service}/step", json={"session_id": created.session_id, "action": "right"})
        assert step.status_code == 200 and step.json()["info"]["steps"] == 1
        client.release(created.session_id)


class _DropsFirstReleaseReply(HTTPAdapter):
    """Lets the first /release reach the server, then loses its reply (a dropped connection)."""

    dropped = 0

    def send(self, request, *args, **kwargs):
        response = super().send(request, *args, **kwargs)
        if request.url.endswith("/release") and not self.dropped:
            self.dropped += 1
            raise requests.ConnectionError("connection reset by peer (simulated, after the server answered)")
        return response


def test_retried_release_after_a_lost_reply_is_a_success(guarded_service: str) -> None:
    with EnvClient(guarded_service, token=TOKEN, backoff_s=0.01) as client:
        created = client.create("frozenlake", task_id=0, seed=0)
        adapter = _DropsFirstReleaseReply()
        client._http.mount("http://", adapter)
        released = client.release(created.session_id)  # the first attempt worked; its retry must not say 404
        assert adapter.dropped == 1
        assert (released.released, released.already_closed, released.closed_by) == (True, True, "release")
        health = client.health()
        assert health.created == health.sessions + sum(health.closed.values())


def test_every_answer_of_the_live_service_is_json_in_our_format(guarded_service: str) -> None:
    """A sample of bad requests over the wire: each answer parses as an ErrorResponse (never plain text)."""
    auth = {"Authorization": f"Bearer {TOKEN}"}
    cases = [("GET", "/nope", None), ("DELETE", "/create", None), ("POST", "/create", b"{"),
             ("POST", "/create", json.dumps({"env_id": "frozenlake", "seed": -3}).encode())]
    for method, path, body in cases:
        response = requests.request(method, guarded_service + path, data=body, headers={**auth,
                                    "Content-Type": "application/json"}, timeout=5)
        assert response.status_code >= 400 and response.headers["content-type"] == "application/json", response.text
        ErrorResponse.model_validate(response.json())


def test_client_sends_numpy_scalars_of_parquet_rows_as_plain_json(guarded_service: str) -> None:
    """The wire is strict (an int is an int), but task ids and seeds read from parquet are NumPy scalars."""
    import numpy as np

    with EnvClient(guarded_service, token=TOKEN) as client:
        created = client.create("frozenlake", task_id=np.int64(1), seed=np.int64(3),
                                params={"size": np.int64(5), "slippery": np.bool_(False)})
        assert (created.seed, len(created.info["map"])) == (3, 5)
        client.release(created.session_id)


# ---- round two (#33) ------------------------------------------------------------------------------------------


def test_a_body_with_thousands_of_bad_entries_gets_a_bounded_answer_quickly(make_client) -> None:
    """#33 finding 1: 100 000 bad `params` entries got 400 000 detail items (49 MB) after 25 s, and another
    client's /healthz waited meanwhile. The answer now lists the first problems and counts the rest."""
    client = make_client()
    response = client.post("/create", json={"env_id": "counting", "params": {f"p{i}": [[i]] for i in range(30_000)}})
    # Refused before validation: no object of the protocol has more than MAX_OBJECT_KEYS keys.
    assert "has 30000 keys; the protocol's objects have at most 256" in _error(response, 400, "bad_request").message
    assert len(response.content) < 1_000, len(response.content)
    # Within the key limit, a body with many bad entries gets the first 20 problems and a count of the rest.
    response = client.post("/create", json={"env_id": "counting", "params": {f"p{i}": [[i]] for i in range(250)}})
    error = _error(response, 422, "invalid_request")
    assert len(error.detail) == 20 and "more problems)" in error.message and len(response.content) < 20_000


@pytest.mark.parametrize("sent", ["with_length", "chunked"])
def test_a_host_whose_bodies_are_costly_to_check_waits_for_its_share(make_client, sent: str) -> None:
    """#33: 30 000-entry bodies, ~100 a second from one greedy host, kept the checking helper busy beside the
    service on its one core (an honest client's p99 2.2-2.6x quiet). A host's large-body checks may keep the helper
    busy only a share of the time: at 2 % its next such body waits 49x the last check's CPU time; 0 is no limit.
    A chunked body, whose length nobody announced, is held to the same share (it bypassed it at first)."""
    wide = json.dumps({"env_id": "counting", "params": {f"p{i}": [[i]] for i in range(30_000)}}).encode()

    def body() -> Any:
        return wide if sent == "with_length" else iter([wide[:1000], wide[1000:]])  # an iterator goes chunked

    def second_answer_s(client) -> float:
        client.post("/create", content=body(), headers={"Content-Type": "application/json"})  # starts the helper
        started = time.monotonic()
        response = client.post("/create", content=body(), headers={"Content-Type": "application/json"})
        assert "has 30000 keys" in _error(response, 400, "bad_request").message
        return time.monotonic() - started

    # The least of three: the helper runs at nice 10, so beside busy test workers one check's wall time can be
    # many times its CPU time (once 1.53 s), while the share charges CPU time.
    unlimited = min(second_answer_s(make_client(large_body_share=0)) for _ in range(3))
    shared = second_answer_s(make_client(large_body_share=0.02))
    # unlimited: one check and the round trip; shared: 49 checks' time more (hand-worked: 3x holds while the
    # round trip costs under 23 checks)
    assert shared >= 3 * unlimited, (shared, unlimited)


def test_the_405_names_the_allowed_methods(make_client) -> None:
    """#33 finding 8: the `Allow` header was looked up in the wrong case, so the message said `allowed: ?`."""
    message = _error(make_client().get("/step"), 405, "method_not_allowed").message
    assert message.endswith("allowed: POST"), message


def test_a_loopback_service_answers_only_to_loopback_host_names(guarded_service: str, tmp_path) -> None:
    """#33 finding 6: `Host: attacker.example` got 200 (DNS rebinding: a page on that site reaches a loopback
    service from the user's browser). Now 400 in our format, before the token is even looked at."""
    port = guarded_service.rsplit(":", 1)[1]
    for host in ("attacker.example", f"attacker.example:{port}", "127.0.0.1.attacker.example"):
        response = requests.get(f"{guarded_service}/healthz", headers={"Host": host}, timeout=5)
        assert f"Host {host!r} is not a name this service answers to" in _error(response, 400, "bad_request").message
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "localhost", f"[::1]:{port}"):
        assert requests.get(f"{guarded_service}/healthz", headers={"Host": host}, timeout=5).status_code == 200, host
    log = tmp_path / "named.log"
    with EnvServiceProcess(["frozenlake"], extra_args=["--allowed-host", "trainer.internal"], log_path=log,
                           startup_timeout_s=60) as service:  # a name its user adds is answered too
        response = requests.get(f"{service.url}/healthz", headers={"Host": "trainer.internal:8000"}, timeout=5)
        assert response.status_code == 200


@pytest.mark.parametrize("bind, extra, host, answered", [
    ("127.0.0.1", (), "localhost:1", True), ("127.0.0.1", (), "LOCALHOST", True), ("::1", (), "[::1]", True),
    ("127.0.0.1", (), "evil.example", False), ("127.0.0.1", (), "", False), ("127.0.0.1", ("box",), "box:9", True),
    ("0.0.0.0", (), "anything.example", True), ("0.0.0.0", ("box",), "other", False),
])
def test_allowed_hosts_by_hand(bind: str, extra: tuple, host: str, answered: bool) -> None:
    from envservice.childproc import allowed_hosts, host_allowed

    assert host_allowed(host, allowed_hosts(bind, extra)) is answered


def test_calls_queued_on_one_slow_session_never_starve_other_clients(tmp_path) -> None:
    """#33 finding 3: 100 concurrent /step calls on one session with a 0.5 s step parked one pool thread each,
    and another client's /healthz took 28 s. Now the calls the session cannot take are refused at once (409
    `busy`, nothing run), /healthz runs on the event loop, and our client retries `busy` until it gets in."""
    from concurrent.futures import ThreadPoolExecutor

    with EnvServiceProcess(["frozenlake"], extra_args=["--step-delay", "fixed:0.5"], log_path=tmp_path / "slow.log",
                           startup_timeout_s=60) as service:
        session = EnvClient(service.url).create("frozenlake", task_id=0).session_id

        def raw_step(_: int) -> tuple[int, str]:
            answer = requests.post(f"{service.url}/step", json={"session_id": session, "action": "right"}, timeout=30)
            return answer.status_code, answer.json().get("code", "")

        with ThreadPoolExecutor(100) as pool:
            calls = [pool.submit(raw_step, i) for i in range(100)]
            time.sleep(0.2)
            started = time.monotonic()
            health = requests.get(f"{service.url}/healthz", timeout=30)
            health_s = time.monotonic() - started
            answers = [call.result() for call in calls]
        # It took 28 s before; the bound only tells "answered beside the queue" from "waited behind it".
        assert health.status_code == 200 and health_s < 10, f"/healthz took {health_s:.1f} s"
        refused = [answer for answer in answers if answer[0] == 409]
        assert all(code == "busy" for _, code in refused) and len(refused) >= 90, answers
        assert all(status in (200, 409) for status, _ in answers), answers  # no 5xx, no timeout

        client = EnvClient(service.url, retries=6, backoff_s=0.2)
        fresh = client.create("frozenlake", task_id=0).session_id
        with ThreadPoolExecutor(2) as pool:  # two calls at once: one meets `busy`, waits and retries
            answers = list(pool.map(lambda call: call(fresh), [lambda s: client.step(s, "down"), client.evaluate]))
        assert len(answers) == 2


def test_calls_queued_for_a_worker_thread_are_not_taken_for_hung_ones(tmp_path) -> None:
    """#33 finding 4: one process worker (4 threads), 1 s steps, a 3 s limit and 16 sessions stepping at once:
    the limit counted from when the call was sent, so queued calls got 504, the worker was killed and all 16
    sessions closed (`worker_lost`), though each step takes 1 s. The limit now counts from the call's start."""
    from concurrent.futures import ThreadPoolExecutor

    with EnvServiceProcess(["frozenlake"], extra_args=["--backend", "process", "--workers", "1", "--step-delay",
                                                       "fixed:1", "--step-timeout", "3"],
                           log_path=tmp_path / "queued.log", startup_timeout_s=120) as service:
        client = EnvClient(service.url, retries=0, timeout=60)
        sessions = [client.create("frozenlake", task_id=0).session_id for _ in range(16)]
        started = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            steps = list(pool.map(lambda session: client.step(session, "right"), sessions))
        took = time.monotonic() - started
        assert len(steps) == 16 and took >= 3.5, took  # 16 one-second steps on 4 threads: ~4 s, none refused
        assert client.health().closed == {}, client.health()  # no session was lost to a killed worker


@pytest.fixture(scope="module")
def strict_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A live service with 1 s head and body deadlines and at most 24 connections (#33 finding 2)."""
    log = tmp_path_factory.mktemp("slow") / "service.log"
    with EnvServiceProcess(["frozenlake"], extra_args=["--head-timeout", "1", "--body-timeout", "1",
                                                       "--max-connections", "24"],
                           log_path=log, startup_timeout_s=60) as service:
        yield service.url


def _answer_within(url: str, send: Callable[[socket.socket], None], timeout_s: float = 30.0) -> tuple[float, str]:
    """Open a connection, `send` on it (maybe slowly), then read until the server closes; (seconds, answer)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        started = time.monotonic()
        send(sock)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return time.monotonic() - started, answer.decode(errors="replace")


def _drip(sock: socket.socket, data: bytes, every_s: float) -> None:
    """Send `data` a byte at a time (a slow client); stop when the server has closed the connection."""
    for index in range(len(data)):
        try:
            sock.sendall(data[index:index + 1])
        except (BrokenPipeError, ConnectionResetError):
            return
        time.sleep(every_s)


@pytest.mark.parametrize("send, status", [
    (lambda sock: None, 408),  # connects and says nothing
    (lambda sock: sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n"), 408),  # half a head
    (lambda sock: _drip(sock, b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n", every_s=0.1), 408),
    (lambda sock: sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nX-Big: " + b"a" * 200_000 + b"\r\n\r\n"),
     431),
], ids=["silent", "half_head", "dripped_head", "huge_header"])
def test_slow_or_greedy_heads_are_answered_and_closed(strict_service: str, send, status: int) -> None:
    """#33 finding 2: these stayed open past 65 s (a 200 MB header was accepted, RSS 82 -> 361 MB)."""
    seconds, answer = _answer_within(strict_service, send)
    # Before, no answer came at all (65 s and more); the bound tells the 1 s deadline from none, not a speed.
    assert answer.startswith(f"HTTP/1.1 {status}") and seconds < 20, (seconds, answer[:200])
    code = "too_large" if status == 431 else "request_timeout"
    assert f'"code": "{code}"' in answer
    assert requests.get(f"{strict_service}/healthz", timeout=5).status_code == 200


def test_a_half_sent_body_is_answered_and_closed(strict_service: str) -> None:
    head = b"POST /step HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    seconds, answer = _answer_within(strict_service, lambda sock: sock.sendall(head + b'{"session_id": '))
    assert answer.startswith("HTTP/1.1 408") and '"code":"request_timeout"' in answer and seconds < 20, answer[:300]


def test_connections_past_the_cap_are_refused_and_the_service_recovers(strict_service: str) -> None:
    host, port = strict_service.removeprefix("http://").rsplit(":", 1)
    silent = [socket.create_connection((host, int(port)), timeout=5) for _ in range(40)]
    try:
        time.sleep(0.3)
        refused = requests.get(f"{strict_service}/healthz", timeout=5)
        assert refused.status_code == 503  # uvicorn's answer past --max-connections: at once, not a hang
        deadline = time.monotonic() + 20  # the silent ones hit the 1 s head deadline and are closed
        while requests.get(f"{strict_service}/healthz", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the service never came back after the silent connections"
            time.sleep(0.2)
    finally:
        for sock in silent:
            sock.close()


@pytest.mark.parametrize("head", [
    "POST /step HTTP/1.1\r\nHost: localhost\r\nContent-Length: -1\r\n",
    "POST /step HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\nContent-Length: 7\r\n",
    "GET /h\u00e9althz HTTP/1.1\r\nHost: localhost\r\n",
], ids=["negative_length", "two_lengths", "non_ascii_line"])
def test_bytes_that_are_not_http_get_our_json_400(strict_service: str, head: str) -> None:
    """#33 finding 8: these got uvicorn's plain-text 400 "Invalid HTTP request received." with no request id."""
    seconds, answer = _answer_within(strict_service, lambda sock: sock.sendall(head.encode() + b"\r\n"))
    assert answer.startswith("HTTP/1.1 400") and "x-request-id: " in answer, answer[:300]
    body = json.loads(answer.partition("\r\n\r\n")[2])
    assert body["code"] == "bad_request" and "not valid HTTP/1.1" in body["message"] and body["request_id"]


@pytest.mark.parametrize("body, says", [
    (b'{"session_id": "s", "action": "go", "x": NaN}', "holds NaN"),
    (b'{"session_id": "s", "action": Infinity}', "holds Infinity"),
    (b'{"session_id": "a", "session_id": "b", "action": "go"}', "gives the key(s) ['session_id'] more than once"),
], ids=["nan", "infinity", "duplicate_key"])
def test_json_that_python_reads_but_the_client_did_not_mean_is_refused(make_client, body: bytes, says: str) -> None:
    """#33 finding 8: NaN/Infinity were accepted and a duplicate key silently took its last value."""
    response = make_client().post("/step", content=body, headers={"Content-Type": "application/json"})
    assert says in _error(response, 400, "bad_request").message


def test_a_busy_or_unknown_session_is_refused_without_taking_a_pool_thread(make_client, test_envs,
                                                                            monkeypatch) -> None:
    """#33, greedy clients: what the service can refuse without the env (a session busy with another call, an id
    that is not open) is answered on the event loop. It used to be answered in a pool thread, so 32 greedy
    threads answering 409s competed with every honest call for the interpreter."""
    from concurrent.futures import ThreadPoolExecutor

    gated = test_envs["gated"]
    gated.gate.clear()
    gated.entered.clear()
    client = make_client()
    manager = client.app.state.sessions
    session = _create(client, "gated")
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(client.post, "/step", json={"session_id": session, "action": "wait"})
        assert gated.entered.wait(10), "the slow step never reached the env"
        ran = []  # the env calls the refusals would have run in a pool thread
        monkeypatch.setattr(manager, "step", lambda *args: ran.append(("step", args)))
        monkeypatch.setattr(manager, "evaluate", lambda *args: ran.append(("evaluate", args)))
        _error(client.post("/step", json={"session_id": session, "action": "inc"}), 409, "busy")
        _error(client.post("/evaluate", json={"session_id": session}), 409, "busy")
        _error(client.post("/step", json={"session_id": "f" * 32, "action": "inc"}), 404, "unknown_session")
        monkeypatch.undo()
        gated.gate.set()
        assert slow.result(timeout=30).status_code == 200
    assert ran == []
    assert client.post("/step", json={"session_id": session, "action": "inc"}).status_code == 200  # free again
