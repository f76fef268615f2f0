"""The vLLM worker extension of `weight_sync.mode: delta`: verify a delta sync before loading anything.

Selected with `actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls` (verl passes the key to
vLLM after its own default, verl's `vLLMColocateWorkerExtension`, which this class extends). A weight update
sent by `beyond_agent.weights.verl_backend.DeltaCheckpointEngine` carries `beyond_weight_sync=`; it is
received over verl's own bucketed IPC transport, decoded and verified by this worker's `DeltaSyncEndpoint`,
and only the verified full tensors are loaded, the way verl's extension loads a standard update. Any other
update goes to verl's extension unchanged.

`BEYOND_WEIGHT_SYNC_CHECK_LOADED=1` also compares, after each load, the model's parameters with the verified
tensors (1:1 names and vLLM's packed modules such as qkv_proj) and prints the counts.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from verl.utils.device import get_device_name
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from beyond_agent.weights.wire import WIRE_VERSION, DeltaSyncEndpoint

CHECK_LOADED_VARIABLE = "BEYOND_WEIGHT_SYNC_CHECK_LOADED"


class DeltaSyncWorkerExtension(vLLMColocateWorkerExtension):
    """verl's colocated worker extension plus the receiving end of delta weight syncs."""

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
