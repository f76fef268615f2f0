"""Our vLLM worker extension: verify a delta sync before loading anything, and load LoRA adapters as vLLM does.

Selected with `actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls` (verl passes the key to
vLLM after its own default, verl's `vLLMColocateWorkerExtension`, which this class extends). A weight update
sent by `beyond_agent.weights.verl_backend.DeltaCheckpointEngine` carries `beyond_weight_sync=`; it is
received over verl's own bucketed IPC transport, decoded and verified by this worker's `DeltaSyncEndpoint`,
and only the verified full tensors are loaded, the way verl's extension loads a standard update. Any other
update goes to verl's extension unchanged.

A LoRA adapter update (verl sends the adapter's tensors with its PEFT config) is loaded by vLLM's own adapter
loading with the name mapping vLLM itself uses for adapters (`load_adapter_from_tensors`): verl 0.9's loader
maps names with the model's full weight mapper, which on vLLM 0.32 rewrites `q_proj` to the stacked `qkv_proj`
and fails in `set_lora`. Every adapter sync prints `[beyond_agent] lora adapter served: sync=N tensors=T
bytes=B load_s=S`; with `BEYOND_LORA_SERVED_DUMP=<folder>` it also writes what vLLM serves after the sync as
`served_<N>.safetensors`: per target module, scaling x lora_B @ lora_A (packed modules split into their
parts), so a test can compare it with the trainer's adapter.

`BEYOND_WEIGHT_SYNC_CHECK_LOADED=1` also compares, after each load, the model's parameters with the verified
tensors (1:1 names and vLLM's packed modules such as qkv_proj) and prints the counts.
"""

from __future__ import annotations

import os
import time
import types
from pathlib import Path
from typing import Any

import torch

from verl.utils.device import get_device_name
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from beyond_agent.seams import patch
from beyond_agent.weights.fingerprint import SERVED_DIFFER_MARKER, compare, tensors_fingerprint
from beyond_agent.weights.wire import WIRE_VERSION, DeltaSyncEndpoint

CHECK_LOADED_VARIABLE = "BEYOND_WEIGHT_SYNC_CHECK_LOADED"
SERVED_ADAPTER_DUMP_VARIABLE = "BEYOND_LORA_SERVED_DUMP"
"""Test hook: a folder where each adapter sync writes the served adapter's per-module weight change."""
ADAPTER_LOG_PREFIX = "[beyond_agent] lora adapter served:"
SERVE_BASE_VARIABLE = "BEYOND_LORA_SERVE_BASE_SYNC"
"""Test hook: after the adapter sync with this number, clear the adapter's slot in every LoRA layer, so requests
naming it see the base model (verl#7495's break, which the `served_weights` monitor must catch)."""


class WeightSyncWorkerExtension(vLLMColocateWorkerExtension):
    """verl's colocated worker extension plus the receiving end of delta weight syncs and LoRA adapter loading."""

    def _update_weights(self, weights: list[tuple[str, torch.Tensor]], peft_config: dict, base_sync_done: bool):
        """verl's load, with vLLM's own adapter name mapping for a LoRA adapter, which is then reported."""
        if not (peft_config and base_sync_done):
            return super()._update_weights(weights, peft_config=peft_config, base_sync_done=base_sync_done)
        manager = self.model_runner.lora_manager
        # On this manager only (verl's loader stays on the class for any other user): vLLM's own loading.
        patch(manager, "_load_adapter", types.MethodType(load_adapter_from_tensors, manager))
        started = time.perf_counter()
        super()._update_weights(weights, peft_config=peft_config, base_sync_done=base_sync_done)
        seconds = time.perf_counter() - started
        sync = getattr(self, "_beyond_adapter_syncs", 0)
        self._beyond_adapter_syncs = sync + 1
        received = sum(tensor.numel() * tensor.element_size() for _, tensor in weights)
        print(f"{ADAPTER_LOG_PREFIX} sync={sync} tensors={len(weights)} bytes={received} load_s={seconds:.4f}",
              flush=True)
        if os.environ.get(SERVE_BASE_VARIABLE) == str(sync):
            from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_INT_ID

            adapters = manager._adapter_manager
            slot = adapter_slot(adapters, VLLM_LORA_INT_ID)
            for module in adapters.modules.values():
                module.reset_lora(slot)
            print(f"{ADAPTER_LOG_PREFIX} sync={sync}: slot {slot} cleared ({SERVE_BASE_VARIABLE}): serving the base",
                  flush=True)
        dump = os.environ.get(SERVED_ADAPTER_DUMP_VARIABLE)
        if dump:
            from safetensors.torch import save_file

            from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_INT_ID

            served = manager._adapter_manager.get_adapter(VLLM_LORA_INT_ID)
            packed = getattr(self.model_runner.model, "packed_modules_mapping", {}) or {}
            Path(dump).mkdir(parents=True, exist_ok=True)
            save_file(served_weight_changes(served, packed), str(Path(dump) / f"served_{sync}.safetensors"))

    def beyond_served_fingerprints(self) -> dict:
        """What this worker serves, as `weights.fingerprint` sums: {"weights": its parameters (base weights), "adapter":
        the loaded LoRA adapter's change per module, or None when LoRA is on and no adapter is loaded; absent key
        when the engine serves no LoRA}."""
        from verl.workers.rollout.vllm_rollout.utils import VLLM_LORA_INT_ID

        model = self.model_runner.model
        served = {"weights": tensors_fingerprint(parameter for _, parameter in model.named_parameters()).as_dict()}
        manager = getattr(self.model_runner, "lora_manager", None)
        if manager is not None:
            changes = active_adapter_changes(manager._adapter_manager, VLLM_LORA_INT_ID)
            served["adapter"] = None if changes is None else tensors_fingerprint(changes).as_dict()
        return served

    def beyond_check_served(self, expected: dict, sync: str) -> None:
        """Raise when what this worker serves is not the trained model (`expected`: `fingerprint.trained_fingerprints`).
        Why raise: verl's server `collective_rpc` returns nothing to the trainer, but passes an error on."""
        problems = compare(expected, self.beyond_served_fingerprints())
        if problems:
            raise RuntimeError(f"{SERVED_DIFFER_MARKER} {sync} (vLLM worker {getattr(self, 'rank', '?')}): "
                               + "; ".join(problems))

    def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False,
                                beyond_weight_sync: int | None = None):
        """verl's update unless the sender is our delta engine; then receive, verify and load (or refuse)."""
        if beyond_weight_sync is None:
            return super().update_weights_from_ipc(peft_config=peft_config, base_sync_done=base_sync_done,
                                                   use_shm=use_shm)
        if beyond_weight_sync != WIRE_VERSION:
            raise ValueError(f"weight sync wire version {beyond_weight_sync}, this worker reads {WIRE_VERSION}")
        if peft_config:
            raise NotImplementedError("weight_sync.mode=delta does not sync LoRA adapters")
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver

        if self.device is None:  # as verl's extension: some platforms leave it unset
            self.device = torch.device(f"{get_device_name()}:{self.local_rank}")
        endpoint = self._weight_sync_endpoint()
        stream = endpoint.stream()

        def take(weights: list[tuple[str, torch.Tensor]], is_last: bool) -> None:
            # The bucket buffer is reused for the next bucket: the stream copies what it needs now (full
            # arrays straight into the mirror, delta arrays aside).
            stream.take(weights)

        BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device,
                               use_shm=use_shm).receive_weights(on_bucket_received=take)
        # Raises SyncRefusedError (logged and counted there) without calling _load_verified_weights.
        endpoint.finish(stream, load=self._load_verified_weights)

    def _weight_sync_endpoint(self) -> DeltaSyncEndpoint:
        endpoint = getattr(self, "_beyond_weight_sync_endpoint", None)
        if endpoint is None:
            endpoint = DeltaSyncEndpoint(label=f"vllm worker {getattr(self, 'rank', '?')}")
            self._beyond_weight_sync_endpoint = endpoint
        return endpoint

    def _load_verified_weights(self, weights: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """Load full tensors like verl's extension loads a standard (non-LoRA, unquantized) update."""
        from verl.utils.vllm.patch import patch_vllm_moe_model_weight_loader
        from verl.utils.vllm.vllm_quant_utils import is_fp8_model
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        if self._is_qat_model or self._is_modelopt_qat or is_fp8_model(self.model_runner.vllm_config):
            raise NotImplementedError("weight_sync.mode=delta does not load quantized rollout weights")
        for model in self._iter_all_models():
            patch_vllm_moe_model_weight_loader(model)
        self._update_weights(weights, peft_config=None, base_sync_done=True)
        for model, model_config in self._iter_all_models_with_config():
            process_weights_after_loading(model, model_config, self.device)
        if os.environ.get(CHECK_LOADED_VARIABLE, "0") == "1":
            return loaded_weights_check(self.model_runner.model, dict(weights))
        return {}


def load_adapter_from_tensors(manager: Any, lora_request: Any) -> Any:
    """A worker LoRA manager's `_load_adapter` for verl's `TensorLoRARequest` (the adapter as tensors), doing what
    vLLM 0.32's own `WorkerLoRAManager._load_adapter` does for an adapter folder; other requests go to vLLM's."""
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.worker_manager import WorkerLoRAManager

    tensors = getattr(lora_request, "lora_tensors", None)
    if tensors is None:
        return WorkerLoRAManager._load_adapter(manager, lora_request)
    peft_helper = PEFTHelper.from_dict(lora_request.peft_config)
    peft_helper.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    # Names only: the stacked maps (q_proj -> qkv_proj) are for loading weights, not for naming adapter modules.
    mapper = mapper.get_rename_mapper() if mapper is not None else None
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_request.lora_int_id, tensors=tensors, peft_helper=peft_helper, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size, weights_mapper=mapper,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    lora.is_3d_lora_weight = lora_request.is_3d_lora_weight
    manager._adapter_manager._validate_moe_lora_format(lora)
    manager._adapter_manager._validate_modules_to_save(lora)
    manager._adapter_manager._validate_token_classification_lora(lora)
    return lora


def adapter_slot(adapter_manager: Any, adapter_id: int) -> int | None:
    """The slot of vLLM's stacked LoRA buffers that holds the adapter (None: it holds none)."""
    slots = adapter_manager.lora_index_to_id
    return slots.index(adapter_id) if adapter_id in slots else None


def active_adapter_changes(adapter_manager: Any, adapter_id: int) -> list[torch.Tensor] | None:
    """What the adapter adds to each weight as requests see it: lora_B @ lora_A of its slot in every LoRA layer's
    stacked buffers (the scaling is folded into lora_B there, the rank padded with zeros), one product per slice of
    a packed layer; None when the adapter holds no slot (requests naming it would get the base model)."""
    slot = adapter_slot(adapter_manager, adapter_id)
    if slot is None:
        return None
    changes = []
    for module in adapter_manager.modules.values():
        stacked_a, stacked_b = getattr(module, "lora_a_stacked", None), getattr(module, "lora_b_stacked", None)
        if not isinstance(stacked_a, tuple):  # embeddings, logits: not among the layers a sync's adapter targets here
            continue
        for lora_a, lora_b in zip(stacked_a, stacked_b):
            changes.append(lora_b[slot, 0].float() @ lora_a[slot, 0].float())
    return changes


def served_weight_changes(lora_model: Any, packed: dict[str, list[str]]) -> dict[str, torch.Tensor]:
    """{target module: scaling x lora_B @ lora_A} of a vLLM LoRA model, a packed module's parts under their own
    names (`...qkv_proj` -> `...q_proj`, `...k_proj`, `...v_proj`), in float32."""
    changes = {}
    for name, weights in lora_model.loras.items():
        if weights.is_packed:
            fused = name.rsplit(".", 1)[-1]
            parts = [name[: -len(fused)] + part for part in packed.get(fused, [])]
            for part, lora_a, lora_b, scaling in zip(parts, weights.lora_a, weights.lora_b, weights.scaling):
                if lora_a is not None:
                    changes[part] = scaling * (lora_b.float() @ lora_a.float())
        else:
            changes[name] = weights.scaling * (weights.lora_b.float() @ weights.lora_a.float())
    return {name: change.contiguous() for name, change in changes.items()}


def loaded_weights_check(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> dict[str, int]:
    """How many of the model's parameters equal the tensors just loaded (`loaded_equal`), differ
    (`loaded_differ`), or could not be matched to them (`loaded_unchecked`: renamed, sharded, transformed)."""
    packed = getattr(model, "packed_modules_mapping", {}) or {}
    counts = {"loaded_equal": 0, "loaded_differ": 0, "loaded_unchecked": 0}
    for name, param in model.named_parameters():
        expected = _expected_param(name, weights, packed)
        if expected is None or tuple(expected.shape) != tuple(param.shape):
            counts["loaded_unchecked"] += 1
            continue
        same = torch.equal(param.detach().cpu(), expected.to(param.dtype))
        counts["loaded_equal" if same else "loaded_differ"] += 1
    return counts


def _expected_param(name: str, weights: dict[str, torch.Tensor], packed: dict[str, list[str]]) -> torch.Tensor | None:
    if name in weights:
        return weights[name]
    for fused, parts in packed.items():
        if f".{fused}." in name:
            names = [name.replace(f".{fused}.", f".{part}.") for part in parts]
            if all(part in weights for part in names):
                return torch.cat([weights[part] for part in names], dim=0)
    return None
