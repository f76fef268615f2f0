"""The GPU memory and layout estimate (beyond_agent.gpu_plan): the parameter count against a real model, the
figures worked by hand, every GPU example within budget while their former settings were not, and the
throughput note on requests in flight per rollout replica."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from beyond_agent.gpu_plan import GIB, KNOWN_MODELS, ModelShape, model_shape, plan
from launch.config import load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launcher"))
from test_examples_on_cpu import HYDRA_EXAMPLES, compose_example  # noqa: E402

QWEN_7B = KNOWN_MODELS["Qwen/Qwen2.5-7B-Instruct"]


def test_the_parameter_count_is_the_real_model_s(tiny_model_dir: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    shape = model_shape(str(tiny_model_dir))  # read from its config.json
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert QWEN_7B.parameters == 7_615_616_512  # Qwen2.5-7B's published count


def config(**actor_rollout) -> dict:
    actor = {"use_dynamic_bsz": False, "ppo_micro_batch_size_per_gpu": 2, "ppo_max_token_len_per_gpu": 16384,
             "fsdp_config": {"param_offload": False, "optimizer_offload": False}}
    rollout = {"log_prob_use_dynamic_bsz": False, "log_prob_micro_batch_size_per_gpu": 4,
               "log_prob_max_token_len_per_gpu": 16384, "free_cache_engine": False, "gpu_memory_utilization": 0.35,
               "tensor_model_parallel_size": 2}
    for key, value in actor_rollout.items():
        (actor if key in actor else rollout)[key] = value
    return {"actor_rollout_ref": {"actor": actor, "rollout": rollout},
            "data": {"max_prompt_length": 2048, "max_response_length": 16384},
            "trainer": {"nnodes": 1, "n_gpus_per_node": 8}}


def test_the_async_16k_settings_worked_by_hand():
    found = plan(config(), QWEN_7B)
    # micro-batches of 2 and 4 sequences of 2 048 + 16 384 tokens
    assert (found.update_tokens, found.log_prob_tokens) == (36_864, 73_728)
    vocab, hidden, layers = 152_064, 3_584, 28
    assert found.update_gib == pytest.approx((36_864 * vocab * 6 + 36_864 * hidden * layers * 2) / GIB)  # 38.2
    assert found.log_prob_gib == pytest.approx(73_728 * vocab * 6 / GIB)  # 62.6
    assert found.fsdp_state_gib == pytest.approx(7_615_616_512 * 16 / 8 / GIB)  # 14.2
    assert found.vllm_kept_gib == pytest.approx(0.35 * 80)  # kept while the actor trains
    assert found.training_peak_gib == pytest.approx(62.6 + 14.2 + 28, abs=0.1)
    [problem] = found.problems()
    assert "105 GiB of a 80 GiB GPU" in problem and "use_dynamic_bsz=true" in problem


def test_a_lora_run_keeps_only_the_frozen_base_weights():
    # LoRA: 7 615 616 512 fp32 weights over 8 GPUs, no gradient or Adam state for them: 3.5 GiB, not 14.2.
    lora = config()
    lora["actor_rollout_ref"]["model"] = {"lora_rank": 64}
    assert plan(lora, QWEN_7B).fsdp_state_gib == pytest.approx(7_615_616_512 * 4 / 8 / GIB)


def test_dynamic_batches_free_cache_and_layout():
    dynamic = plan(config(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=8192, log_prob_use_dynamic_bsz=True,
                          log_prob_max_token_len_per_gpu=8192), QWEN_7B)
    assert dynamic.update_tokens == dynamic.log_prob_tokens == 18_432  # at least one whole sequence
    assert dynamic.problems() == []
    freed = plan(config(free_cache_engine=True), QWEN_7B)
    assert freed.vllm_kept_gib == 0.0 and freed.training_peak_gib < plan(config(), QWEN_7B).training_peak_gib
    [layout] = plan(config(use_dynamic_bsz=True, log_prob_use_dynamic_bsz=True, tensor_model_parallel_size=3),
                    QWEN_7B).problems()
    assert "tensor_model_parallel_size=3 does not divide the 8 GPUs" in layout
    assert model_shape("no/such-model") is None
    assert ModelShape.from_config_json({"hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 1,
                                        "num_attention_heads": 2, "vocab_size": 10}).num_key_value_heads == 2


def composed_plan(path: Path, tmp_path: Path, *overrides: str):
    composed = compose_example(path, tmp_path)
    for override in overrides:
        key, value = override.split("=")
        OmegaConf.update(composed, key, yaml.safe_load(value), force_add=True)
    resolved = copy.deepcopy(composed)
    OmegaConf.resolve(resolved)
    return plan(OmegaConf.to_container(resolved), model_shape(resolved.actor_rollout_ref.model.path))


GPU_EXAMPLES = [path for path in HYDRA_EXAMPLES if "quickstart" not in str(path) and "recipe.multiturn_rl" in
                path.read_text() and not load_config(path, Path("/nonexistent.env")).train.cpu]
"""The environments' examples written for GPUs (a CPU example, `train.cpu: true`, trains the tiny model, which a
test may not have built yet: it has no plan for this test to check)."""


@pytest.mark.parametrize("path", GPU_EXAMPLES, ids=lambda p: p.stem)
def test_every_gpu_example_fits_an_80_gb_gpu(path: Path, tmp_path: Path, monkeypatch):
    monkeypatch.delenv("MODEL_PATH", raising=False)  # the examples' model: Qwen2.5-7B-Instruct
    found = composed_plan(path, tmp_path)
    assert found.problems() == [], found.summary()


@pytest.mark.parametrize("name", ["alfworld/alfworld_m2po_delta", "webshop/webshop_m2po_full"])
def test_the_async_examples_former_micro_batches_did_not(name: str, tmp_path: Path, monkeypatch):
    monkeypatch.delenv("MODEL_PATH", raising=False)
    path = Path(__file__).resolve().parents[2] / f"examples/{name}.yaml"
    former = composed_plan(path, tmp_path, "actor_rollout_ref.actor.use_dynamic_bsz=false",
                           "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz=false",
                           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                           "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4")
    assert former.problems() and former.training_peak_gib > 100


def test_few_requests_per_replica_get_a_note():
    settings = config(use_dynamic_bsz=True, log_prob_use_dynamic_bsz=True, max_num_seqs=256)
    settings["beyond_agent"] = {"concurrency": 64}
    settings["data"]["train_batch_size"] = 128
    settings["actor_rollout_ref"]["rollout"]["n"] = 8
    found = plan(settings, QWEN_7B)
    # 8 GPUs at TP 2: 4 replicas, 64 / 4 = 16 requests each for 128 x 8 = 1 024 episodes a step.
    assert found.rollout_replicas == 4 and found.problems() == []
    [note] = found.notes()
    assert "concurrency=64 over 4 rollout replicas keeps about 16 requests in flight on each" in note
    assert "1024 episodes" in note and "Consider beyond_agent.concurrency=256" in note  # 4 x 64
    settings["beyond_agent"]["concurrency"] = 128  # 32 per replica: enough
    assert plan(settings, QWEN_7B).notes() == []
    settings["beyond_agent"]["concurrency"], settings["data"]["train_batch_size"] = 64, 8  # 64 episodes: all at once
    assert plan(settings, QWEN_7B).notes() == []


def test_the_alfworld_example_gets_the_note(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("MODEL_PATH", raising=False)
    found = composed_plan(Path(__file__).resolve().parents[2] / "examples/alfworld/alfworld.yaml", tmp_path)
    assert found.concurrency == 64 and found.rollout_replicas == 4 and found.episodes_per_step == 1024
    assert len(found.notes()) == 1
