"""The delta codec on verl's weight wire: an `EncodedSync` as (name, tensor) pairs, and the receiving end.

verl moves rollout weights as a stream of (name, tensor) pairs (vLLM: `BucketedWeightSender` over ZMQ IPC
or shared memory). `pack_sync` turns one sync of `beyond_agent.weights.delta` into such a stream,
so the codec rides verl's own transport unchanged:

    __beyond_weight_sync__/header            uint8 JSON: sequence, mode, and per parameter its name, shape,
                                             dtype, checksum, payload kind, element counts and part counts
    __beyond_weight_sync__/<i>/values/<k>    part k of the uint8 bytes of parameter i's values (whole tensor,
                                             or the changed ones)
    __beyond_weight_sync__/<i>/positions/<k> part k of the bytes of its int32/int64 changed positions (DELTA only)

Every payload travels as raw bytes: verl's bucket packs tensors back to back, and a value array of odd
length would leave the next array misaligned for its dtype. Empty arrays are not sent at all.

Why parts: verl's `BucketedWeightSender` sends a tensor larger than its bucket
(`checkpoint_engine.update_weights_bucket_megabytes`, 2 048 MiB by default) outside the bucket, by a CUDA IPC
handle (`_direct_send_large_weight`). Our payloads are CPU bytes: with shared memory that path refuses them,
and with CUDA IPC the vLLM worker fails to rebuild the handle (a CPU tensor's handle has 3 arguments, the
receiver sets the 7th) while the sender waits forever for its answer. Qwen2.5-7B's fp32 embedding and
lm_head are 2.18 GB each. So `pack_sync` cuts every array into parts no larger than the bucket (views, no
copy) and the receiver joins them.

`DeltaSyncEndpoint` is the receiving end the vLLM worker extension runs
(`beyond_agent.weights.vllm_extension`): it decodes a stream, applies it to its mirror, verifies
every parameter's checksum and only then hands the full tensors to `load`. A stream that fails anywhere
loads nothing, is logged and counted, and raises `SyncRefusedError`, whose message carries
`REFUSED_MARKER` so that the sender can tell a refusal from a transport failure after the error crossed
vLLM's RPC and Ray; until a full sync arrives every delta is refused.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable, Iterable

import torch

from beyond_agent.weights.delta import (
    EncodedSync,
    FullSyncRequiredError,
    ParamMeta,
    ParamPayload,
    PayloadError,
    PayloadKind,
    SyncHeader,
    SyncMode,
    WeightDeltaReceiver,
    WeightSyncError,
)

WIRE_VERSION = 2
"""Version of this stream layout; the sender passes it to the receiver (`beyond_weight_sync=`).
1: one tensor per array; 2: arrays in parts of at most the bucket size."""
PREFIX = "__beyond_weight_sync__/"
"""Prefix of every tensor name on the wire (never a parameter name)."""
HEADER_NAME = PREFIX + "header"
REFUSED_MARKER = "BEYOND_WEIGHT_SYNC_REFUSED"
"""In the message of every `SyncRefusedError`: survives str() through vLLM's RPC and Ray's error wrapping."""
LOG_PREFIX = "[beyond_agent] weight_sync"


class SyncRefusedError(RuntimeError):
    """The receiver refused a sync (it failed verification): nothing was loaded, a full sync is needed."""


# ---------------------------------------------------------------------------------------------- sender side


def pack_sync(sync: EncodedSync, max_part_bytes: int | None = None) -> tuple[list[tuple[str, torch.Tensor]], int]:
    """The sync as wire tensors (header first) and the header's size in bytes.

    `max_part_bytes`: no wire tensor but the header is larger (the transport's bucket size; None: one part per
    array). The tensors are byte views of the payloads (no copy): send them before encoding the next sync.
    """
    if max_part_bytes is not None and max_part_bytes <= 0:
        raise ValueError(f"max_part_bytes must be > 0, got {max_part_bytes}")
    by_name = {payload.name: payload for payload in sync.payloads}
    entries: list[dict[str, Any]] = []
    tensors: list[tuple[str, torch.Tensor]] = []
    for index, meta in enumerate(sync.header.params):
        payload = by_name[meta.name]
        positions = payload.positions
        value_parts = _parts(_bytes_of(payload.values), max_part_bytes)
        position_parts = [] if positions is None else _parts(_bytes_of(positions), max_part_bytes)
        entries.append({"name": meta.name, "shape": list(meta.shape), "dtype": _dtype_name(meta.dtype),
                        "checksum": meta.checksum, "kind": payload.kind.value, "count": payload.values.numel(),
                        "positions_dtype": None if positions is None else _dtype_name(positions.dtype),
                        "values_parts": len(value_parts), "positions_parts": len(position_parts)})
        tensors.extend((f"{PREFIX}{index}/values/{k}", part) for k, part in enumerate(value_parts))
        tensors.extend((f"{PREFIX}{index}/positions/{k}", part) for k, part in enumerate(position_parts))
    header = {"wire": WIRE_VERSION, "seq": sync.header.seq, "base_seq": sync.header.base_seq,
              "mode": sync.header.mode.value, "reason": sync.header.reason,
              "checksum_algo": sync.header.checksum_algo, "params": entries}
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    if max_part_bytes is not None and len(header_bytes) > max_part_bytes:
        raise ValueError(f"the weight-sync header ({len(header_bytes)} bytes, {len(entries)} parameters) does not fit "
                         f"one transport bucket of {max_part_bytes} bytes: raise "
                         "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes")
    header_tensor = torch.frombuffer(bytearray(header_bytes), dtype=torch.uint8)
    return [(HEADER_NAME, header_tensor)] + tensors, len(header_bytes)


def _parts(raw: torch.Tensor, max_part_bytes: int | None) -> list[torch.Tensor]:
    """Views of consecutive slices of `raw` bytes, none larger than `max_part_bytes`; [] when empty."""
    if not raw.numel():
        return []
    if max_part_bytes is None:
        return [raw]
    return list(torch.split(raw, max_part_bytes))


def wire_bytes(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
    """Bytes the stream puts on the transport."""
    return sum(tensor.nbytes for _, tensor in named_tensors)


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------- receiver side


def unpack_sync(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[SyncHeader, list[ParamPayload]]:
    """Rebuild the header and payloads from a received stream; `PayloadError` when it is malformed.

    Keeps references to the received tensors (the caller passes tensors it owns, not transport buffers).
    """
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if name in tensors:
            raise PayloadError(f"wire: tensor {name!r} received twice")
        if not name.startswith(PREFIX):
            raise PayloadError(f"wire: {name!r} is not a weight-sync tensor (is the sender in weight_sync.mode=delta?)")
        tensors[name] = tensor
    header_tensor = tensors.pop(HEADER_NAME, None)
    if header_tensor is None:
        raise PayloadError("wire: the stream has no header")
    header = _parse_header(header_tensor)
    metas, payloads = [], []
    for index, entry in enumerate(header["params"]):
        meta, payload = _param_from_wire(index, entry, tensors)
        metas.append(meta)
        payloads.append(payload)
    if tensors:
        raise PayloadError(f"wire: tensors no header entry names: {sorted(tensors)[:5]}")
    try:
        sync_header = SyncHeader(seq=int(header["seq"]), base_seq=header["base_seq"], mode=SyncMode(header["mode"]),
                                 reason=str(header["reason"]), checksum_algo=str(header["checksum_algo"]),
                                 params=tuple(metas))
    except (KeyError, TypeError, ValueError) as err:
        raise PayloadError(f"wire: bad header field: {err}") from None
    return sync_header, payloads


def _parse_header(tensor: torch.Tensor) -> dict[str, Any]:
    try:
        header = json.loads(tensor.detach().cpu().contiguous().numpy().tobytes())
    except (UnicodeDecodeError, ValueError) as err:
        raise PayloadError(f"wire: the header is not valid JSON: {err}") from None
    if not isinstance(header, dict) or header.get("wire") != WIRE_VERSION or not isinstance(header.get("params"), list):
        raise PayloadError(f"wire: header of an unknown layout (expected wire={WIRE_VERSION})")
    return header


def _param_from_wire(index: int, entry: Any, tensors: dict[str, torch.Tensor]) -> tuple[ParamMeta, ParamPayload]:
    try:
        name, shape, count = str(entry["name"]), tuple(int(d) for d in entry["shape"]), int(entry["count"])
        dtype, kind = _dtype(entry["dtype"]), PayloadKind(entry["kind"])
        meta = ParamMeta(name=name, shape=shape, dtype=dtype, checksum=int(entry["checksum"]))
        positions_dtype = None if entry["positions_dtype"] is None else _dtype(entry["positions_dtype"])
    except (KeyError, TypeError, ValueError) as err:
        raise PayloadError(f"wire: bad header entry {index}: {err}") from None
    values = _array(_joined(tensors, f"{PREFIX}{index}/values", entry, "values_parts"), dtype, count, name, "values")
    if kind is PayloadKind.FULL:
        if count != torch.Size(shape).numel():
            raise PayloadError(f"wire: full payload of {name!r} has {count} elements for shape {shape}")
        return meta, ParamPayload(name, kind, values.reshape(shape))
    if positions_dtype is None:
        raise PayloadError(f"wire: delta payload of {name!r} names no positions dtype")
    positions = _array(_joined(tensors, f"{PREFIX}{index}/positions", entry, "positions_parts"), positions_dtype,
                       count, name, "positions")
    return meta, ParamPayload(name, kind, values, positions)


def _joined(tensors: dict[str, torch.Tensor], stem: str, entry: dict, parts_key: str) -> torch.Tensor | None:
    """The parts `<stem>/0..n-1` taken out of `tensors`, as one byte tensor (None when the array was empty)."""
    try:
        count = int(entry[parts_key])
    except (KeyError, TypeError, ValueError) as err:
        raise PayloadError(f"wire: header entry {entry.get('name')!r} has no valid {parts_key}: {err}") from None
    parts = [tensors.pop(f"{stem}/{k}", None) for k in range(count)]
    missing = [k for k, part in enumerate(parts) if part is None]
    if missing:
        raise PayloadError(f"wire: {stem} is missing part(s) {missing[:5]} of {count}")
    if not parts:
        return None
    if any(part.dtype != torch.uint8 or part.dim() != 1 for part in parts):
        raise PayloadError(f"wire: a part of {stem} is not a 1-d uint8 tensor")
    return parts[0] if count == 1 else torch.cat(parts)


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _array(raw: torch.Tensor | None, dtype: torch.dtype, count: int, name: str, what: str) -> torch.Tensor:
    """`count` elements of `dtype` from received bytes (absent when empty)."""
    size = count * dtype.itemsize
    if raw is None:
        if size:
            raise PayloadError(f"wire: {what} of {name!r} missing ({size} bytes expected)")
        return torch.empty(0, dtype=dtype)
    if raw.dtype != torch.uint8 or raw.dim() != 1 or raw.numel() != size:
        raise PayloadError(f"wire: {what} of {name!r} is {raw.dtype}{tuple(raw.shape)}, expected {size} bytes")
    try:
        return raw.view(dtype)
    except RuntimeError:  # a view into a shared buffer at an offset not aligned for dtype
        return raw.clone().view(dtype)


class DeltaSyncEndpoint:
    """The receiving end of delta syncs: decode, apply to the mirror, verify, and only then load.

    Runs in the inference worker (one per vLLM worker process). `accept` returns a report of the applied
    sync, or raises `SyncRefusedError` (after logging and counting the failure) having loaded nothing.
    """

    def __init__(self, label: str = "") -> None:
        self.receiver = WeightDeltaReceiver()
        """The mirror and its verification."""
        self.label = label
        """Who this endpoint is, in its log lines (e.g. the vLLM worker rank)."""
        self.applied = 0
        """Syncs applied and loaded."""
        self.failures = 0
        """Syncs refused."""
        self._wire_failure: str | None = None

    def accept(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
               load: Callable[[list[tuple[str, torch.Tensor]]], Any]) -> dict[str, Any]:
        """Apply one received stream; call `load(weights)` with every verified full tensor, or raise."""
        start = time.perf_counter()
        seq = None
        try:
            header, payloads = unpack_sync(named_tensors)
            seq = header.seq
            # A stream that could not even be decoded left the mirror untouched, but the sender's next delta is
            # based on what it sent, not on what we hold: only a full sync restores a shared state.
            if self._wire_failure is not None and header.mode != SyncMode.FULL:
                raise FullSyncRequiredError(f"delta sync {header.seq} refused: waiting for a full sync "
                                            f"({self._wire_failure})")
            weights = self.receiver.apply(header, payloads)
        except WeightSyncError as err:
            self.failures += 1
            self._wire_failure = f"{type(err).__name__}: {err}"
            message = (f"{REFUSED_MARKER}: sync {seq} refused by {self.label or 'the receiver'}: "
                       f"{type(err).__name__}: {err} (nothing loaded; failures so far: {self.failures})")
            print(f"{LOG_PREFIX} REFUSED {self._where()}seq={seq} error={type(err).__name__}: {err}; nothing loaded, "
                  f"waiting for a full sync; failures={self.failures}", flush=True)
            raise SyncRefusedError(message) from err
        self._wire_failure = None
        verified_s = time.perf_counter() - start
        extra = load(weights)
        self.applied += 1
        report = {"seq": header.seq, "mode": header.mode.value, "params": len(weights),
                  "payload_bytes": sum(p.nbytes for p in payloads), "verify_s": verified_s,
                  "load_s": time.perf_counter() - start - verified_s, "failures": self.failures}
        if isinstance(extra, dict):
            report.update(extra)
        details = " ".join(f"{key}={_fmt(value)}" for key, value in report.items())
        print(f"{LOG_PREFIX} applied {self._where()}{details} verified={len(weights)}/{len(weights)}", flush=True)
        return report

    def _where(self) -> str:
        return f"[{self.label}] " if self.label else ""


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, float) else str(value)
