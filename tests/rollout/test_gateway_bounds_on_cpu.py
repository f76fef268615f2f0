"""The gateway bounded (issue #51): each finding of the attack on the gateway, replayed against the real server
over loopback with the real `openai` client or raw HTTP, now refused in OpenAI's error format."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import openai
import psutil
import pytest
import requests
from transformers import AutoTokenizer

from beyond_agent.gateway import Gateway, GatewayConfig
from beyond_agent.gateway.agents import EnvSession
from beyond_agent.gateway.server import GatewayServer
from beyond_agent.rollout.llm import GenerationResult


class Echo:
    """The policy: answers "ok" and end-of-turn; counts its calls (a refused request never reaches it)."""

    def __init__(self, tokenizer) -> None:
        self.ids = tokenizer.encode("ok", add_special_tokens=False) + [tokenizer.eos_token_id]
        self.calls = 0

    def __call__(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> GenerationResult:
        self.calls += 1
        return GenerationResult(list(self.ids), [-0.1] * len(self.ids), "stop", 0.0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture
def gateway(tokenizer):
    policy = Echo(tokenizer)
    server = GatewayServer(Gateway(GatewayConfig(max_calls=3), tokenizer, policy)).start()
    yield SimpleNamespace(server=server, gateway=server.gateway, url=server.url, policy=policy)
    server.stop()


def chat(url: str, episode_id: str, body: dict, key: str | None = None, **kwargs) -> requests.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return requests.post(f"{url}/episodes/{episode_id}/v1/chat/completions", json=body, headers=headers,
                         timeout=30, **kwargs)


def hello(text: str = "hi") -> dict:
    return {"model": "policy", "messages": [{"role": "user", "content": text}]}


def is_openai_error(response: requests.Response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_a_50_mb_request_is_refused_in_under_a_second_without_growing_the_trainer(gateway):
    gateway.gateway.open_episode("e")
    body = b'{"model": "policy", "messages": [{"role": "user", "content": "' + b"x" * (50 << 20) + b'"}]}'
    trainer = psutil.Process()  # the gateway's process (the trainer's); the body above is the client's
    before = trainer.memory_info().rss
    started = time.monotonic()
    refused = requests.post(f"{gateway.url}/episodes/e/v1/chat/completions", data=body,
                            headers={"Content-Type": "application/json"}, timeout=30)
    elapsed = time.monotonic() - started
    growth = trainer.memory_info().rss - before
    assert "over the gateway's limit of 1048576 bytes" in is_openai_error(refused, 413)["message"]
    assert elapsed < 1.0 and growth < 50 << 20, (elapsed, growth / 2**20)
    # Without a Content-Length (chunked), it is refused as it arrives, not read whole.
    chunks = (b"x" * (1 << 20) for _ in range(50))
    streamed = requests.post(f"{gateway.url}/episodes/e/v1/chat/completions", data=chunks, timeout=30)
    assert streamed.status_code == 413 and "error" in streamed.json()
    assert gateway.policy.calls == 0


def test_a_message_past_the_cap_is_refused_before_it_is_tokenized(gateway):
    gateway.gateway.open_episode("e")
    refused = chat(gateway.url, "e", hello("y" * 100_001))
    error = is_openai_error(refused, 400)
    assert error["param"] == "messages.0" and "100001 characters" in error["message"]
    assert gateway.policy.calls == 0 and gateway.gateway.calls_answered("e") == 0


def test_an_episode_answers_only_requests_with_its_own_key(gateway):
    gateway.gateway.open_episode("mine", key="key-of-mine")
    gateway.gateway.open_episode("other", key="key-of-other")
    assert is_openai_error(chat(gateway.url, "mine", hello()), 401)["type"] == "authentication_error"
    assert chat(gateway.url, "mine", hello(), key="key-of-other").status_code == 401
    client = openai.OpenAI(base_url=f"{gateway.url}/episodes/mine/v1", api_key="key-of-mine", max_retries=0)
    assert client.chat.completions.create(model="policy", messages=hello()["messages"]).choices[0].message.content == "ok"
    assert requests.get(f"{gateway.url}/episodes/mine/env", timeout=10).status_code == 401


def test_calls_past_the_episodes_cap_are_refused_and_end_it_as_max_calls(gateway):
    gateway.gateway.open_episode("e")
    assert [chat(gateway.url, "e", hello()).status_code for _ in range(3)] == [200, 200, 200]
    error = is_openai_error(chat(gateway.url, "e", hello()), 429)
    assert "(gateway.max_calls)" in error["message"] and gateway.gateway.limit_reached("e") == "max_calls"
    assert gateway.policy.calls == 3 and len(gateway.gateway.close_episode("e").calls) == 3


def test_a_call_past_the_response_budget_is_refused_and_ends_the_episode_as_length(tokenizer):
    # Echo's reply is a few tokens; a budget of 8 response tokens is spent after the first reply, so the next call
    # (its history appended) has no room: refused with 400, and the episode ends as `length` (scored), not as the
    # agent's error when the agent raises on the refusal (issue #52: the code env's long observations did this).
    policy = Echo(tokenizer)
    server = GatewayServer(Gateway(GatewayConfig(max_response_length=8, max_tokens_per_turn=8), tokenizer,
                                   policy)).start()
    try:
        server.gateway.open_episode("e")
        first = chat(server.url, "e", hello())
        assert first.status_code == 200 and server.gateway.limit_reached("e") is None
        reply = first.json()["choices"][0]["message"]
        more = {"model": "policy", "messages": [*hello()["messages"], {"role": "assistant", "content": reply["content"]},
                                                {"role": "user", "content": "a long observation " * 20}]}
        error = is_openai_error(chat(server.url, "e", more), 400)
        assert "has no room left for a reply (max_response_length 8 tokens)" in error["message"]
        assert server.gateway.limit_reached("e") == "length" and policy.calls == 1
    finally:
        server.stop()


def test_concurrent_steps_cannot_pass_the_step_limit_and_are_the_agents_error(gateway):
    class SlowEnv:
        steps = 0

        def step(self, session_id, action):
            SlowEnv.steps += 1
            time.sleep(0.2)
            return SimpleNamespace(observation="o", reward=0.0, terminated=False, truncated=False, info={})

    gateway.gateway.open_episode("e")
    session = EnvSession(SlowEnv(), "s", "start", None, max_steps=4, calls_so_far=lambda: 0)
    gateway.gateway.attach_env("e", session)

    def step(_):
        return requests.post(f"{gateway.url}/episodes/e/env/step", json={"action": "a"}, timeout=30).status_code

    statuses = [step(0) for _ in range(3)]  # one at a time, then two bursts past the limit
    for burst in (8, 8):
        with ThreadPoolExecutor(burst) as pool:
            statuses += list(pool.map(step, range(burst)))
    assert SlowEnv.steps == 4 and statuses.count(200) == 4
    assert set(statuses) == {200, 409} and session.failure is None  # never an env failure


@pytest.mark.parametrize("body, param", [
    ({"model": "policy", "messages": [{"role": "assistant", "content": "x", "tool_calls": "call"}]}, "messages"),
    ({"model": "policy", "messages": [{"role": "assistant", "content": "x", "tool_calls": 7}]}, "messages"),
    ({"model": "policy", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
])
def test_malformed_messages_get_a_400_naming_them(gateway, body, param):
    gateway.gateway.open_episode("e")
    assert is_openai_error(chat(gateway.url, "e", body), 400)["param"] == param


def test_every_other_refusal_is_in_openais_format_too(gateway, tokenizer):
    gateway.gateway.open_episode("e")
    gateway.gateway.attach_env("e", EnvSession(SimpleNamespace(), "s", "start", None, max_steps=1,
                                               calls_so_far=lambda: 0))
    assert is_openai_error(requests.get(f"{gateway.url}/nowhere", timeout=10), 404)["message"] == "Not Found"
    assert requests.get(f"{gateway.url}/docs", timeout=10).status_code == 404
    assert requests.get(f"{gateway.url}/openapi.json", timeout=10).status_code == 404
    too_long = requests.post(f"{gateway.url}/episodes/e/env/step", json={"action": "a" * 100_001}, timeout=10)
    assert is_openai_error(too_long, 400)["param"] == "action"
    foreign = requests.get(f"{gateway.url}/v1/models", headers={"Host": "evil.example"}, timeout=10)
    assert is_openai_error(foreign, 400)["param"] == "host"
    deep = b'{"model": "policy", "messages": [{"role": "user", "content": "x", "extra": ' + b"[" * 100_000 + \
        b"]" * 100_000 + b"}]}"
    answer = requests.post(f"{gateway.url}/episodes/e/v1/chat/completions", data=deep, timeout=30,
                           headers={"Content-Type": "application/json"})
    assert answer.status_code in (400, 500) and "error" in answer.json()


def test_an_oversized_request_head_is_cut_off(gateway):
    # envservice's connection guards serve the gateway too: a head must arrive whole within its deadline and
    # stay under its size cap.
    with socket.create_connection(("127.0.0.1", gateway.server.port), timeout=30) as connection:
        connection.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (128 << 10) +
                           b"\r\nX-More: b\r\n\r\n")
        answer = connection.recv(200)
    assert answer.startswith(b"HTTP/1.1 431")


def test_the_gateway_also_answers_on_its_unix_socket(gateway):
    with socket.socket(socket.AF_UNIX) as connection:
        connection.settimeout(10)
        connection.connect(gateway.server.socket_path)
        connection.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1:8080\r\nConnection: close\r\n\r\n")
        answer = connection.recv(4096)
    assert answer.startswith(b"HTTP/1.1 200") and b'"policy"' in answer


def test_log_probs_are_answered_and_what_would_change_the_sample_is_refused(gateway, tokenizer):
    gateway.gateway.open_episode("e")
    answer = chat(gateway.url, "e", {**hello(), "logprobs": True}).json()["choices"][0]["logprobs"]["content"]
    ok_ids = tokenizer.encode("ok", add_special_tokens=False)
    assert [entry["token"] for entry in answer] == [tokenizer.decode([i]) for i in ok_ids]
    assert [entry["logprob"] for entry in answer] == [-0.1] * len(ok_ids)  # the sampled ids' own, end-of-turn aside
    for field, value in (("stop", ["\n"]), ("response_format", {"type": "json_object"}), ("top_logprobs", 2)):
        refused = chat(gateway.url, "e", {**hello(), field: value, "logprobs": True})
        assert is_openai_error(refused, 400)["param"] == field
    assert chat(gateway.url, "e", {**hello(), "response_format": {"type": "text"}, "stop": None}).status_code == 200


# ---- Round two (issue #70): episodes side by side, errors in OpenAI's format and counted ---------------------------

class Slow(Echo):
    """The policy: answers after `seconds`, counting how many calls are being answered at once (the most seen)."""

    def __init__(self, tokenizer, seconds: float) -> None:
        super().__init__(tokenizer)
        self.seconds, self.now, self.most = seconds, 0, 0
        self._lock = __import__("threading").Lock()

    def __call__(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> GenerationResult:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        time.sleep(self.seconds)
        with self._lock:
            self.now -= 1
        return super().__call__(request_id, prompt_ids, max_tokens)


def test_episodes_calls_are_answered_side_by_side_not_four_at_a_time(tokenizer):
    """Every sandboxed agent reaches the gateway through one Unix socket, one client host: its 4 loop slots per host,
    held through each LLM call, answered 4 calls at once for a whole run (8 episodes with a 1 s generation took 2 s).
    Now 8 episodes' calls are answered at once (within `max_concurrent_calls`), one at a time per episode."""
    policy = Slow(tokenizer, 1.0)
    server = GatewayServer(Gateway(GatewayConfig(max_concurrent_calls=8), tokenizer, policy)).start()
    try:
        episodes = [server.gateway.open_episode(key=f"key-{index}") for index in range(8)]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda index: chat(server.url, episodes[index], hello(), key=f"key-{index}"),
                                    range(8)))
        assert [answer.status_code for answer in answers] == [200] * 8
        assert policy.most == 8
        bounded = Slow(tokenizer, 0.5)
        server.gateway._generate = bounded
        more = [server.gateway.open_episode(key=f"more-{index}") for index in range(12)]
        with ThreadPoolExecutor(12) as pool:
            list(pool.map(lambda index: chat(server.url, more[index], hello(), key=f"more-{index}"), range(12)))
        assert bounded.most == 8  # the run's concurrency bounds them all together
    finally:
        server.stop()


def test_half_sent_requests_of_one_agent_do_not_hold_up_another_episode(gateway):
    """One agent holding 4 half-sent request heads delayed another episode's call by 9.8 s (the host's 4 loop
    slots); now the other call is answered at once."""
    gateway.gateway.open_episode("patient", key="patient-key")
    host, port = gateway.url.removeprefix("http://").split(":")
    stalled = []
    for _ in range(4):
        connection = socket.create_connection((host, int(port)))
        connection.sendall(b"POST /episodes/x/v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        stalled.append(connection)
    try:
        started = time.monotonic()
        assert chat(gateway.url, "patient", hello(), key="patient-key").status_code == 200
        assert time.monotonic() - started < 3.0
    finally:
        for connection in stalled:
            connection.close()


def test_a_deeply_nested_tool_call_is_an_openai_error_or_a_string_and_counts_toward_max_calls(gateway):
    """A tool call's arguments nested 100 000 deep were a RecursionError: a plain-text 500 with a traceback, not
    counted toward max_calls. Now they stay the string they came as (or the request is refused in OpenAI's
    format), and every call, refused or answered, counts (max_calls is 3 here)."""
    gateway.gateway.open_episode("deep", key="deep-key")
    deep = "[" * 100_000 + "]" * 100_000
    body = {"model": "policy", "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep[:90_000]}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"}]}
    statuses = []
    for _ in range(3):
        answer = chat(gateway.url, "deep", body, key="deep-key")
        assert answer.headers["content-type"].startswith("application/json"), answer.text[:200]
        statuses.append(answer.status_code)
    assert all(status in (200, 400) for status in statuses), statuses
    refused = chat(gateway.url, "deep", hello(), key="deep-key")
    assert "made its 3 calls" in is_openai_error(refused, 429)["message"]


def test_a_wrong_key_and_an_unknown_episode_get_the_same_401(gateway):
    """A wrong key on an open episode got 401 but an unknown id 404: an agent could tell which ids are open."""
    gateway.gateway.open_episode("open", key="right-key")
    wrong = is_openai_error(chat(gateway.url, "open", hello(), key="wrong-key"), 401)
    unknown = is_openai_error(chat(gateway.url, "no-such-episode", hello(), key="wrong-key"), 401)
    assert wrong == unknown


@pytest.mark.parametrize("field, value, message", [
    ("merge", "sometimes", "merge='sometimes' is not valid; choose one of auto, never"),
    ("max_calls", 0, "max_calls must be an integer >= 1, got 0"),
    ("max_calls", True, "max_calls must be an integer >= 1, got True"),
])
def test_the_episode_limits_are_checked_once_and_named_by_the_key_a_user_set(field, value, message):
    """`merge` and `max_calls` are the gateway's; the run's `beyond_agent.agent` section takes its defaults from it
    and the same check (issue #73: they were declared and checked twice)."""
    from beyond_agent.gateway.agents import AgentConfig

    assert (AgentConfig().merge, AgentConfig().max_calls) == (GatewayConfig().merge, GatewayConfig().max_calls)
    for build, key in ((AgentConfig, "beyond_agent.agent"), (GatewayConfig, "gateway")):
        with pytest.raises(ValueError) as error:
            build(**{field: value})
        assert str(error.value) == f"{key}.{message}"
