"""The verl CPU platform, its device-module shim and the vLLM CPU plugin, without training.

Each check that depends on ``VERL_PLATFORM`` runs in a fresh interpreter: verl caches the platform
for the life of a process, and the entry point decides at import time whether to register.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from verl_cpu import platform as cpu
from verl_cpu.platform import CPU_DEVICE_ID, PlatformCPU, build_device_module


def run_python(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter with ``env`` added; return its stdout (fails on error)."""
    full_env = {**os.environ, **env}
    if "VERL_PLATFORM" not in env:
        full_env.pop("VERL_PLATFORM", None)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=full_env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


# One fresh interpreter with VERL_PLATFORM=cpu answers every check below that needs real verl
# (importing verl costs 10-30 s on 2 cores, so it is done once).
VERL_CPU_PROBE = """
import json, os
import torch, torch.distributed as dist
import verl
from verl.plugin.platform import get_platform
from verl.utils.attention_utils import pad_input, unpad_input
from verl.utils.device import get_device_name, get_nccl_backend, get_resource_name
from verl.utils.distributed import initialize_global_process_group_ray

seen = {"platform": [type(get_platform()).__name__, get_device_name(), get_nccl_backend(), get_resource_name()]}
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29561", RANK="0", WORLD_SIZE="1")
initialize_global_process_group_ray()  # builds "cpu:gloo,cpu:gloo" from the platform's answers
seen["process_group_backend"] = dist.get_backend()
dist.destroy_process_group()
ids, mask = torch.tensor([[0, 7, 8], [9, 5, 0]]), torch.tensor([[0, 1, 1], [1, 1, 0]])
flat, indices, cu_seqlens, *_ = unpad_input(ids.unsqueeze(-1), mask)
seen["unpadded"] = flat.flatten().tolist()
seen["cu_seqlens"] = cu_seqlens.tolist()
seen["repadded"] = pad_input(flat, indices, 2, 3).squeeze(-1).tolist()
from verl.workers.engine.base import EngineRegistry
seen["engines"] = [EngineRegistry.get_engine_cls(kind, "fsdp2").__name__ for kind in ("language_model", "value_model")]
os.environ["VERL_ENGINE_DEVICE"] = "cuda"  # as verl_cpu.overrides.CPU_ENV sets it for a CPU run
seen["engines"] += [EngineRegistry.get_engine_cls(kind, "fsdp").__name__ for kind in ("language_model", "value_model")]
print(json.dumps(seen))
"""


@pytest.fixture(scope="module")
def verl_cpu_seen() -> dict:
    """What real verl reports in a process started with VERL_PLATFORM=cpu."""
    return json.loads(run_python(VERL_CPU_PROBE, VERL_PLATFORM="cpu").strip().splitlines()[-1])


def test_verl_get_platform_returns_ours_when_selected(verl_cpu_seen):
    assert verl_cpu_seen["platform"] == ["PlatformCPU", "cpu", "gloo", "GPU"]


def test_verl_process_group_initialises_on_gloo(verl_cpu_seen):
    assert verl_cpu_seen["process_group_backend"].endswith("gloo")


def test_verl_padding_helpers_work_without_flash_attn(verl_cpu_seen):
    assert verl_cpu_seen["unpadded"] == [7, 8, 9, 5]
    assert verl_cpu_seen["cu_seqlens"] == [0, 2, 4]
    assert verl_cpu_seen["repadded"] == [[0, 7, 8], [9, 5, 0]]


def test_the_actor_and_critic_get_the_cpu_engines(verl_cpu_seen):
    assert verl_cpu_seen["engines"] == ["CPULanguageModelEngine", "CPUValueHeadEngine"] * 2


def test_a_mode_change_that_moves_nothing_makes_no_garbage_collector_pass(monkeypatch):
    """verl's FSDP engine would end `to("cpu", model=False, optimizer=False)` with gc.collect() on this platform
    (verl_cpu/actor_engine.py); ours returns after verl's argument check. A call that moves something is verl's."""
    import gc

    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    from verl_cpu.actor_engine import CPULanguageModelEngine
    from verl_cpu.value_engine import CPUValueHeadEngine

    calls = []
    monkeypatch.setattr(gc, "collect", lambda *args: calls.append("gc"))
    monkeypatch.setattr(FSDPEngine, "to", lambda self, device, **moved: calls.append(("verl", device, moved)))
    for engine_cls in (CPULanguageModelEngine, CPUValueHeadEngine):
        engine = engine_cls.__new__(engine_cls)  # `to` reads no state on this path
        engine.to("cpu", model=False, optimizer=False, grad=False)
        assert calls == []
        with pytest.raises(AssertionError, match="Gradient buffers must be moved"):  # verl's own check still runs
            engine.to("cpu", model=False, optimizer=False, grad=True)
        engine.to("cpu", model=True, optimizer=False, grad=True)
        assert calls == [("verl", "cpu", {"model": True, "optimizer": False, "grad": True})]
        calls.clear()


@pytest.mark.startup  # a fresh process importing verl: the full run only
def test_entry_point_registers_nothing_without_verl_platform_cpu():
    out = run_python(
        """
        import verl
        from verl.plugin.platform.platform_manager import PlatformRegistry
        print("cpu" in PlatformRegistry.registered_names())
        """
    )
    assert out.strip() == "False"


@pytest.fixture
def platform(monkeypatch) -> PlatformCPU:
    """A PlatformCPU whose process-wide shims are not installed into this shared test process."""
    monkeypatch.setattr(cpu, "install_backend_dedupe", lambda: None)
    monkeypatch.setattr(cpu, "install_torch_padding_helpers", lambda: None)
    return PlatformCPU()


def test_never_auto_detected(platform):
    assert platform.is_platform_available(use_smi_check=True) is False


def test_device_id_is_a_torch_device_and_formats_as_index():
    assert f"cpu:{CPU_DEVICE_ID}" == "cpu:0"
    assert torch.device(CPU_DEVICE_ID) == torch.device("cpu")
    assert torch.ones(2).to(CPU_DEVICE_ID).device.type == "cpu"
    assert torch.empty(3, device=CPU_DEVICE_ID).device.type == "cpu"
    assert int(CPU_DEVICE_ID) == 0


def test_device_module_answers_cuda_style_calls():
    device = build_device_module()
    device.set_device(0)
    device.synchronize()
    device.empty_cache()
    device.ipc_collect()
    assert device.current_device() == "cpu"
    assert device.device_count() == 1 and device.is_available()
    free, total = device.mem_get_info()
    assert 0 < free <= total
    assert device.memory_allocated() > 0 and device.max_memory_allocated() >= device.memory_allocated()
    with device.stream(device.current_stream()):
        pass  # torch.cpu's stream API, reached through the fallback


def test_device_module_rng_state_round_trips():
    device = build_device_module()
    device.manual_seed(7)
    state = device.get_rng_state()
    first = torch.rand(3)
    device.set_rng_state(state)
    assert torch.equal(first, torch.rand(3))


def test_backend_dedupe_only_touches_repeats():
    assert cpu._dedupe_backend("cpu:gloo,cpu:gloo") == "cpu:gloo"
    assert cpu._dedupe_backend("cpu:gloo,cuda:nccl") == "cpu:gloo,cuda:nccl"
    assert cpu._dedupe_backend("gloo") == "gloo"
    assert cpu._dedupe_backend(None) is None


def test_rollout_env_vars_point_vllm_at_cpu(platform):
    env = platform.rollout_env_vars()
    assert env["VLLM_TARGET_DEVICE"] == "cpu" and float(env["VLLM_CPU_KVCACHE_SPACE"]) > 0


def test_vllm_plugin_keeps_2d_weights_plain():
    vllm_plugin = pytest.importorskip("verl_cpu.vllm_plugin")
    calls = []
    dispatch = vllm_plugin.keep_plain_linear(lambda layer, remove_weight: calls.append(layer))
    linear, experts = torch.nn.Linear(4, 3), torch.nn.Module()
    experts.weight = torch.nn.Parameter(torch.zeros(2, 3, 4))
    dispatch(linear, remove_weight=True)
    dispatch(experts, remove_weight=True)
    assert linear.cpu_linear is torch.nn.functional.linear and linear.weight.shape == (3, 4)
    assert calls == [experts]


def test_vllm_plugin_is_a_no_op_off_cpu(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.platforms import current_platform

    from verl_cpu import vllm_plugin

    monkeypatch.setattr(vllm_plugin, "_installed", False)
    monkeypatch.setattr(type(current_platform), "is_cpu", lambda self: False)
    before = layer_utils.dispatch_cpu_unquantized_gemm
    vllm_plugin.register()
    assert layer_utils.dispatch_cpu_unquantized_gemm is before


def test_vllm_plugin_installs_on_cpu(monkeypatch):
    pytest.importorskip("vllm")
    from vllm.model_executor.layers import utils as layer_utils

    from verl_cpu import vllm_plugin

    monkeypatch.setattr(vllm_plugin, "_installed", False)
    monkeypatch.setattr(vllm_plugin, "plugin_wanted", lambda: True)
    monkeypatch.setattr(layer_utils, "dispatch_cpu_unquantized_gemm", layer_utils.dispatch_cpu_unquantized_gemm)
    original = layer_utils.dispatch_cpu_unquantized_gemm
    vllm_plugin.register()
    assert layer_utils.dispatch_cpu_unquantized_gemm.__wrapped__ is original

