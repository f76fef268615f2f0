"""Delta weight sync on verl's wire, in-process: the stream format, the receiving end the vLLM worker extension
runs (`DeltaSyncEndpoint`), the trainer-side checkpoint engine, and the config seams.

The receiving end is the real class the extension uses; only the transport between the engine and it is
replaced by a function (the real transport, verl's bucketed IPC, is exercised in a subprocess below and by
tests/trainer/test_train_multitask_on_cpu.py end to end).
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf, open_dict

from beyond_agent.settings import BeyondAgentConfig
from beyond_agent.weights import PayloadKind, SyncMode, WeightDeltaSender, WeightSyncConfig
from beyond_agent.weights.verl_backend import (
    BACKEND,
    MANAGER_CLASS,
    WORKER_EXTENSION_CLASS,
    DeltaCheckpointEngine,
    configure_weight_sync,
)
from beyond_agent.weights.wire import (
    HEADER_NAME,
    PREFIX,
    REFUSED_MARKER,
    WIRE_VERSION,
    DeltaSyncEndpoint,
    SyncRefusedError,
    pack_sync,
)

INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(INT_OF_SIZE[tensor.element_size()])


class Weights:
    """A small model's worth of tensors in mixed dtypes; `step()` changes a few elements of some of them."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.tensors = {
            "model.embed_tokens.weight": torch.randn(37, 16, generator=self.generator).to(torch.bfloat16),
            "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16, generator=self.generator),
            "model.layers.0.input_layernorm.weight": torch.ones(16),
            "model.norm.weight": torch.ones(15, dtype=torch.bfloat16),  # odd byte counts mis-align the next array
            "lm_head.weight": torch.randn(37, 16, generator=self.generator).to(torch.bfloat16),
        }

    def step(self) -> None:
        for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"):
            flat = self.tensors[name].reshape(-1)
            picks = torch.randint(0, flat.numel(), (3,), generator=self.generator)
            flat[picks] = flat[picks] + 0.5

    def items(self) -> list[tuple[str, torch.Tensor]]:
        return [(name, tensor.clone()) for name, tensor in self.tensors.items()]


class Loader:
    """Records what the endpoint loads (the extension loads the same list into vLLM's model)."""

    def __init__(self) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []

    def __call__(self, weights: list[tuple[str, torch.Tensor]]) -> dict:
        self.calls.append({name: tensor.clone() for name, tensor in weights})
        return {}


def assert_loaded_equal(loaded: dict[str, torch.Tensor], expected: list[tuple[str, torch.Tensor]]) -> None:
    assert list(loaded) == [name for name, _ in expected]
    for name, tensor in expected:
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(bits(loaded[name]), bits(tensor)), name


def copy_stream(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """What the receiver holds after the transport: its own copies."""
    return [(name, tensor.clone()) for name, tensor in named]


def test_stream_round_trip_and_deltas_are_smaller() -> None:
    weights, sender = Weights(), WeightDeltaSender(WeightSyncConfig("delta", full_every=3))
    endpoint, loader = DeltaSyncEndpoint(), Loader()
    sizes = []
    for step in range(5):
        sync = sender.encode(weights.items())
        named, header_bytes = pack_sync(sync)
        assert named[0][0] == HEADER_NAME and all(name.startswith(PREFIX) for name, _ in named)
        assert all(tensor.dtype == torch.uint8 and tensor.dim() == 1 for _, tensor in named)
        stream = endpoint.stream()
        stream.take(copy_stream(named))
        assert stream.header == sync.header and stream.error is None
        report = endpoint.finish(stream, load=loader)
        assert report["seq"] == step and report["mode"] == sync.header.mode.value
        assert_loaded_equal(loader.calls[-1], weights.items())
        sizes.append((sync.header.mode, sum(t.nbytes for _, t in named), header_bytes))
        weights.step()
    assert [mode for mode, _, _ in sizes] == [SyncMode.FULL, SyncMode.DELTA, SyncMode.DELTA, SyncMode.FULL,
                                              SyncMode.DELTA]
    full_wire = sizes[0][1]
    assert all(wire < full_wire for mode, wire, _ in sizes if mode is SyncMode.DELTA)
    assert endpoint.applied == 5 and endpoint.failures == 0


def test_arrays_larger_than_a_part_travel_in_parts_and_are_joined() -> None:
    weights, sender = Weights(), WeightDeltaSender(WeightSyncConfig("delta", full_every=10))
    weights.tensors["model.layers.0.mlp.up_proj.weight"] = torch.randn(48, 64, generator=weights.generator)
    endpoint, loader, part = DeltaSyncEndpoint(), Loader(), 2048
    for step in range(2):  # a full sync, then a delta
        named, header_bytes = pack_sync(sender.encode(weights.items()), max_part_bytes=part)
        assert header_bytes <= part and all(tensor.nbytes <= part for _, tensor in named)
        # 48 x 64 fp32 = 12 288 bytes: 6 parts in the full sync.
        assert step or sum("/5/values/" in name for name, _ in named) == 6
        endpoint.accept(copy_stream(named), load=loader)
        assert_loaded_equal(loader.calls[-1], weights.items())
        weights.tensors["model.layers.0.mlp.up_proj.weight"].reshape(-1)[::5] += 1.0  # 2 457 bytes of values
        weights.step()
    named, _ = pack_sync(sender.encode(weights.items()), max_part_bytes=part)
    assert sum("/5/values/" in name for name, _ in named) == 2 and sum("/5/positions/" in name for name, _ in named) == 2
    with pytest.raises(SyncRefusedError, match="missing part"):
        endpoint.accept(copy_stream([(n, t) for n, t in named if n != f"{PREFIX}5/values/1"]), load=loader)
    with pytest.raises(ValueError, match="update_weights_bucket_megabytes"):
        pack_sync(sender.encode(weights.items()), max_part_bytes=512)  # the header itself would not fit


def test_a_full_sync_is_written_into_the_mirror_as_it_arrives_without_a_second_copy() -> None:
    weights, sender = Weights(), WeightDeltaSender(WeightSyncConfig("delta", full_every=2))
    endpoint, loader = DeltaSyncEndpoint(), Loader()
    endpoint.accept(copy_stream(pack_sync(sender.encode(weights.items()), max_part_bytes=2048)[0]), load=loader)
    mirror = {name: tensor.data_ptr() for name, tensor in endpoint.receiver._mirror.items()}
    for _ in range(2):  # a delta, then a full sync (full_every=2)
        weights.step()
        named, _ = pack_sync(sender.encode(weights.items()), max_part_bytes=2048)
        stream = endpoint.stream()
        for part in range(0, len(named), 3):  # buckets of three wire tensors, each buffer reused after reading
            bucket = copy_stream(named[part:part + 3])
            stream.take(bucket)
            for _, tensor in bucket:
                tensor.fill_(0xAB)  # the transport overwrites its buffer with the next bucket
        loaded = []
        endpoint.finish(stream, load=lambda ws: loaded.extend(ws))
        assert_loaded_equal(dict(loaded), weights.items())
        # the same mirror tensors were written in place and handed to the loader: no second copy of the model
        assert {name: tensor.data_ptr() for name, tensor in loaded} == mirror


def test_a_stream_cut_off_half_written_makes_the_next_delta_wait_for_a_full_sync() -> None:
    weights, sender = Weights(), WeightDeltaSender(WeightSyncConfig("delta", full_every=100))
    endpoint, loader = DeltaSyncEndpoint(), Loader()
    endpoint.accept(copy_stream(pack_sync(sender.encode(weights.items()))[0]), load=loader)
    sender.request_full("test")
    endpoint.stream().take(copy_stream(pack_sync(sender.encode(weights.items()))[0][:2]))  # cut off: no finish
    weights.step()
    with pytest.raises(SyncRefusedError, match="cut off while being written"):
        endpoint.accept(copy_stream(pack_sync(sender.encode(weights.items()))[0]), load=loader)
    sender.request_full("the receiver refused")
    endpoint.accept(copy_stream(pack_sync(sender.encode(weights.items()))[0]), load=loader)  # heals it
    assert_loaded_equal(loader.calls[-1], weights.items())


def _corrupt_first_delta_value(named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    index = next(i for i, (name, _) in enumerate(named) if "/values/" in name)
    name, tensor = named[index]
    corrupted = tensor.clone()
    corrupted[0] ^= 1
    return [*named[:index], (name, corrupted), *named[index + 1:]]


CORRUPTIONS = {
    "flipped_value_bit": _corrupt_first_delta_value,
    "missing_positions": lambda named: [(n, t) for n, t in named if "/positions/" not in n],
    "truncated_values": lambda named: [(n, t[:-1] if "/values/" in n else t) for n, t in named],
    "garbled_header": lambda named: [(HEADER_NAME, named[0][1][:-3])] + named[1:],
    "no_header": lambda named: named[1:],
    "foreign_tensor": lambda named: named + [("model.norm.weight", torch.ones(4))],
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupted_delta_loads_nothing_and_waits_for_a_full_sync(corruption: str) -> None:
    weights, sender = Weights(), WeightDeltaSender(WeightSyncConfig("delta", full_every=100))
    endpoint, loader = DeltaSyncEndpoint(label="test"), Loader()
    for _ in range(2):
        named, _ = pack_sync(sender.encode(weights.items()))
        endpoint.accept(copy_stream(named), load=loader)
        weights.step()
    served = loader.calls[-1]
    sync = sender.encode(weights.items())
    assert sync.header.mode is SyncMode.DELTA and any(p.kind is PayloadKind.DELTA for p in sync.payloads)
    named, _ = pack_sync(sync)

    with pytest.raises(SyncRefusedError) as refused:
        endpoint.accept(CORRUPTIONS[corruption](copy_stream(named)), load=loader)
    assert REFUSED_MARKER in str(refused.value)
    assert len(loader.calls) == 2 and loader.calls[-1] is served  # nothing loaded
    assert endpoint.failures == 1

    # The next delta is refused too, even a sound one: only a full sync restores a state both sides know.
    weights.step()
    with pytest.raises(SyncRefusedError, match="FullSyncRequiredError"):
        endpoint.accept(copy_stream(pack_sync(sender.encode(weights.items()))[0]), load=loader)
    assert len(loader.calls) == 2 and endpoint.failures == 2

    sender.request_full(str(refused.value))
    heal = sender.encode(weights.items())
    assert heal.header.mode is SyncMode.FULL and heal.header.reason.startswith("requested:")
    endpoint.accept(copy_stream(pack_sync(heal)[0]), load=loader)
    assert_loaded_equal(loader.calls[-1], weights.items())
    weights.step()
    delta = sender.encode(weights.items())
    assert delta.header.mode is SyncMode.DELTA
    endpoint.accept(copy_stream(pack_sync(delta)[0]), load=loader)
    assert_loaded_equal(loader.calls[-1], weights.items())


class InProcessAdapter:
    """Stands in for verl's ServerAdapter + vLLM: hands the stream to the endpoint and, like vLLM's RPC and Ray,
    turns a refusal into an error whose message carries the receiver's."""

    def __init__(self, corrupt_seq: int | None = None) -> None:
        self.endpoint, self.loader, self.corrupt_seq, self.calls = DeltaSyncEndpoint(), Loader(), corrupt_seq, []

    async def update_weights(self, weights, global_steps=None, **kwargs):
        self.calls.append(kwargs)
        named = copy_stream(list(weights))
        seq = json.loads(named[0][1].numpy().tobytes())["seq"]  # the header, first on the wire
        if seq == self.corrupt_seq:
            named = _corrupt_first_delta_value(named)
        try:
            self.endpoint.accept(named, load=self.loader)
        except SyncRefusedError as err:
            raise RuntimeError(f"Call to collective_rpc method failed: Worker failed with error '{err}'") from None


def test_engine_turns_a_refusal_into_a_full_sync_request() -> None:
    engine = DeltaCheckpointEngine(bucket_size=1 << 20, is_master=True, full_every=100)
    engine.adapter = adapter = InProcessAdapter(corrupt_seq=2)
    weights, results = Weights(), []
    for step in range(5):
        results.append(asyncio.run(engine.send_weights(iter(weights.items()), global_steps=step)))
        if step != 2:  # the refused sync: the rollout still serves the previous weights
            assert_loaded_equal(adapter.loader.calls[-1], weights.items())
        weights.step()
    assert adapter.calls[0] == {"peft_config": None, "base_sync_done": True,
                               "beyond_weight_sync": WIRE_VERSION}
    failed = [m["beyond_agent/weight_sync/verify_failed"] for m in results]
    full = [m["beyond_agent/weight_sync/full"] for m in results]
    assert failed == [0.0, 0.0, 1.0, 0.0, 0.0]
    assert full == [1.0, 0.0, 0.0, 1.0, 0.0]  # the sync after the refusal is full (requested)
    assert len(adapter.loader.calls) == 4 and adapter.endpoint.failures == 1
    assert all(m["beyond_agent/weight_sync/bytes_sent"] < m["beyond_agent/weight_sync/bytes_full"] for m, f in zip(results, full) if not f)
    assert all(m["beyond_agent/weight_sync/wire_bytes"] == m["beyond_agent/weight_sync/bytes_sent"] + m["beyond_agent/weight_sync/header_bytes"]
               for m in results)


@pytest.mark.startup  # verl's own worker processes: the full run only (tests/conftest.py)
def test_verl_bucket_transport_carries_the_stream(tmp_path: Path) -> None:
    """verl's own BucketedWeightSender/Receiver (shared memory, as on CPU), with buckets smaller than the sync and
    a parameter larger than a bucket, in a full sync and in deltas (before parts, verl refused it)."""
    script = textwrap.dedent("""
        import asyncio, threading, torch
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver, BucketedWeightSender
        from beyond_agent.weights import WeightDeltaSender, WeightSyncConfig
        from beyond_agent.weights.wire import DeltaSyncEndpoint, pack_sync
        torch.manual_seed(0)
        weights = {f"w{i}": torch.randn(20000 + i).to(torch.bfloat16 if i % 2 else torch.float32) for i in range(40)}
        weights["embed"] = torch.randn(1_000_000)  # 4 MB: four times the 1 MiB bucket, like a 7B's 2.18 GB embedding
        sender, endpoint, loaded = WeightDeltaSender(WeightSyncConfig("delta", full_every=10)), DeltaSyncEndpoint(), []
        handle = "ipc://@DIR@/bucket.sock"
        for step in range(3):
            named, _ = pack_sync(sender.encode([(k, v.clone()) for k, v in weights.items()]), max_part_bytes=1 << 20)
            received = []
            receiver = BucketedWeightReceiver(zmq_handle=handle, device=torch.device("cpu"), use_shm=True)
            thread = threading.Thread(target=receiver.receive_weights,
                                      args=(lambda ws, last: received.extend((n, t.clone()) for n, t in ws),))
            thread.start()
            asyncio.run(BucketedWeightSender(zmq_handle=handle, bucket_size_mb=1, use_shm=True).async_send_weights(iter(named)))
            thread.join()
            endpoint.accept(received, load=lambda ws: loaded.append(dict(ws)))
            assert all(torch.equal(loaded[-1][k], v) for k, v in weights.items()), step
            for k in list(weights)[::3]:
                weights[k][::97] += 1
            weights["embed"][::3] += 1  # a delta of 1.3 MB of values and 1.3 MB of positions: larger than a bucket
        print("OK", endpoint.applied)
    """).replace("@DIR@", str(tmp_path))
    env = {**os.environ, "VERL_PLATFORM": "cpu"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and "OK 3" in done.stdout, (done.stdout + done.stderr)[-4000:]


def _config(**rollout):
    base = {"name": "vllm", "mode": "async", "free_cache_engine": False, "quantization": None, "dtype": "bfloat16",
            "checkpoint_engine": {"backend": "naive", "engine_kwargs": {}, "custom_backend_module": None},
            "engine_kwargs": {"vllm": {}, "sglang": {}}}
    base.update(rollout)
    config = OmegaConf.create({"actor_rollout_ref": {"rollout": base, "model": {"lora": {"rank": 0}}}})
    OmegaConf.set_struct(config, True)
    return config


def test_full_mode_leaves_the_config_alone_and_delta_mode_sets_the_seams() -> None:
    config = _config()
    before = OmegaConf.to_container(config)
    configure_weight_sync(config, WeightSyncConfig("full"))
    assert OmegaConf.to_container(config) == before

    configure_weight_sync(config, WeightSyncConfig("delta", full_every=4))
    rollout = config.actor_rollout_ref.rollout
    assert rollout.checkpoint_engine.backend == BACKEND
    assert rollout.checkpoint_engine.custom_backend_module == "beyond_agent.weights.verl_backend"
    assert rollout.checkpoint_engine.engine_kwargs[BACKEND] == {"full_every": 4, "float_dtype": "bfloat16"}
    assert rollout.checkpoint_manager_class == MANAGER_CLASS
    assert rollout.engine_kwargs.vllm.worker_extension_cls == WORKER_EXTENSION_CLASS


@pytest.mark.parametrize(("rollout", "message"), [
    ({"name": "sglang"}, "actor_rollout_ref.rollout.name=sglang"),
    ({"free_cache_engine": True}, "actor_rollout_ref.rollout.free_cache_engine=true"),
    ({"checkpoint_engine": {"backend": "nccl", "engine_kwargs": {}, "custom_backend_module": None}},
     "checkpoint_engine.backend=nccl"),
    ({"engine_kwargs": {"vllm": {"worker_extension_cls": "my.Ext"}}}, "worker_extension_cls=my.Ext"),
])
def test_delta_mode_refuses_runs_it_does_not_serve(rollout: dict, message: str) -> None:
    with pytest.raises(ValueError, match="weight_sync.mode=delta cannot run with") as caught:
        configure_weight_sync(_config(**rollout), WeightSyncConfig("delta"))
    assert message in str(caught.value)


def test_delta_mode_refuses_offloaded_actor_parameters() -> None:
    config = _config()
    with open_dict(config):
        config.actor_rollout_ref.actor = {"fsdp_config": {"param_offload": True}}
    with pytest.raises(ValueError, match=r"fsdp_config.param_offload=true \(verl moves offloaded parameters back"):
        configure_weight_sync(config, WeightSyncConfig("delta"))


def test_a_sync_runs_with_expandable_segments_off_as_verl_s_naive_sync_does(monkeypatch) -> None:
    """verl's ServerAdapter shares its bucket by CUDA IPC; its naive branch turns the allocator's expandable
    segments off around the transfer, and so must the delta engine (verl's actor worker does it for naive only).
    The cache is emptied before it, with no garbage-collector pass of ours (0.45-0.9 s each on this machine)."""
    import gc

    from beyond_agent.weights import verl_backend

    allocator: list[str] = []
    monkeypatch.setattr(verl_backend, "set_expandable_segments", lambda on: allocator.append(f"expandable={on}"))
    monkeypatch.setattr(verl_backend, "release_cached_memory", lambda: allocator.append("empty_cache"))
    monkeypatch.setattr(gc, "collect", lambda *args: allocator.append("gc"))
    engine = DeltaCheckpointEngine(bucket_size=1 << 20, full_every=100)
    engine.adapter = adapter = InProcessAdapter()
    transfer = adapter.update_weights

    async def recording_transfer(weights, **kwargs):
        allocator.append("transfer")
        return await transfer(weights, **kwargs)

    adapter.update_weights = recording_transfer
    asyncio.run(engine.send_weights(iter(Weights().items()), global_steps=1))
    assert allocator == ["expandable=False", "empty_cache", "transfer", "expandable=True"]
    adapter.corrupt_seq, allocator[:] = 2, []  # a sync the receiver refuses ends the same way
    asyncio.run(engine.send_weights(iter(Weights().items()), global_steps=2))
    assert allocator[-1] == "expandable=True"


def test_send_dtype_trainer_keeps_the_trainer_s_dtype_and_an_unknown_one_is_refused() -> None:
    config = _config()
    configure_weight_sync(config, WeightSyncConfig("delta", full_every=4, send_dtype="trainer"))
    assert config.actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs[BACKEND]["float_dtype"] is None
    engine = DeltaCheckpointEngine(bucket_size=1 << 20, float_dtype="bfloat16")
    assert engine.sender.float_dtype is torch.bfloat16
    with pytest.raises(ValueError, match=r"send_dtype must be one of \['rollout', 'trainer'\]"):
        WeightSyncConfig("delta", send_dtype="fp16")


def test_delta_mode_refuses_a_run_whose_model_copies_exceed_the_host_budget() -> None:
    def qwen_7b_on_8_gpus() -> OmegaConf:
        config = _config()
        with open_dict(config):
            config.actor_rollout_ref.model.path = "Qwen/Qwen2.5-7B-Instruct"
            config.trainer = {"n_gpus_per_node": 8}
        return config

    # 8 GPUs x 2 copies (actor snapshot, vLLM mirror) x 7.62 B parameters x 2 bytes (bf16) = 227 GiB per node;
    # x 4 bytes (fp32) = 454 GiB.
    with pytest.raises(ValueError, match=r"host memory: 227 GiB per node .* over the 200 GiB of "
                                         r"beyond_agent.weight_sync.host_memory_gib"):
        configure_weight_sync(qwen_7b_on_8_gpus(), WeightSyncConfig("delta", host_memory_gib=200))
    configure_weight_sync(qwen_7b_on_8_gpus(), WeightSyncConfig("delta", host_memory_gib=400))
    with pytest.raises(ValueError, match="host memory: 454 GiB per node"):
        configure_weight_sync(qwen_7b_on_8_gpus(), WeightSyncConfig("delta", send_dtype="trainer", host_memory_gib=400))
    with pytest.raises(ValueError, match="host_memory_gib must be a number > 0 or null"):
        WeightSyncConfig("delta", host_memory_gib=0)


def adam_like_step(weights: torch.Tensor, lr: float, generator: torch.Generator) -> torch.Tensor:
    """One Adam step's size on every element: Adam normalises the gradient, so each element moves by about
    lr (here lr x a factor in [0.5, 1.5]) in a random direction."""
    direction = torch.randint(0, 2, weights.shape, generator=generator) * 2 - 1
    return weights + lr * direction * (0.5 + torch.rand(weights.shape, generator=generator))


def test_at_lr_1e_6_a_bf16_delta_changes_few_elements_an_fp32_delta_nearly_all() -> None:
    """The examples' lr 1e-6 on Qwen-like weights (normal, std 0.02; norms around 1): in fp32 almost every
    element changes each step, so the delta is the whole model; rounded to bf16, as vLLM holds them, an
    element changes only when its step crosses a bf16 rounding boundary (about 2^-8 of its magnitude apart)."""
    generator = torch.Generator().manual_seed(0)
    before = {"model.layers.0.mlp.up_proj.weight": torch.randn(512, 1024, generator=generator) * 0.02,
              "model.layers.0.input_layernorm.weight": 1.0 + 0.05 * torch.randn(1024, generator=generator)}
    after = {name: adam_like_step(tensor, 1e-6, generator) for name, tensor in before.items()}
    metrics = {}
    for dtype in (None, torch.bfloat16):
        sender = WeightDeltaSender(WeightSyncConfig("delta", full_every=10), float_dtype=dtype)
        sender.encode(before.items())
        metrics[dtype] = sender.encode(after.items()).metrics
    fp32, bf16 = metrics[None], metrics[torch.bfloat16]
    assert fp32["beyond_agent/weight_sync/changed_fraction"] == 1.0 and fp32["beyond_agent/weight_sync/sent_fraction"] == 1.0  # all, whole
    # Measured on these weights: 4.2% of the elements change in bf16 (the smallest weights have the finest
    # bf16 steps); the delta is 131 532 bytes, 6.3% of the fp32 full sync's 2 101 248.
    assert bf16["beyond_agent/weight_sync/changed_fraction"] < 0.05
    assert bf16["beyond_agent/weight_sync/bytes_sent"] < 0.07 * fp32["beyond_agent/weight_sync/bytes_full"]
    receiver_weights = _apply_both(before, after, torch.bfloat16)  # exactly the bf16 rounding of the weights
    assert all(torch.equal(receiver_weights[name], after[name].to(torch.bfloat16)) for name in after)


def _apply_both(before: dict, after: dict, dtype: torch.dtype) -> dict:
    sender, endpoint, loader = WeightDeltaSender(WeightSyncConfig("delta", full_every=10), float_dtype=dtype), \
        DeltaSyncEndpoint(), Loader()
    for weights in (before, after):
        endpoint.accept(copy_stream(pack_sync(sender.encode(weights.items()))[0]), load=loader)
    return loader.calls[-1]


def test_settings_read_the_weight_sync_section() -> None:
    base = {"beyond_agent": {"env": {"url": "http://127.0.0.1:8000"}},
            "data": {"max_prompt_length": 512, "max_response_length": 256},
            "actor_rollout_ref": {"rollout": {"temperature": 1.0}}}
    assert BeyondAgentConfig.from_config(base).weight_sync == WeightSyncConfig("full", 10, "rollout")
    base["beyond_agent"]["weight_sync"] = {"mode": "delta", "full_every": 2}
    assert BeyondAgentConfig.from_config(base).weight_sync == WeightSyncConfig("delta", 2)
    base["beyond_agent"]["weight_sync"] = {"mode": "sparse"}
    with pytest.raises(ValueError, match=r"beyond_agent\.weight_sync\.mode must be one of"):
        BeyondAgentConfig.from_config(base)


class EightRanks:
    """verl's actor worker group as `DeltaCheckpointEngineManager` sees it, for 8 ranks in this process: each
    rank a real `DeltaCheckpointEngine` (as verl builds it: bucket size, is_master on rank 0) whose rollout is
    an `InProcessAdapter`, so each rank has its own receiving endpoint; calls come back as Ray object refs, as
    from verl's RayWorkerGroup. `refusing_rank`'s receiver gets sync `corrupt_seq` with one bit flipped."""

    world_size = 8

    def __init__(self, refusing_rank: int, corrupt_seq: int) -> None:
        self.engines = [DeltaCheckpointEngine(bucket_size=1 << 20, is_master=rank == 0, full_every=100)
                        for rank in range(self.world_size)]
        self.adapters = [InProcessAdapter(corrupt_seq=corrupt_seq if rank == refusing_rank else None)
                         for rank in range(self.world_size)]
        self.weights = Weights()
        self.calls: list[str] = []

    def execute_checkpoint_engine(self, methods: list[str], *per_rank_args: list) -> list:
        import ray

        assert len(methods) == self.world_size and all(len(args) == self.world_size for args in per_rank_args)
        self.calls.append(methods[0])
        results = []
        for rank, method in enumerate(methods):
            if method == "attach_rollout":  # verl's ServerAdapter to this rank's vLLM server: ours in process
                self.engines[rank].adapter = self.adapters[rank]
                results.append(True)
            else:
                results.append(getattr(self.engines[rank], method)(*(args[rank] for args in per_rank_args)))
        return [ray.put(result) for result in results]

    def update_weights(self, global_steps: int | None = None, mode: str | None = None) -> list:
        """What each verl actor worker does for a non-naive backend: stream its weights into its engine."""
        import ray

        assert mode == BACKEND
        # Each verl worker runs its engine in its own process and event loop; here each in its own thread,
        # since the manager's caller already runs one.
        with ThreadPoolExecutor(1) as worker:
            return [ray.put(worker.submit(asyncio.run, engine.send_weights(iter(self.weights.items()),
                                                                           global_steps=global_steps)).result())
                    for engine in self.engines]


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def test_the_manager_redoes_a_sync_in_full_on_every_rank_when_one_rank_refuses(local_ray) -> None:
    from types import SimpleNamespace

    from beyond_agent.weights.verl_backend import DeltaCheckpointEngineManager

    ranks = EightRanks(refusing_rank=5, corrupt_seq=2)
    config = SimpleNamespace(backend=BACKEND, custom_backend_module="beyond_agent.weights.verl_backend")
    manager = DeltaCheckpointEngineManager(config, ranks, replicas=[SimpleNamespace(config="rollout config")])
    assert ranks.calls == ["attach_rollout"]
    results = []
    for step in range(4):
        results.append(manager.update_weights(global_steps=step))
        for adapter in ranks.adapters:  # every rank's rollout serves this step's weights, the refusing one too
            assert_loaded_equal(adapter.loader.calls[-1], ranks.weights.items())
        ranks.weights.step()
    failed = [m["beyond_agent/weight_sync/verify_failed"] for m in results]
    assert failed == [0.0, 0.0, 1.0, 0.0]  # rank 5's refusal, max-reduced over the 8 ranks
    assert [m["beyond_agent/weight_sync/retried_full"] for m in results] == [0.0, 0.0, 1.0, 0.0]
    assert ranks.calls == ["attach_rollout", "request_full"]  # one request, to all 8 engines at once
    # sync 2 was refused on rank 5 only; the retry (seq 3) went full to every rank, and the next is a delta again
    assert [e.sender.seq for e in ranks.engines] == [4] * 8
    assert ranks.adapters[5].endpoint.failures == 1 and sum(a.endpoint.failures for a in ranks.adapters) == 1
    assert all(len(a.loader.calls) == 5 for a in ranks.adapters[:5] + ranks.adapters[6:])  # seq 0-4
    assert len(ranks.adapters[5].loader.calls) == 4  # seq 2 refused, nothing loaded; its full retry was
    assert results[2]["beyond_agent/weight_sync/verify_failures_total"] == 1.0 == results[3]["beyond_agent/weight_sync/verify_failures_total"]
    retry_bytes = results[2]["beyond_agent/weight_sync/bytes_sent"]
    assert retry_bytes > results[2]["beyond_agent/weight_sync/bytes_full"]  # both transfers of the step are counted


def test_each_of_8_ranks_with_tp_2_reaches_its_own_vllm_worker(local_ray, monkeypatch) -> None:
    """`attach_rollout` builds verl's real vLLM ServerAdapter per actor rank (as verl's CheckpointEngineWorker
    does): with TP 2 on 8 GPUs, 4 replicas; each rank streams through the socket of its own TP worker, and the
    first rank of each replica owns the server whose collective_rpc makes both workers receive (so a
    refusal by either worker surfaces on that rank, which the manager's max over ranks catches)."""
    from verl.workers.config import RolloutConfig

    config = RolloutConfig(name="vllm", mode="async", tensor_model_parallel_size=2)
    monkeypatch.setenv("RAY_LOCAL_WORLD_SIZE", "8")
    adapters = []
    for rank in range(8):
        monkeypatch.setenv("RANK", str(rank))
        engine = DeltaCheckpointEngine(bucket_size=1 << 20)
        assert engine.attach_rollout(config)
        adapters.append(engine.adapter)
    assert [a.replica_rank for a in adapters] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [a._has_server for a in adapters] == [True, False] * 4
    sockets = [a.zmq_handle.rsplit("-replica-", 1)[1] for a in adapters]
    assert sockets == [f"{replica}-rank-{tp_rank}.sock" for replica in range(4) for tp_rank in range(2)]
    assert len({a.zmq_handle for a in adapters}) == 8  # no two ranks write into one worker's socket


def test_a_token_mode_sync_aborts_what_a_real_ray_server_actor_is_generating(local_ray) -> None:
    """`training.interrupt_servers` reaches each of verl's vLLM server actors with Ray's `__ray_call__`, which Ray runs
    on a thread of an async actor, not on its event loop (where a first version failed with "no running event loop",
    seen in the CPU training run): an actor shaped like verl's server (its engine's output task on the actor's loop)
    has its request aborted mid-generation, answering with what it generated."""
    import ray

    from beyond_agent.training import interrupt_servers

    @ray.remote
    class ServerLike:
        """`engine` as vLLM's AsyncLLM keeps it: requests by internal id, an output task, `abort(ids, internal)`."""

        def __init__(self) -> None:
            self.engine = None

        async def generate(self, tokens_before_abort: int) -> tuple[str, int]:
            import asyncio
            from types import SimpleNamespace

            if self.engine is None:
                engine = SimpleNamespace(output_processor=SimpleNamespace(request_states={}, parent_requests={}),
                                         output_handler=asyncio.create_task(asyncio.sleep(3600)), aborted=[])

                async def abort(request_ids, internal=False):
                    engine.aborted.append((list(request_ids), internal))
                    for request_id in request_ids:
                        engine.output_processor.request_states.pop(request_id).set()

                engine.abort = abort
                self.engine = engine
            stop = asyncio.Event()
            self.engine.output_processor.request_states["internal-1"] = stop
            try:
                await asyncio.wait_for(stop.wait(), 60)
            except asyncio.TimeoutError:
                return "completed", 1000
            return "aborted", tokens_before_abort

        def aborted(self) -> list:
            return self.engine.aborted

    server = ServerLike.remote()
    pending = server.generate.remote(7)
    deadline = time.monotonic() + 30
    while not ray.get(server.__ray_call__.remote(lambda actor: actor.engine is not None and bool(
            actor.engine.output_processor.request_states))):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    interrupt_servers([server])
    assert ray.get(pending, timeout=30) == ("aborted", 7)
    assert ray.get(server.aborted.remote()) == [(["internal-1"], True)]
    interrupt_servers([server])  # nothing in flight: nothing aborted, nothing raised
    assert ray.get(server.aborted.remote()) == [(["internal-1"], True)]
