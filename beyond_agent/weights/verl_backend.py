"""`weight_sync.mode: delta` on verl's hybrid trainer -> vLLM weight path, through verl's own seams only.

verl 0.9's hybrid (colocated) sync: `CheckpointEngineManager.update_weights` calls
`actor_wg.update_weights(mode=backend)`; with the `naive` backend each actor worker streams
`engine.get_per_tensor_param()` into its `ServerAdapter`, which packs the tensors into buckets on ZMQ IPC
for the vLLM worker extension's `update_weights_from_ipc`, which loads them into the model.

Delta mode keeps that transport and changes what flows through it (`configure_weight_sync` sets the keys):

- trainer side, in each actor worker process: `DeltaCheckpointEngine`, registered in verl's
  `CheckpointEngineRegistry` as `beyond_delta` and imported there through
  `checkpoint_engine.custom_backend_module`. For any backend but `naive` the actor worker hands the
  per-tensor stream to the engine's `send_weights`; ours encodes it against its snapshot
  (`WeightDeltaSender`), packs the sync into wire tensors (`wire.pack_sync`) and streams them through a
  `ServerAdapter` built from the rollout replicas' config, exactly as verl's own `CheckpointEngineWorker`
  builds one (`update_weights(..., beyond_weight_sync=WIRE_VERSION)`);
- rollout side, in each vLLM worker process: `vllm_extension.WeightSyncWorkerExtension`
  (`rollout.engine_kwargs.vllm.worker_extension_cls`) decodes, verifies and only then loads;
- driver: `DeltaCheckpointEngineManager` (`rollout.checkpoint_manager_class`) hands the replicas' rollout
  config to the engines once, runs the sync like the naive path does (no abort, no process group, which the
  base class's non-naive path would attempt against replica workers that in hybrid mode are the actor
  workers themselves), and when a receiver refused a sync, asks every engine for a full sync and syncs again
  at once, so the rollout never serves unverified weights nor stays behind the trainer. It returns the
  sync's `beyond_agent/weight_sync/*` metrics; verl's `fit()` discards them, so the recipe's trainer (`wrap_weight_sync`) adds
  them to the actor metrics of the step whose update they carry (fit() reduces those after the sync).

What verl's actor worker does around a `naive` sync and not around any other backend's (its
`update_weights`, engine_workers.py), our engine does itself, since the transfer is the same: the
ServerAdapter's bucket is a GPU buffer shared by CUDA IPC, so expandable segments are turned off (and the
cache emptied) for the sync and on again after it. The naive branch also moves offloaded parameters back to
the CPU after the sync; the engine cannot (it gets the tensors, not the training engine), so delta mode
refuses `fsdp_config.param_offload=true`.
"""

from __future__ import annotations

import os
import time
from typing import Any, Generator

import psutil
import ray
import torch
from omegaconf import open_dict

from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineManager, CheckpointEngineRegistry
from verl.utils.device import get_torch_device, set_expandable_segments
from verl.utils.ray_utils import auto_await

from beyond_agent.gpu_plan import GIB, ModelShape, model_shape
from beyond_agent.weights.delta import METRIC_PREFIX, WeightDeltaSender, WeightSyncConfig
from beyond_agent.weights.wire import LOG_PREFIX, REFUSED_MARKER, WIRE_VERSION, pack_sync, wire_bytes

BACKEND = "beyond_delta"
"""Our `checkpoint_engine.backend` name."""
BACKEND_MODULE = __name__
MANAGER_CLASS = f"{__name__}.DeltaCheckpointEngineManager"
WORKER_EXTENSION_CLASS = "beyond_agent.weights.vllm_extension.WeightSyncWorkerExtension"
"""Our vLLM worker extension: the receiver of delta syncs, and the loader of LoRA adapters (`weights.lora`)."""
FAILED = METRIC_PREFIX + "verify_failed"
"""1.0 when the receiver refused this step's sync (it was then redone in full)."""
FAULT_SEQ_VARIABLE = "BEYOND_WEIGHT_SYNC_FAULT_SEQ"
"""Test hook: flip one bit of the sync with this sequence number on its way out (the receiver must refuse it)."""


def configure_weight_sync(config: Any, settings: WeightSyncConfig) -> None:
    """Point verl's seams at the delta path when `weight_sync.mode` is delta; full mode touches nothing.

    Raises ValueError naming the key when the run is one the delta path does not serve.
    """
    if settings.mode != "delta":
        return
    rollout = config.actor_rollout_ref.rollout
    engine = rollout.checkpoint_engine
    vllm_kwargs = (rollout.get("engine_kwargs") or {}).get("vllm") or {}
    actor_fsdp = (config.actor_rollout_ref.get("actor") or {}).get("fsdp_config") or {}
    refusals = [
        (rollout.name != "vllm", f"actor_rollout_ref.rollout.name={rollout.name} (delta mode serves vllm)"),
        (rollout.mode != "async", f"actor_rollout_ref.rollout.mode={rollout.mode} (delta mode serves async)"),
        (engine.backend not in ("naive", BACKEND),
         f"actor_rollout_ref.rollout.checkpoint_engine.backend={engine.backend} (delta mode replaces naive)"),
        (engine.get("custom_backend_module") not in (None, "", BACKEND_MODULE),
         f"actor_rollout_ref.rollout.checkpoint_engine.custom_backend_module={engine.get('custom_backend_module')}"),
        (rollout.get("checkpoint_manager_class") not in (None, "", MANAGER_CLASS),
         f"actor_rollout_ref.rollout.checkpoint_manager_class={rollout.get('checkpoint_manager_class')}"),
        (vllm_kwargs.get("worker_extension_cls") not in (None, "", WORKER_EXTENSION_CLASS),
         f"actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls={vllm_kwargs.get('worker_extension_cls')}"),
        (bool(rollout.get("free_cache_engine")), "actor_rollout_ref.rollout.free_cache_engine=true (the delta "
         "path does not resume slept weights; only free_cache_engine=false is implemented)"),
        (bool(rollout.get("quantization")), f"actor_rollout_ref.rollout.quantization={rollout.get('quantization')}"),
        (bool(actor_fsdp.get("param_offload")), "actor_rollout_ref.actor.fsdp_config.param_offload=true (verl moves "
         "offloaded parameters back to the CPU after a naive sync only; the delta engine gets tensors, not the "
         "training engine)"),
        *_host_memory_refusal(config, settings),
    ]
    problems = [why for refused, why in refusals if refused]
    if problems:
        raise ValueError("beyond_agent.weight_sync.mode=delta cannot run with " + "; ".join(problems)
                         + ". Use weight_sync.mode=full (verl's own sync) for this run.")
    with open_dict(config):
        engine.backend = BACKEND
        engine.custom_backend_module = BACKEND_MODULE
        engine.engine_kwargs[BACKEND] = {"full_every": settings.full_every,
                                         "float_dtype": str(rollout.dtype) if settings.send_dtype == "rollout" else None}
        rollout.checkpoint_manager_class = MANAGER_CLASS
        rollout.engine_kwargs.vllm.worker_extension_cls = WORKER_EXTENSION_CLASS


def delta_host_bytes(shape: ModelShape, gpus_per_node: int, element_bytes: int) -> int:
    """Host memory per node the delta path holds: on every GPU, the actor rank's snapshot of the model and the
    vLLM worker's mirror (a sync is written into the mirror as it arrives: no third copy, `wire.SyncStream`)."""
    return gpus_per_node * 2 * shape.parameters * element_bytes


def _host_memory_refusal(config: Any, settings: WeightSyncConfig) -> list[tuple[bool, str]]:
    """(refused, why) when the estimate exceeds the budget; [] when the model's shape is unknown."""
    path = config.actor_rollout_ref.model.get("path")
    shape = model_shape(str(path)) if path else None
    if shape is None:
        return []
    trainer = config.get("trainer") or {}
    gpus = int(trainer.get("n_gpus_per_node", 1) or 1)
    rollout_dtype = str(config.actor_rollout_ref.rollout.get("dtype") or "bfloat16")
    element_bytes = _torch_dtype(rollout_dtype).itemsize if settings.send_dtype == "rollout" else 4
    needed = delta_host_bytes(shape, gpus, element_bytes)
    budget = (settings.host_memory_gib * GIB if settings.host_memory_gib is not None
              else psutil.virtual_memory().total)
    where = "beyond_agent.weight_sync.host_memory_gib" if settings.host_memory_gib is not None else "this machine"
    return [(needed > budget, f"host memory: {needed / GIB:.0f} GiB per node for {gpus} GPUs x 2 copies of "
             f"{path} ({shape.parameters / 1e9:.2f} B parameters x {element_bytes} bytes), over the "
             f"{budget / GIB:.0f} GiB of {where} (send_dtype=rollout halves fp32's share)")]


@CheckpointEngineRegistry.register(BACKEND)
class DeltaCheckpointEngine(CheckpointEngine):
    """Trainer side of delta mode, one per actor worker process (see the module docstring).

    Point-to-point through verl's colocated IPC wire, like `naive`: no process group, so `prepare`,
    `build_topology`, `init_process_group`, `finalize` and `receive_weights` are not used.
    """

    def __init__(self, bucket_size: int, is_master: bool = False, full_every: int = 10,
                 float_dtype: str | None = None) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.sender = WeightDeltaSender(WeightSyncConfig(mode="delta", full_every=int(full_every)),
                                        float_dtype=_torch_dtype(float_dtype))
        """The codec's trainer side: snapshot of the last sync, sequence numbers, full/delta choice."""
        self.adapter = None
        """verl's ServerAdapter to our colocated vLLM server (set by `attach_rollout`)."""

    def attach_rollout(self, rollout_config: Any) -> bool:
        """Build the ServerAdapter that carries our stream, as verl's CheckpointEngineWorker builds one."""
        from verl.workers.rollout import get_rollout_class

        self.adapter = get_rollout_class(rollout_config.name, rollout_config.mode)(
            config=rollout_config, model_config=None, device_mesh=None)
        return True

    def request_full(self, reason: str) -> None:
        """Make the next sync a full one (a receiver refused a sync)."""
        self.sender.request_full(reason)

    async def send_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                           global_steps: int | None = None) -> dict[str, float]:
        """Encode the weights against the snapshot, stream the sync to vLLM, return its metrics."""
        if self.adapter is None:
            raise RuntimeError(f"checkpoint_engine.backend={BACKEND} needs its rollout attached first: set "
                               f"actor_rollout_ref.rollout.checkpoint_manager_class={MANAGER_CLASS} "
                               "(configure_weight_sync does)")
        # As verl's naive branch around the same transfer: its bucket is shared by CUDA IPC, which the
        # allocator's expandable segments would break; the cache is emptied so the bucket finds room. Unlike that
        # branch, without a garbage-collector pass (verl's aggressive_empty_cache): one pass over the trainer
        # worker's ~880 000 objects took 0.45-0.9 s on the 2-core CPU machine, it ran twice a sync and freed
        # nothing the bucket needs, and verl's sender makes its own pass (and empties the cache) when the transfer
        # ends (docs/benchmarks.md, "Where a weight sync's seconds go").
        set_expandable_segments(False)
        release_cached_memory()
        try:
            sync, named, header_bytes, transfer_s, refusal = await self._encode_and_stream(weights, global_steps)
        finally:
            set_expandable_segments(True)
        metrics = {**sync.metrics,
                   METRIC_PREFIX + "header_bytes": float(header_bytes),
                   METRIC_PREFIX + "wire_bytes": float(wire_bytes(named)),
                   METRIC_PREFIX + "transfer_s": transfer_s,
                   FAILED: 1.0 if refusal else 0.0}
        if self.is_master:
            print(f"{LOG_PREFIX} sent: step={global_steps} seq={sync.header.seq} mode={sync.header.mode.value} "
                  f"reason={sync.header.reason!r} bytes_sent={int(metrics[METRIC_PREFIX + 'bytes_sent'])} "
                  f"bytes_full={int(metrics[METRIC_PREFIX + 'bytes_full'])} "
                  f"wire_bytes={int(metrics[METRIC_PREFIX + 'wire_bytes'])} "
                  f"changed_fraction={metrics[METRIC_PREFIX + 'changed_fraction']:.4f} "
                  f"receiver={'REFUSED: ' + refusal if refusal else 'verified'}", flush=True)
        return metrics

    async def _encode_and_stream(self, weights: Generator[tuple[str, torch.Tensor], None, None],
                                 global_steps: int | None):
        """Encode against the snapshot and stream to vLLM: (sync, wire tensors, header bytes, transfer seconds,
        the receiver's refusal or None)."""
        sync = self.sender.encode(weights)
        named, header_bytes = pack_sync(sync, max_part_bytes=self.bucket_size)  # parts fit verl's bucket
        named = _inject_fault(named, sync.header.seq)
        start = time.perf_counter()
        refusal = None
        try:
            await self.adapter.update_weights(iter(named), global_steps=global_steps, peft_config=None,
                                              base_sync_done=True, beyond_weight_sync=WIRE_VERSION)
        except Exception as err:  # a refusal crossed vLLM's RPC and Ray as an error message
            if REFUSED_MARKER not in str(err):
                raise
            refusal = _refusal_line(str(err))
            self.sender.request_full(refusal)
        return sync, named, header_bytes, time.perf_counter() - start, refusal

    def prepare(self):
        raise NotImplementedError(f"{BACKEND} needs no process group")

    @classmethod
    def build_topology(cls, *args, **kwargs):
        raise NotImplementedError(f"{BACKEND} needs no process group")

    def init_process_group(self, **kwargs):
        raise NotImplementedError(f"{BACKEND} needs no process group")

    def finalize(self):
        raise NotImplementedError(f"{BACKEND} needs no process group")

    async def receive_weights(self, global_steps: int | None = None):
        raise NotImplementedError(f"{BACKEND} is received by the vLLM worker extension {WORKER_EXTENSION_CLASS}")


def release_cached_memory() -> None:
    """Return the allocator's cached, unused device memory (no garbage-collector pass: see send_weights)."""
    get_torch_device().empty_cache()


def _torch_dtype(name: str | None) -> torch.dtype | None:
    """`bfloat16` (verl's rollout.dtype spelling) -> torch.bfloat16; None stays None."""
    if name is None:
        return None
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"actor_rollout_ref.rollout.dtype={name!r} is not a floating torch dtype")
    return dtype


def _refusal_line(message: str) -> str:
    """The receiver's own sentence out of the wrapped error text."""
    tail = message[message.index(REFUSED_MARKER) + len(REFUSED_MARKER):].lstrip(": ")
    return tail.splitlines()[0][:500] if tail else "refused"


def _inject_fault(named: list[tuple[str, torch.Tensor]], seq: int) -> list[tuple[str, torch.Tensor]]:
    """Test hook (`BEYOND_WEIGHT_SYNC_FAULT_SEQ`): flip the lowest bit of the first payload byte of that sync."""
    if os.environ.get(FAULT_SEQ_VARIABLE, "") != str(seq) or len(named) < 2:
        return named
    name, tensor = named[1]
    corrupted = tensor.clone()
    corrupted[0] ^= 1
    print(f"{LOG_PREFIX} test fault: flipped one bit of {name} in sync {seq}", flush=True)
    return [named[0], (name, corrupted), *named[2:]]


class DeltaCheckpointEngineManager(CheckpointEngineManager):
    """Driver side of delta mode: naive-style hybrid sync through `DeltaCheckpointEngine`, with an immediate
    full retry when a receiver refused a sync (see the module docstring)."""

    def __init__(self, config: Any, actor_wg: Any, replicas: list) -> None:
        super().__init__(config, actor_wg, replicas)
        if self.backend != BACKEND:
            raise ValueError(f"{type(self).__name__} drives checkpoint_engine.backend={BACKEND}, got {self.backend}")
        if not replicas:
            raise ValueError(f"{type(self).__name__} needs the rollout replicas (hybrid vLLM rollout)")
        self.verify_failures_total = 0
        """Syncs refused by a receiver in this run."""
        rollout_config = replicas[0].config
        world = actor_wg.world_size
        ray.get(actor_wg.execute_checkpoint_engine(["attach_rollout"] * world, [rollout_config] * world))

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> dict[str, float]:
        """One sync to every replica; its `beyond_agent/weight_sync/*` metrics (of the retry too, when there was one)."""
        metrics = self._sync(global_steps)
        if metrics[FAILED]:
            self.verify_failures_total += 1
            world = self.actor_wg.world_size
            reason = "a receiver refused the last sync"
            ray.get(self.actor_wg.execute_checkpoint_engine(["request_full"] * world, [reason] * world))
            retry = self._sync(global_steps)
            if retry[FAILED]:
                raise RuntimeError(f"{LOG_PREFIX}: a full sync failed verification right after a refused delta; "
                                   "the rollout still serves the weights of the last verified sync. See the "
                                   f"'{LOG_PREFIX} REFUSED' lines of the vLLM workers.")
            # Figures of the step's sync: both transfers' bytes and times, the change since the last verified
            # sync (the retry re-sends the refused sync's weights, so its own changed_fraction is 0).
            for key in ("bytes_sent", "index_bytes", "wire_bytes", "header_bytes", "transfer_s", "encode_s"):
                retry[METRIC_PREFIX + key] += metrics[METRIC_PREFIX + key]
            retry[METRIC_PREFIX + "changed_fraction"] = metrics[METRIC_PREFIX + "changed_fraction"]
            full_bytes = retry[METRIC_PREFIX + "bytes_full"]
            retry[METRIC_PREFIX + "sent_fraction"] = retry[METRIC_PREFIX + "bytes_sent"] / full_bytes if full_bytes else 0.0
            metrics = {**retry, FAILED: 1.0, METRIC_PREFIX + "retried_full": 1.0}
        else:
            metrics[METRIC_PREFIX + "retried_full"] = 0.0
        metrics[METRIC_PREFIX + "verify_failures_total"] = float(self.verify_failures_total)
        return metrics

    def _sync(self, global_steps: int | None) -> dict[str, float]:
        results = ray.get(self.actor_wg.update_weights(global_steps=global_steps, mode=self.backend))
        metrics = dict(results[0])
        # Only the ranks that own a vLLM server see a refusal (its collective_rpc spans the server's workers).
        metrics[FAILED] = max(float(result.get(FAILED, 0.0)) for result in results)
        return metrics
