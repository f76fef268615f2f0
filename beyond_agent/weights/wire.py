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
(`beyond_agent.weights.vllm_extension`): it reads a stream bucket by bucket (`SyncStream`: full arrays go
straight into its mirror, so a full sync needs no second host copy of the model), applies it, verifies
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
              "checksum_algo": sync.header.checksum_algo, "part_bytes": max_part_bytes, "params": entries}
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


def _parse_header(tensor: torch.Tensor) -> dict[str, Any]:
    try:
        header = json.loads(tensor.detach().cpu().contiguous().numpy().tobytes())
    except (UnicodeDecodeError, ValueError) as err:
        raise PayloadError(f"wire: the header is not valid JSON: {err}") from None
    if not isinstance(header, dict) or header.get("wire") != WIRE_VERSION or not isinstance(header.get("params"), list):
        raise PayloadError(f"wire: header of an unknown layout (expected wire={WIRE_VERSION})")
    return header


def _header_from_wire(header: dict[str, Any]) -> tuple[SyncHeader, list[PayloadKind], list[dict]]:
    """The SyncHeader, each parameter's payload kind and its raw entry; `PayloadError` when malformed."""
    metas, kinds = [], []
    for index, entry in enumerate(header["params"]):
        try:
            metas.append(ParamMeta(name=str(entry["name"]), shape=tuple(int(d) for d in entry["shape"]),
                                   dtype=_dtype(entry["dtype"]), checksum=int(entry["checksum"])))
            kinds.append(PayloadKind(entry["kind"]))
            for key in ("count", "values_parts", "positions_parts"):  # read later; refused now when not ints
                int(entry[key])
        except (KeyError, TypeError, ValueError) as err:
            raise PayloadError(f"wire: bad header entry {index}: {err}") from None
    try:
        sync_header = SyncHeader(seq=int(header["seq"]), base_seq=header["base_seq"], mode=SyncMode(header["mode"]),
                                 reason=str(header["reason"]), checksum_algo=str(header["checksum_algo"]),
                                 params=tuple(metas))
    except (KeyError, TypeError, ValueError) as err:
        raise PayloadError(f"wire: bad header field: {err}") from None
    return sync_header, kinds, header["params"]


def _joined(tensors: dict[str, torch.Tensor], stem: str, entry: dict, parts_key: str) -> torch.Tensor | None:
    """The parts `<stem>/0..n-1` taken out of `tensors`, as one byte tensor (None when the array was empty)."""
    count = int(entry[parts_key])  # checked by _header_from_wire
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


class SyncStream:
    """One sync as it arrives, bucket by bucket (`take`), then verified and loaded (`DeltaSyncEndpoint.finish`).

    The header comes first and is checked against the receiver before anything is written. Each FULL array
    is copied from the transport's buffer straight into the receiver's mirror tensor (`buffer_for`), so a full
    sync of a 7B model needs no second host copy beside the mirror; DELTA arrays (small) are copied aside.
    Any error is kept and the rest of the stream is drained without reading it: verl's sender waits for every
    bucket to be acknowledged.
    """

    def __init__(self, receiver: WeightDeltaReceiver) -> None:
        self.receiver = receiver
        self.header: SyncHeader | None = None
        """The sync's header, once its first tensor arrived."""
        self.error: WeightSyncError | None = None
        """Why the stream is refused, once something was wrong."""
        self._entries: list[dict] = []
        self._kinds: list[PayloadKind] = []
        self._part_bytes: int | None = None
        self._full: dict[int, torch.Tensor] = {}  # parameter index -> its mirror tensor, being written
        self._written: dict[int, int] = {}  # parameter index -> bytes written into it
        self._aside: dict[str, torch.Tensor] = {}  # delta arrays' parts, copied
        self._seen: set[str] = set()

    def take(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One bucket's tensors; they are transport buffers, read now and never kept."""
        if self.error is not None:
            return
        try:
            for name, tensor in named_tensors:
                self._take_one(name, tensor)
        except WeightSyncError as err:
            self.error = err
        except Exception as err:  # e.g. torch refusing a malformed tensor: still a refused sync
            self.error = PayloadError(f"wire: cannot read the stream: {type(err).__name__}: {err}")

    def payloads(self) -> list[ParamPayload]:
        """Every parameter's payload (FULL ones are the mirror tensors just written); `PayloadError` when a
        part, an array or the header is missing."""
        if self.error is not None:
            raise self.error
        if self.header is None:
            raise PayloadError("wire: the stream has no header")
        payloads = [self._payload(index, meta) for index, meta in enumerate(self.header.params)]
        if self._aside:
            raise PayloadError(f"wire: tensors no header entry names: {sorted(self._aside)[:5]}")
        return payloads

    def _take_one(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._seen:
            raise PayloadError(f"wire: tensor {name!r} received twice")
        if not name.startswith(PREFIX):
            raise PayloadError(f"wire: {name!r} is not a weight-sync tensor (is the sender in weight_sync.mode=delta?)")
        self._seen.add(name)
        if name == HEADER_NAME:
            return self._begin(tensor)
        if self.header is None:
            raise PayloadError(f"wire: {name!r} arrived before the header")
        index, array, part = _part_address(name)
        if array == "values" and 0 <= index < len(self._kinds) and self._kinds[index] is PayloadKind.FULL:
            self._write_full(index, part, name, tensor)
        else:  # checked against the header when the payloads are built
            self._aside[name] = tensor.detach().to("cpu", copy=True)

    def _begin(self, tensor: torch.Tensor) -> None:
        if self.header is not None:
            raise PayloadError("wire: a second header")
        raw = _parse_header(tensor)
        header, self._kinds, self._entries = _header_from_wire(raw)
        part_bytes = raw.get("part_bytes")
        if part_bytes is not None and (not isinstance(part_bytes, int) or part_bytes <= 0):
            raise PayloadError(f"wire: bad part_bytes {part_bytes!r}")
        self._part_bytes = part_bytes
        self.receiver.check(header)  # raises (and marks the receiver failed) before anything is written
        self.header = header

    def _write_full(self, index: int, part: int, name: str, tensor: torch.Tensor) -> None:
        meta = self.header.params[index]
        if tensor.dtype != torch.uint8 or tensor.dim() != 1:
            raise PayloadError(f"wire: {name!r} is {tensor.dtype}{tuple(tensor.shape)}, expected 1-d bytes")
        target = self._full.get(index)
        if target is None:
            target = self._full[index] = self.receiver.buffer_for(meta)
        flat = target.reshape(-1).view(torch.uint8)
        offset = part * self._part_bytes if self._part_bytes else 0
        if (part and not self._part_bytes) or offset + tensor.numel() > flat.numel():
            raise PayloadError(f"wire: {name!r} ({tensor.numel()} bytes at offset {offset}) lies outside "
                               f"{meta.name!r} ({flat.numel()} bytes)")
        flat[offset:offset + tensor.numel()].copy_(tensor)
        self._written[index] = self._written.get(index, 0) + tensor.numel()

    def _payload(self, index: int, meta: ParamMeta) -> ParamPayload:
        if self._kinds[index] is PayloadKind.FULL:
            return self._full_payload(index, meta)
        return self._delta_payload(index, meta)

    def _full_payload(self, index: int, meta: ParamMeta) -> ParamPayload:
        """The mirror tensor its parts were written into, once every part and byte arrived."""
        entry, elements = self._entries[index], torch.Size(meta.shape).numel()
        if int(entry["count"]) != elements:
            raise PayloadError(f"wire: full payload of {meta.name!r} has {entry['count']} elements for shape {meta.shape}")
        expected, parts = meta.dtype.itemsize * elements, int(entry["values_parts"])
        arrived = sum(f"{PREFIX}{index}/values/{k}" in self._seen for k in range(parts))
        if arrived != parts or self._written.get(index, 0) != expected:
            raise PayloadError(f"wire: {PREFIX}{index}/values is missing part(s): {arrived} of {parts} parts, "
                               f"{self._written.get(index, 0)} of {expected} bytes of {meta.name!r} arrived")
        values = self._full[index] if expected else torch.empty(meta.shape, dtype=meta.dtype)
        return ParamPayload(meta.name, PayloadKind.FULL, values)

    def _delta_payload(self, index: int, meta: ParamMeta) -> ParamPayload:
        """Changed positions and values, joined from the parts set aside."""
        entry, stem = self._entries[index], f"{PREFIX}{index}"
        count = int(entry["count"])
        if entry["positions_dtype"] is None:
            raise PayloadError(f"wire: delta payload of {meta.name!r} names no positions dtype")
        values = _array(_joined(self._aside, f"{stem}/values", entry, "values_parts"), meta.dtype, count, meta.name,
                        "values")
        positions = _array(_joined(self._aside, f"{stem}/positions", entry, "positions_parts"),
                           _dtype(entry["positions_dtype"]), count, meta.name, "positions")
        return ParamPayload(meta.name, PayloadKind.DELTA, values, positions)


def _part_address(name: str) -> tuple[int, str, int]:
    """`<PREFIX><i>/<values|positions>/<k>` -> (i, array, k); `PayloadError` for any other name."""
    fields = name.removeprefix(PREFIX).split("/")
    if len(fields) != 3 or fields[1] not in ("values", "positions") or not fields[0].isdigit() \
            or not fields[2].isdigit():
        raise PayloadError(f"wire: {name!r} is not <index>/<values|positions>/<part>")
    return int(fields[0]), fields[1], int(fields[2])


class DeltaSyncEndpoint:
    """The receiving end of delta syncs: decode, apply to the mirror, verify, and only then load.

    Runs in the inference worker (one per vLLM worker process). A sync arrives through a `SyncStream`
    (`stream()`, fed bucket by bucket) and is ended by `finish`, which returns a report of the applied sync or
    raises `SyncRefusedError` (after logging and counting the failure) having loaded nothing. `accept` does
    both for a stream already in hand.
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

    def stream(self) -> SyncStream:
        """A stream for the next sync."""
        return SyncStream(self.receiver)

    def accept(self, named_tensors: Iterable[tuple[str, torch.Tensor]],
               load: Callable[[list[tuple[str, torch.Tensor]]], Any]) -> dict[str, Any]:
        """Apply one whole received stream; call `load(weights)` with every verified full tensor, or raise."""
        stream = self.stream()
        stream.take(named_tensors)
        return self.finish(stream, load)

    def finish(self, stream: SyncStream, load: Callable[[list[tuple[str, torch.Tensor]]], Any]) -> dict[str, Any]:
        """Verify the streamed sync and call `load(weights)` with every verified full tensor, or raise."""
        start = time.perf_counter()
        seq = None if stream.header is None else stream.header.seq
        try:
            payloads = stream.payloads()
            header = stream.header
            # A stream that could not even be decoded left the mirror unverified, and the sender's next delta is
            # based on what it sent, not on what we hold: only a full sync restores a shared state.
            if self._wire_failure is not None and header.mode != SyncMode.FULL:
                raise FullSyncRequiredError(f"delta sync {header.seq} refused: waiting for a full sync "
                                            f"({self._wire_failure})")
            weights = self.receiver.apply(header, payloads)
        except WeightSyncError as err:
            self.failures += 1
            self._wire_failure = f"{type(err).__name__}: {err}"
            self.receiver.check_failed(err)
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
