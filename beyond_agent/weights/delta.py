"""Lossless delta weight sync: after each training step, send only the weight elements whose bits changed.

A transport-independent codec for the trainer -> inference-engine weight transfer. The sender keeps a CPU
snapshot of what it last sent and encodes each parameter either FULL (the whole tensor) or DELTA (the flat
positions of the elements whose bit patterns changed, plus their new values in the tensor's own dtype).
The receiver keeps its own mirror, applies the payloads and verifies every parameter against the checksum
the sender computed from the FULL resulting tensor; a corrupted, missed or reordered sync raises a
`WeightSyncError` and nothing from it is returned, so the caller keeps serving the last verified weights
and asks the sender for a full sync, which heals the mirror.

    sender = WeightDeltaSender(WeightSyncConfig(mode="delta", full_every=10))   # trainer process
    receiver = WeightDeltaReceiver()                                            # inference process
    sync = sender.encode(model.state_dict().items())
    ... move sync.header and sync.payloads over any transport ...
    try:
        weights = receiver.apply(sync.header, sync.payloads)    # verified (name, tensor) pairs
    except WeightSyncError as err:
        sender.request_full(str(err))                           # the next sync is full and heals it
    else:
        engine.load_weights(weights)
    log(sync.metrics)                                           # beyond_agent/weight_sync/bytes_sent, ...
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from enum import Enum
from typing import Iterable

import numpy as np
import torch

try:  # xxhash ships with verl's `datasets` dependency; crc32 (zlib) is the always-present fallback.
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

WEIGHT_SYNC_MODES = ("full", "delta")
"""Valid values of `weight_sync.mode`."""
SEND_DTYPES = ("rollout", "trainer")
"""Valid values of `weight_sync.send_dtype`."""
CHECKSUM_ALGOS = ("xxh3_64", "crc32")
"""Checksums a header may name; the receiver verifies with the one the sender used."""
METRIC_PREFIX = "beyond_agent/weight_sync/"
"""Prefix of every metric key this module returns: under our namespace (`run_folder.METRICS_PREFIX`; runs before
2026-11-28 logged them as `weight_sync/...`, which `run_folder.current_metric_key` maps here)."""

# Integer dtypes of each element size: comparing bit patterns through them catches changes that float
# comparison misses (NaN -> NaN with other payload bits, 0.0 -> -0.0) and is never fooled by NaN != NaN.
_BIT_VIEW_DTYPES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_INT32_MAX = 2**31 - 1


# ---------------------------------------------------------------------------------------------- config


@dataclass(frozen=True)
class WeightSyncConfig:
    """How weights travel from the trainer to the inference engine (`beyond_agent.weight_sync`)."""

    mode: str = "full"
    """`full`: every sync sends every tensor. `delta`: send only the elements that changed since the last sync."""
    full_every: int = 10
    """In delta mode, every `full_every`-th sync is a full one (1 = always full)."""
    send_dtype: str = "rollout"
    """In delta mode, the dtype floating weights are compared and sent in. `rollout`: the rollout's
    (`actor_rollout_ref.rollout.dtype`, bf16 on GPUs), which is what vLLM stores anyway (it rounds fp32 to
    nearest-even when loading, as the cast here does): half the bytes of fp32, and at small learning rates
    most updates do not move an element across a bf16 step, so far fewer elements change. `trainer`: as the
    trainer holds them (fp32), for models whose rollout keeps some parameters in fp32 (e.g. MoE gates)."""
    host_memory_gib: float | None = None
    """In delta mode, the host memory per node its copies of the model may take (None: this machine's total
    memory); a run whose estimate exceeds it is refused before it starts (`verl_backend.delta_host_bytes`)."""

    def __post_init__(self) -> None:
        if self.mode not in WEIGHT_SYNC_MODES:
            raise ValueError(f"beyond_agent.weight_sync.mode must be one of {list(WEIGHT_SYNC_MODES)}, got {self.mode!r}")
        if self.host_memory_gib is not None and (isinstance(self.host_memory_gib, bool)
                                                 or not isinstance(self.host_memory_gib, (int, float))
                                                 or self.host_memory_gib <= 0):
            raise ValueError(f"beyond_agent.weight_sync.host_memory_gib must be a number > 0 or null, "
                             f"got {self.host_memory_gib!r}")
        if self.send_dtype not in SEND_DTYPES:
            raise ValueError(f"beyond_agent.weight_sync.send_dtype must be one of {list(SEND_DTYPES)}, "
                             f"got {self.send_dtype!r}")
        # bool is an int subclass; `full_every: true` is a typo, not 1.
        if isinstance(self.full_every, bool) or not isinstance(self.full_every, int) or self.full_every < 1:
            raise ValueError(f"beyond_agent.weight_sync.full_every must be an integer >= 1 (1 = every sync is full), "
                             f"got {self.full_every!r}")


# ---------------------------------------------------------------------------------------------- wire


class SyncMode(str, Enum):
    """Whether a sync stands alone (FULL) or is applied on top of the sync named by `base_seq` (DELTA)."""

    FULL = "full"
    DELTA = "delta"


class PayloadKind(str, Enum):
    """How one parameter travels: the whole tensor (FULL) or changed positions + values (DELTA)."""

    FULL = "full"
    DELTA = "delta"


@dataclass(frozen=True)
class ParamMeta:
    """What the receiver's tensor for one parameter must be after the sync."""

    name: str
    """Parameter name, as the inference engine's `load_weights` expects it."""
    shape: tuple[int, ...]
    """Shape of the resulting tensor."""
    dtype: torch.dtype
    """Dtype of the resulting tensor."""
    checksum: int
    """Checksum (header's `checksum_algo`) of the FULL resulting tensor: dtype, shape and bytes."""


@dataclass(frozen=True)
class SyncHeader:
    """Everything the receiver needs to decide whether a sync may be applied and to verify its result."""

    seq: int
    """This sync's sequence number; the sender counts 0, 1, 2, ..."""
    base_seq: int | None
    """The sync a DELTA sync applies on top of; None for a FULL sync."""
    mode: SyncMode
    """FULL (every payload is FULL, the parameter set is replaced) or DELTA."""
    reason: str
    """Why this mode was chosen (first sync, periodic, requested by the receiver, configured, ...)."""
    checksum_algo: str
    """One of CHECKSUM_ALGOS."""
    params: tuple[ParamMeta, ...]
    """Every parameter of the model after this sync, in the order the sender saw them."""


@dataclass(frozen=True)
class ParamPayload:
    """The data of one parameter in one sync."""

    name: str
    """Parameter name (matches a ParamMeta of the header)."""
    kind: PayloadKind
    """FULL or DELTA."""
    values: torch.Tensor
    """FULL: the whole tensor. DELTA: 1-D new values at `positions`, in the parameter's own dtype (lossless)."""
    positions: torch.Tensor | None = None
    """DELTA only: 1-D int32 (int64 for tensors of 2**31 elements or more) flat positions that changed."""

    @property
    def nbytes(self) -> int:
        """Bytes this payload puts on the wire (values + positions)."""
        return self.values.nbytes + (0 if self.positions is None else self.positions.nbytes)


@dataclass(frozen=True)
class EncodedSync:
    """One sync as the sender produced it: the header and payloads to transport, and its metrics to log."""

    header: SyncHeader
    """Sequence numbers, mode and per-parameter checksums."""
    payloads: tuple[ParamPayload, ...]
    """One payload per parameter of the header. Read-only: FULL values may share the sender's snapshot."""
    metrics: dict[str, float]
    """`beyond_agent/weight_sync/...` metrics of this sync (see WeightDeltaSender.encode)."""


# ---------------------------------------------------------------------------------------------- errors


class WeightSyncError(RuntimeError):
    """A sync failed verification. Nothing from it was returned; the receiver now accepts only a full sync."""


class StaleSyncError(WeightSyncError):
    """The sync is not newer than the last applied one (replayed or delivered late)."""


class SequenceGapError(WeightSyncError):
    """A delta is not based on the receiver's last applied sync: a sync was missed or arrived out of order."""


class FullSyncRequiredError(WeightSyncError):
    """A delta arrived while the receiver waits for a full sync (none yet, or an earlier sync failed)."""


class PayloadError(WeightSyncError):
    """A payload is malformed, missing, duplicated or does not fit the parameter it names."""


class ChecksumMismatchError(WeightSyncError):
    """A parameter's resulting tensor does not match the checksum the sender computed."""


# ---------------------------------------------------------------------------------------------- helpers


def tensor_checksum(tensor: torch.Tensor, algo: str) -> int:
    """Checksum of a tensor's dtype, shape and bytes with `algo` (one of CHECKSUM_ALGOS)."""
    meta = f"{tensor.dtype}|{tuple(tensor.shape)}".encode()
    data = _byte_view(tensor)
    if algo == "xxh3_64":
        if xxhash is None:
            raise WeightSyncError("checksum 'xxh3_64' needs the xxhash package, which is not installed here")
        hasher = xxhash.xxh3_64(meta)
        hasher.update(data)
        return hasher.intdigest()
    if algo == "crc32":
        return zlib.crc32(data, zlib.crc32(meta))
    raise WeightSyncError(f"unknown checksum {algo!r}; known: {list(CHECKSUM_ALGOS)}")


def _byte_view(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a uint8 array, without copying when it is already contiguous on the CPU."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy()


def _cpu_copy(tensor: torch.Tensor, float_dtype: torch.dtype | None = None) -> torch.Tensor:
    """A contiguous CPU copy that owns its memory (never aliases the model's parameter or a caller's tensor);
    floating tensors cast to `float_dtype` when given (round to nearest even, as vLLM's loading does)."""
    dtype = float_dtype if float_dtype is not None and tensor.is_floating_point() else tensor.dtype
    copy = torch.empty(tuple(tensor.shape), dtype=dtype, device="cpu")
    copy.copy_(tensor.detach())
    return copy


def _bit_view(tensor: torch.Tensor) -> torch.Tensor | None:
    """The flat tensor as same-size integers, or None for element sizes with no integer dtype (e.g. complex128)."""
    int_dtype = _BIT_VIEW_DTYPES.get(tensor.element_size())
    return None if int_dtype is None else tensor.reshape(-1).view(int_dtype)


def _changed_positions(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor | None:
    """Flat positions whose bit patterns differ between two same-shape, same-dtype tensors; None if unknowable."""
    old_bits, new_bits = _bit_view(old), _bit_view(new)
    if old_bits is None or new_bits is None:
        return None
    positions = (old_bits != new_bits).nonzero().reshape(-1)
    # int32 halves the index bytes and covers every position of a tensor below 2**31 elements.
    return positions.to(torch.int32) if new.numel() <= _INT32_MAX else positions


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape and dtype: the only case where an element-wise delta means anything."""
    return a.shape == b.shape and a.dtype == b.dtype


def _metric(name: str) -> str:
    return METRIC_PREFIX + name


# ---------------------------------------------------------------------------------------------- sender


@dataclass
class _SyncTally:
    """Running totals of one encode, turned into its metrics."""

    bytes_sent: int = 0
    index_bytes: int = 0
    bytes_full: int = 0
    elements: int = 0
    changed: int = 0
    params: int = 0
    params_full: int = 0


class WeightDeltaSender:
    """Trainer side: encodes each sync as FULL or DELTA payloads against a CPU snapshot of the last sync.

    Memory: in delta mode the snapshot is one CPU copy of the model (in `float_dtype` when given); in full mode
    none is kept.
    """

    def __init__(self, config: WeightSyncConfig, checksum_algo: str | None = None,
                 float_dtype: torch.dtype | None = None) -> None:
        self.config = config
        """The sync policy."""
        self.float_dtype = float_dtype
        """The dtype floating weights are snapshotted, compared and sent in (None: as given)."""
        self.checksum_algo = checksum_algo or ("xxh3_64" if xxhash is not None else "crc32")
        """Checksum every header names; xxh3_64 when xxhash is installed (fast), else crc32."""
        if self.checksum_algo not in CHECKSUM_ALGOS:
            raise ValueError(f"checksum_algo must be one of {list(CHECKSUM_ALGOS)}, got {self.checksum_algo!r}")
        self._snapshot: dict[str, torch.Tensor] = {}
        self._seq = -1
        self._deltas_since_full = 0
        self._full_request: str | None = None

    @property
    def seq(self) -> int:
        """Sequence number of the last encoded sync (-1 before the first)."""
        return self._seq

    def request_full(self, reason: str) -> None:
        """Make the next sync a full one (the receiver reported a failed sync: its mirror is unknown)."""
        self._full_request = reason or "requested"

    def encode(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> EncodedSync:
        """Encode the current weights as the next sync and make them the new snapshot.

        Metrics (`beyond_agent/weight_sync/` + name): `seq`; `full` (1 = full sync, 0 = delta sync); `bytes_sent`
        (values + positions); `index_bytes` (positions alone); `bytes_full` (what a full sync would send);
        `sent_fraction` (bytes_sent / bytes_full); `changed_fraction` (elements whose bits changed since the
        last sync; 1.0 when there is no snapshot to compare with, e.g. in full mode); `params`; `params_full`
        (parameters sent whole); `encode_s` (seconds).
        """
        start = time.perf_counter()
        mode, reason = self._choose_mode()
        try:
            metas, payloads, snapshot, tally = self._encode_params(named_tensors, mode)
        except BaseException:
            # The old snapshot was consumed while encoding, so there is no diff base left: start over.
            self._snapshot, self._full_request = {}, "the previous encode failed"
            raise
        self._commit(mode, snapshot)
        header = SyncHeader(seq=self._seq, base_seq=None if mode is SyncMode.FULL else self._seq - 1, mode=mode,
                            reason=reason, checksum_algo=self.checksum_algo, params=tuple(metas))
        return EncodedSync(header=header, payloads=tuple(payloads),
                           metrics=self._metrics(mode, tally, time.perf_counter() - start))

    def _choose_mode(self) -> tuple[SyncMode, str]:
        """The sync-level mode and why."""
        if self.config.mode == "full":
            return SyncMode.FULL, "weight_sync.mode=full"
        # The receiver could not verify a sync (or our last encode failed): only a full sync restores a
        # state both sides know.
        if self._full_request is not None:
            return SyncMode.FULL, f"requested: {self._full_request}"
        # A delta needs a base both sides hold; before the first sync there is none.
        if not self._snapshot:
            return SyncMode.FULL, "first sync"
        # Periodic full syncs bound how long any divergence the checks could miss may be served.
        if self._deltas_since_full >= self.config.full_every - 1:
            return SyncMode.FULL, f"periodic (full_every={self.config.full_every})"
        return SyncMode.DELTA, "delta"

    def _encode_params(self, named_tensors, mode: SyncMode):
        """Encode every parameter; returns header metas, payloads, the new snapshot and the tally."""
        metas: list[ParamMeta] = []
        payloads: list[ParamPayload] = []
        snapshot: dict[str, torch.Tensor] = {}
        tally = _SyncTally()
        for name, tensor in named_tensors:
            # The receiver keys everything by name: a repeated name would make its checksum ambiguous.
            if name in snapshot:
                raise ValueError(f"parameter {name!r} appears twice in one sync")
            current = _cpu_copy(tensor, self.float_dtype)
            # Pop as we go so the old and new snapshots never both hold the whole model.
            payload, changed = self._encode_param(name, current, self._snapshot.pop(name, None), mode)
            metas.append(ParamMeta(name, tuple(current.shape), current.dtype,
                                   tensor_checksum(current, self.checksum_algo)))
            payloads.append(payload)
            if self.config.mode == "delta":  # full mode keeps no snapshot: nothing would ever read it
                snapshot[name] = current
            _tally_param(tally, current, payload, changed)
        return metas, payloads, snapshot, tally

    def _encode_param(self, name: str, current: torch.Tensor, old: torch.Tensor | None,
                      mode: SyncMode) -> tuple[ParamPayload, int]:
        """One parameter's payload and its number of changed elements."""
        full = ParamPayload(name, PayloadKind.FULL, current)
        # New, reshaped or re-typed parameter: there is no element-wise base to diff against.
        if old is None or not _same_layout(old, current):
            return full, current.numel()
        positions = _changed_positions(old, current)
        # No same-size integer view (e.g. complex128): changes cannot be found bitwise, so send it whole.
        if positions is None:
            return full, current.numel()
        if mode is SyncMode.FULL:
            return full, positions.numel()
        delta = ParamPayload(name, PayloadKind.DELTA, current.reshape(-1)[positions.long()], positions)
        # When so much changed that positions + values outweigh the tensor, the whole tensor is cheaper.
        if delta.nbytes >= full.nbytes:
            return full, positions.numel()
        return delta, positions.numel()

    def _commit(self, mode: SyncMode, snapshot: dict[str, torch.Tensor]) -> None:
        """Advance the sequence and adopt the new snapshot (parameters no longer sent are dropped)."""
        self._seq += 1
        self._snapshot = snapshot
        if mode is SyncMode.FULL:
            self._deltas_since_full, self._full_request = 0, None
        else:
            self._deltas_since_full += 1

    def _metrics(self, mode: SyncMode, tally: _SyncTally, seconds: float) -> dict[str, float]:
        return {
            _metric("seq"): float(self._seq),
            _metric("full"): 1.0 if mode is SyncMode.FULL else 0.0,
            _metric("bytes_sent"): float(tally.bytes_sent),
            _metric("index_bytes"): float(tally.index_bytes),
            _metric("bytes_full"): float(tally.bytes_full),
            _metric("sent_fraction"): tally.bytes_sent / tally.bytes_full if tally.bytes_full else 0.0,
            _metric("changed_fraction"): tally.changed / tally.elements if tally.elements else 0.0,
            _metric("params"): float(tally.params),
            _metric("params_full"): float(tally.params_full),
            _metric("encode_s"): seconds,
        }


def _tally_param(tally: _SyncTally, current: torch.Tensor, payload: ParamPayload, changed: int) -> None:
    """Add one parameter to the sync's totals."""
    tally.bytes_sent += payload.nbytes
    tally.index_bytes += 0 if payload.positions is None else payload.positions.nbytes
    tally.bytes_full += current.nbytes
    tally.elements += current.numel()
    tally.changed += changed
    tally.params += 1
    tally.params_full += payload.kind is PayloadKind.FULL


# ---------------------------------------------------------------------------------------------- receiver


class WeightDeltaReceiver:
    """Inference side: keeps a mirror of the weights, applies syncs and returns them only once verified.

    Enum fields are compared with ==, so a transport may rebuild them from their string values.

    A failed sync may leave the mirror half-updated; that is safe because nothing is returned from it and
    every later sync is refused until a full one rewrites every parameter.
    """

    def __init__(self) -> None:
        self._mirror: dict[str, torch.Tensor] = {}
        self._seq: int | None = None
        self._needs_full = True
        self._why_full = "no sync applied yet"
        self._writing = False  # buffer_for handed out a mirror tensor for a sync not yet applied
        self.last_metrics: dict[str, float] = {}
        """`beyond_agent/weight_sync/apply_s` and `beyond_agent/weight_sync/applied_seq` of the last successful apply."""

    @property
    def seq(self) -> int | None:
        """Sequence number of the last applied sync (None before the first)."""
        return self._seq

    @property
    def needs_full(self) -> bool:
        """True until a full sync has been applied, and again after any failed sync."""
        return self._needs_full

    def check(self, header: SyncHeader) -> None:
        """Refuse a sync before any of it is written (stale, out of order, a delta without a verified base);
        a refusal is a failed sync. Call it first when a sync is written into the mirror as it arrives."""
        if self._writing:  # an earlier sync was cut off half-written: its mirror is unknown
            self._fail(PayloadError("an earlier sync was cut off while being written into the mirror"))
        try:
            self._check_header(header)
        except WeightSyncError as err:
            self._fail(err)
            raise

    def check_failed(self, err: WeightSyncError) -> None:
        """A sync failed outside `apply` (on the wire, after parts were written into the mirror): only a full
        sync is accepted from now on."""
        self._fail(err)

    def buffer_for(self, meta: ParamMeta) -> torch.Tensor:
        """The mirror's tensor for a parameter, to write a FULL payload into as it arrives (reused when its
        shape and dtype match, else replaced): a full sync then needs no second copy of the model. Until the
        sync is applied and verified the mirror counts as unknown."""
        self._writing = True
        held = self._mirror.get(meta.name)
        if held is None or tuple(held.shape) != meta.shape or held.dtype != meta.dtype:
            held = torch.empty(meta.shape, dtype=meta.dtype)
            self._mirror[meta.name] = held
        return held

    def apply(self, header: SyncHeader, payloads: Iterable[ParamPayload]) -> list[tuple[str, torch.Tensor]]:
        """Apply one sync; return every parameter as (name, tensor) in header order, or raise WeightSyncError.

        The returned tensors are the receiver's mirror: read them (e.g. `model.load_weights(...)` copies
        them) before the next `apply`, and do not modify them.
        """
        start = time.perf_counter()
        try:
            self._check_header(header)
            by_name = _payloads_by_name(header, payloads)
            for meta in header.params:
                self._apply_param(header, meta, by_name[meta.name])
        except WeightSyncError as err:
            self._fail(err)
            raise
        except Exception as err:  # e.g. torch rejecting a malformed tensor: still a failed sync
            wrapped = PayloadError(f"sync {header.seq}: cannot apply payload: {err}")
            self._fail(wrapped)
            raise wrapped from err
        self._commit(header, time.perf_counter() - start)
        return [(meta.name, self._mirror[meta.name]) for meta in header.params]

    def _check_header(self, header: SyncHeader) -> None:
        """Refuse a sync that cannot be applied to what the mirror holds, before touching it."""
        if header.checksum_algo not in CHECKSUM_ALGOS:
            raise PayloadError(f"sync {header.seq}: unknown checksum {header.checksum_algo!r}")
        # A replayed or late sync would silently roll the weights back to an older version.
        if self._seq is not None and header.seq <= self._seq:
            raise StaleSyncError(f"sync {header.seq} is not newer than the applied sync {self._seq}")
        if header.mode == SyncMode.FULL:
            return
        # A delta on top of a mirror that is empty or failed verification would serve wrong weights.
        if self._needs_full:
            raise FullSyncRequiredError(f"delta sync {header.seq} refused: waiting for a full sync "
                                        f"({self._why_full})")
        # The delta only makes sense on the exact sync it was computed against.
        if header.base_seq != self._seq or header.seq != header.base_seq + 1:
            raise SequenceGapError(f"delta sync {header.seq} is based on sync {header.base_seq}, but the "
                                   f"receiver holds sync {self._seq}: a sync was missed or arrived out of order")

    def _apply_param(self, header: SyncHeader, meta: ParamMeta, payload: ParamPayload) -> None:
        """Write one parameter into the mirror and verify the result against the header's checksum."""
        if payload.kind == PayloadKind.FULL:
            self._apply_full(header, meta, payload)
        elif header.mode == SyncMode.FULL:
            # A full sync must rewrite every parameter, or a failed earlier sync could leak through.
            raise PayloadError(f"full sync {header.seq} carries a delta for {meta.name!r}")
        else:
            self._apply_delta(header, meta, payload)
        if tensor_checksum(self._mirror[meta.name], header.checksum_algo) != meta.checksum:
            raise ChecksumMismatchError(f"sync {header.seq}: {meta.name!r} does not match the sender's checksum")

    def _apply_full(self, header: SyncHeader, meta: ParamMeta, payload: ParamPayload) -> None:
        values = payload.values
        if tuple(values.shape) != meta.shape or values.dtype != meta.dtype:
            raise PayloadError(f"sync {header.seq}: {meta.name!r} is {values.dtype}{tuple(values.shape)}, "
                               f"the header says {meta.dtype}{meta.shape}")
        held = self._mirror.get(meta.name)
        if held is not None and _same_layout(held, values):
            if held.data_ptr() != values.data_ptr():  # else written in place as it arrived (buffer_for)
                held.copy_(values)  # reuse the buffer: no second copy of the model during a full sync
        else:
            self._mirror[meta.name] = _cpu_copy(values)  # own copy: never alias the sender or the transport

    def _apply_delta(self, header: SyncHeader, meta: ParamMeta, payload: ParamPayload) -> None:
        held = self._mirror.get(meta.name)
        if held is None or tuple(held.shape) != meta.shape or held.dtype != meta.dtype:
            raise PayloadError(f"delta sync {header.seq}: no {meta.dtype}{meta.shape} base for {meta.name!r}")
        positions, values = payload.positions, payload.values
        _check_delta_arrays(header.seq, meta, positions, values, held.numel())
        held.reshape(-1)[positions.long()] = values

    def _commit(self, header: SyncHeader, seconds: float) -> None:
        """Adopt the sync: advance the sequence and drop parameters the sender no longer sends."""
        names = {meta.name for meta in header.params}
        for name in [n for n in self._mirror if n not in names]:
            del self._mirror[name]
        self._seq, self._needs_full, self._why_full, self._writing = header.seq, False, "", False
        self.last_metrics = {_metric("apply_s"): seconds, _metric("applied_seq"): float(header.seq)}

    def _fail(self, err: WeightSyncError) -> None:
        """After any failure only a full sync is accepted: the mirror may be half-updated."""
        self._needs_full, self._why_full, self._writing = True, str(err), False


def _check_delta_arrays(seq: int, meta: ParamMeta, positions: torch.Tensor | None, values: torch.Tensor,
                        numel: int) -> None:
    """Refuse delta arrays that cannot be applied (their content is checked by the checksum afterwards)."""
    if positions is None or positions.dtype not in (torch.int32, torch.int64) or positions.dim() != 1:
        raise PayloadError(f"delta sync {seq}: {meta.name!r} needs 1-D int32/int64 positions")
    if values.dim() != 1 or values.dtype != meta.dtype or values.numel() != positions.numel():
        raise PayloadError(f"delta sync {seq}: {meta.name!r} needs {positions.numel()} {meta.dtype} values, "
                           f"got {values.dtype}{tuple(values.shape)}")
    # Out-of-range positions would raise deep in torch (or wrap around when negative): name the cause.
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= numel):
        raise PayloadError(f"delta sync {seq}: {meta.name!r} has positions outside [0, {numel})")


def _payloads_by_name(header: SyncHeader, payloads: Iterable[ParamPayload]) -> dict[str, ParamPayload]:
    """Payloads keyed by name; the set must match the header's parameters exactly."""
    by_name: dict[str, ParamPayload] = {}
    for payload in payloads:
        if payload.name in by_name:
            raise PayloadError(f"sync {header.seq}: two payloads for {payload.name!r}")
        by_name[payload.name] = payload
    expected = {meta.name for meta in header.params}
    missing, extra = sorted(expected - set(by_name)), sorted(set(by_name) - expected)
    if missing or extra:
        raise PayloadError(f"sync {header.seq}: payloads missing for {missing[:5]}, unexpected {extra[:5]}")
    return by_name
