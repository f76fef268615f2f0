"""Trainer -> inference-engine weight transfer (`beyond_agent.weight_sync`).

- `delta`: the lossless full/delta sync codec (sender snapshot, receiver mirror, checksums, healing);
- `wire`: a sync as tensors that verl's bucketed IPC can carry;
- `verl_backend`: the actor side (a checkpoint-engine backend) and the driver side (a CheckpointEngineManager);
- `vllm_extension`: the receiver inside the vLLM worker, which verifies before it loads, and loads LoRA adapters;
- `lora`: LoRA runs on verl's own LoRA path (our extension named, the adapter counted, refusals before Ray).
"""

from beyond_agent.weights.delta import (
    CHECKSUM_ALGOS,
    METRIC_PREFIX,
    WEIGHT_SYNC_MODES,
    ChecksumMismatchError,
    EncodedSync,
    FullSyncRequiredError,
    ParamMeta,
    ParamPayload,
    PayloadError,
    PayloadKind,
    SequenceGapError,
    StaleSyncError,
    SyncHeader,
    SyncMode,
    WeightDeltaReceiver,
    WeightDeltaSender,
    WeightSyncConfig,
    WeightSyncError,
    tensor_checksum,
)

__all__ = [
    "CHECKSUM_ALGOS",
    "METRIC_PREFIX",
    "WEIGHT_SYNC_MODES",
    "ChecksumMismatchError",
    "EncodedSync",
    "FullSyncRequiredError",
    "ParamMeta",
    "ParamPayload",
    "PayloadError",
    "PayloadKind",
    "SequenceGapError",
    "StaleSyncError",
    "SyncHeader",
    "SyncMode",
    "WeightDeltaReceiver",
    "WeightDeltaSender",
    "WeightSyncConfig",
    "WeightSyncError",
    "tensor_checksum",
]
