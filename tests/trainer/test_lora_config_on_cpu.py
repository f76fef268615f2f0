"""LoRA runs are prepared before Ray starts: our vLLM worker extension named, the adapter counted, the runs this
path does not serve refused with the key to change.

The tiny model (hidden 64, 2 heads of 32, 1 key/value head, MLP 128, 2 layers) worked by hand: a rank-r adapter
on a linear layer of in x out holds r x (in + out) elements, so with r = 8 a layer's q_proj has 8 x (64 + 64) =
1 024, k_proj and v_proj 8 x (64 + 32) = 768 each, o_proj 1 024, gate_proj and up_proj 8 x (64 + 128) = 1 536
each and down_proj 8 x (128 + 64) = 1 536: 8 192 a layer, 16 384 for the two ("all-linear" leaves lm_head out).
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from beyond_agent.weights.lora import LoraPlan, configure_lora
from beyond_agent.weights.verl_backend import WORKER_EXTENSION_CLASS


def lora_config(model_path, rank=8, **model):
    config = OmegaConf.create({"actor_rollout_ref": {
        "model": {"path": str(model_path), "lora_rank": rank, "lora_alpha": 16, "target_modules": "all-linear",
                  "exclude_modules": None, "lora": {"merge": False}, **model},
        "rollout": {"name": "vllm", "engine_kwargs": {"vllm": {"worker_extension_cls": None}, "sglang": {}}},
        "actor": {"fsdp_config": {"model_dtype": "fp32"}}}})
    OmegaConf.set_struct(config, True)
    return config


def test_full_fine_tuning_is_left_alone(tiny_model_dir):
    config = lora_config(tiny_model_dir, rank=0)
    before = OmegaConf.to_container(config)
    assert configure_lora(config, "delta") is None
    assert OmegaConf.to_container(config) == before


def test_a_lora_run_gets_our_extension_and_its_adapter_counted(tiny_model_dir):
    config = lora_config(tiny_model_dir)
    plan = configure_lora(config, "full")
    assert plan == LoraPlan(rank=8, alpha=16, adapter_parameters=16_384, element_bytes=4)
    assert plan.adapter_bytes == 65_536
    assert config.actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls == WORKER_EXTENSION_CLASS
    # Only the attention's q and v projections, in bf16: 2 layers x (1 024 + 768) elements x 2 bytes.
    config = lora_config(tiny_model_dir, target_modules=["q_proj", "v_proj"])
    config.actor_rollout_ref.actor.fsdp_config.model_dtype = "bf16"
    plan = configure_lora(config, "full")
    assert (plan.adapter_parameters, plan.adapter_bytes) == (3_584, 7_168)
    # A hub name: nothing is downloaded to count the adapter; the run still gets our extension.
    config = lora_config("Qwen/Qwen2.5-7B-Instruct")
    assert configure_lora(config, "full") == LoraPlan(rank=8, alpha=16, adapter_parameters=None, element_bytes=4)
    assert config.actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls == WORKER_EXTENSION_CLASS


@pytest.mark.parametrize(("mode", "change", "message"), [
    ("delta", {}, "beyond_agent.weight_sync.mode=delta"),
    ("full", {"rollout": {"name": "sglang"}}, "actor_rollout_ref.rollout.name=sglang"),
    ("full", {"model": {"lora": {"merge": True}}}, "actor_rollout_ref.model.lora.merge=true"),
    ("full", {"rollout": {"engine_kwargs": {"vllm": {"worker_extension_cls": "my.Ext"}}}}, "worker_extension_cls=my.Ext"),
    ("full", {"model": {"target_modules": ["no_such_proj"]}}, "actor_rollout_ref.model.target_modules=['no_such_proj']"),
    ("full", {"actor": {"fsdp_config": {"model_dtype": "int8"}}}, "actor_rollout_ref.actor.fsdp_config.model_dtype=int8"),
])
def test_runs_the_lora_path_does_not_serve_are_refused_naming_the_key(tiny_model_dir, mode, change, message):
    config = OmegaConf.merge(lora_config(tiny_model_dir), {"actor_rollout_ref": change})
    with pytest.raises(ValueError) as caught:
        configure_lora(config, mode)
    assert message in str(caught.value)
