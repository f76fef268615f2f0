"""The delta weight-sync codec on a real model: the tiny Qwen2 trained with AdamW on CPU, synced after each step.

What must hold: after every sync the weights the receiver hands to the engine equal the trainer's bitwise;
delta syncs send fewer bytes than full ones; a corrupted, dropped, reordered or replayed sync is detected,
nothing from it reaches the engine, and the full sync the receiver asks for heals it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from beyond_agent.sections import from_section
from beyond_agent.weights import (
    ChecksumMismatchError,
    FullSyncRequiredError,
    PayloadError,
    PayloadKind,
    SequenceGapError,
    StaleSyncError,
    SyncMode,
    WeightDeltaReceiver,
    WeightDeltaSender,
    WeightSyncConfig,
    WeightSyncError,
)

# Learning rates small enough that one AdamW step moves only some elements by at least half an ulp,
# so a step changes a real, partial share of the bits (as in RL fine-tuning of a large model).
LEARNING_RATES = {torch.float32: 3e-10, torch.bfloat16: 1e-5}
DTYPES = [pytest.param(torch.float32, id="float32"), pytest.param(torch.bfloat16, id="bfloat16")]


class TinyTrainer:
    """The tiny Qwen2 under AdamW on random token batches (a real loss, backward and optimiser step)."""

    def __init__(self, model_dir: Path, dtype: torch.dtype, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=LEARNING_RATES[dtype], weight_decay=0.0)
        self.generator = torch.Generator().manual_seed(seed)

    def step(self) -> None:
        ids = torch.randint(0, self.model.config.vocab_size, (2, 16), generator=self.generator)
        self.model(input_ids=ids, labels=ids).loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.model.state_dict().items())


class FakeEngine:
    """Stands in for the inference engine: `load_weights` copies what it is given, like vLLM's does."""

    def __init__(self) -> None:
        self.weights: dict[str, torch.Tensor] = {}

    def load_weights(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        self.weights = {name: tensor.clone() for name, tensor in pairs}


INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The flat tensor's bit patterns (a view: writing to it writes the tensor)."""
    return tensor.reshape(-1).view(INT_OF_SIZE[tensor.element_size()])


def codec(mode: str, full_every: int = 10) -> tuple[WeightDeltaSender, WeightDeltaReceiver, "FakeEngine"]:
    return WeightDeltaSender(WeightSyncConfig(mode, full_every)), WeightDeltaReceiver(), FakeEngine()


def assert_bitwise_equal(served: dict[str, torch.Tensor], expected: list[tuple[str, torch.Tensor]]) -> None:
    assert list(served) == [name for name, _ in expected]
    for name, tensor in expected:
        assert served[name].dtype == tensor.dtype and served[name].shape == tensor.shape, name
        assert torch.equal(served[name], tensor), name
        assert torch.equal(bits(served[name]), bits(tensor)), name


def sync_and_load(sender: WeightDeltaSender, receiver: WeightDeltaReceiver, engine: FakeEngine,
                  trainer: TinyTrainer):
    """One sync along the happy path; returns the encoded sync."""
    sync = sender.encode(trainer.weights())
    engine.load_weights(receiver.apply(sync.header, sync.payloads))
    assert_bitwise_equal(engine.weights, trainer.weights())
    return sync


@pytest.mark.parametrize("dtype", DTYPES)
def test_delta_syncs_follow_training_bitwise(tiny_model_dir: Path, dtype: torch.dtype) -> None:
    trainer = TinyTrainer(tiny_model_dir, dtype)
    sender, receiver, engine = codec("delta", full_every=5)
    syncs = [sync_and_load(sender, receiver, engine, trainer)]
    for _ in range(24):
        trainer.step()
        syncs.append(sync_and_load(sender, receiver, engine, trainer))

    # The first sync and every 5th after it are full; the rest are deltas on the sync before them.
    assert [s.header.mode for s in syncs] == [SyncMode.FULL if i % 5 == 0 else SyncMode.DELTA for i in range(25)]
    assert syncs[0].header.reason == "first sync" and syncs[5].header.reason.startswith("periodic")
    assert all(s.header.base_seq == s.header.seq - 1 for s in syncs if s.header.mode is SyncMode.DELTA)
    assert all(key.startswith("beyond_agent/weight_sync/") for s in syncs for key in s.metrics)
    assert set(receiver.last_metrics) == {"beyond_agent/weight_sync/apply_s", "beyond_agent/weight_sync/applied_seq"}

    fulls = [s.metrics for s in syncs if s.header.mode is SyncMode.FULL]
    deltas = [s.metrics for s in syncs if s.header.mode is SyncMode.DELTA]
    full_bytes = fulls[0]["beyond_agent/weight_sync/bytes_full"]
    assert all(m["beyond_agent/weight_sync/bytes_sent"] == full_bytes for m in fulls)
    # Training changed a real but partial share of the elements, and every delta sync was smaller.
    assert all(0.0 < m["beyond_agent/weight_sync/changed_fraction"] < 1.0 for m in deltas)
    assert all(m["beyond_agent/weight_sync/bytes_sent"] < m["beyond_agent/weight_sync/bytes_full"] == full_bytes for m in deltas)
    delta_bytes = [int(m["beyond_agent/weight_sync/bytes_sent"]) for m in deltas]
    mean_delta = sum(delta_bytes) / len(delta_bytes)
    print(f"\n[{dtype}] full sync: {int(full_bytes)} B; delta syncs ({len(deltas)}): mean {mean_delta:.0f} B "
          f"({mean_delta / full_bytes:.1%} of full), min {min(delta_bytes)} B, max {max(delta_bytes)} B; "
          f"changed elements per step {min(m['beyond_agent/weight_sync/changed_fraction'] for m in deltas):.1%}"
          f"-{max(m['beyond_agent/weight_sync/changed_fraction'] for m in deltas):.1%}; "
          f"index bytes {int(sum(m['beyond_agent/weight_sync/index_bytes'] for m in deltas) / len(deltas))} B/sync")


def _flip_value(sync):
    """Flip the lowest bit of one changed value (a corrupted delta payload)."""
    index, payload = next((i, p) for i, p in enumerate(sync.payloads)
                          if p.kind is PayloadKind.DELTA and p.positions.numel())
    values = payload.values.clone()
    bits(values)[0] ^= 1
    return _replace_payload(sync, index, dataclasses.replace(payload, values=values))


def _shift_index(sync, out_of_range: bool = False):
    """Point one changed value at another element (in range: only the checksum can tell) or past the end."""
    index, payload = next((i, p) for i, p in enumerate(sync.payloads)
                          if p.kind is PayloadKind.DELTA and p.positions.numel())
    numel = torch.Size(next(m.shape for m in sync.header.params if m.name == payload.name)).numel()
    positions = payload.positions.clone()
    positions[0] = numel if out_of_range else (int(positions[0]) + 1) % numel
    return _replace_payload(sync, index, dataclasses.replace(payload, positions=positions))


def _replace_payload(sync, index, payload):
    payloads = list(sync.payloads)
    payloads[index] = payload
    return sync.header, payloads


# scenario -> the error the receiver raises on the (last) faulty delivery
SCENARIOS = {
    "corrupted_value": ChecksumMismatchError,
    "corrupted_index": ChecksumMismatchError,
    "index_out_of_range": PayloadError,
    "missing_payload": PayloadError,
    "dropped_delta": SequenceGapError,
    "reordered_deltas": FullSyncRequiredError,
    "replayed_delta": StaleSyncError,
}


def _deliver_bad(scenario: str, trainer: TinyTrainer, sender: WeightDeltaSender, receiver: WeightDeltaReceiver,
                 last_ok) -> list[WeightSyncError]:
    """Encode (after a training step) and deliver a faulty sync; returns the errors each delivery raised."""
    trainer.step()
    sync = sender.encode(trainer.weights())
    assert sync.header.mode is SyncMode.DELTA
    deliveries = {
        "corrupted_value": lambda: [_flip_value(sync)],
        "corrupted_index": lambda: [_shift_index(sync)],
        "index_out_of_range": lambda: [_shift_index(sync, out_of_range=True)],
        "missing_payload": lambda: [(sync.header, sync.payloads[1:])],
        "replayed_delta": lambda: [(last_ok.header, last_ok.payloads)],
    }
    if scenario == "dropped_delta":  # `sync` is lost on the way; the next delta arrives
        trainer.step()
        later = sender.encode(trainer.weights())
        messages = [(later.header, later.payloads)]
    elif scenario == "reordered_deltas":  # the later delta overtakes `sync`, which then arrives too
        trainer.step()
        later = sender.encode(trainer.weights())
        messages = [(later.header, later.payloads), (sync.header, sync.payloads)]
    else:
        messages = deliveries[scenario]()
    errors = []
    for header, payloads in messages:
        with pytest.raises(WeightSyncError) as caught:
            receiver.apply(header, payloads)
        errors.append(caught.value)
        assert receiver.needs_full
    return errors


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_faulty_delta_is_detected_and_healed_by_a_full_sync(tiny_model_dir: Path, dtype: torch.dtype,
                                                            scenario: str) -> None:
    trainer = TinyTrainer(tiny_model_dir, dtype)
    sender, receiver, engine = codec("delta", full_every=50)
    last_ok = sync_and_load(sender, receiver, engine, trainer)
    for _ in range(3):
        trainer.step()
        last_ok = sync_and_load(sender, receiver, engine, trainer)
    assert last_ok.header.mode is SyncMode.DELTA
    served_before = [(name, tensor.clone()) for name, tensor in trainer.weights()]

    errors = _deliver_bad(scenario, trainer, sender, receiver, last_ok)

    # Detected with the specific error, and the engine still serves the last verified weights.
    assert isinstance(errors[-1], SCENARIOS[scenario]), errors
    if scenario == "reordered_deltas":
        assert isinstance(errors[0], SequenceGapError)
    assert_bitwise_equal(engine.weights, served_before)
    # A delta is refused until the full sync arrives, even a well-formed one.
    trainer.step()
    refused = sender.encode(trainer.weights())
    with pytest.raises(FullSyncRequiredError):
        receiver.apply(refused.header, refused.payloads)

    # The caller forwards the failure; the next sync is full and heals the mirror bitwise.
    sender.request_full(str(errors[-1]))
    trainer.step()
    heal = sync_and_load(sender, receiver, engine, trainer)
    assert heal.header.mode is SyncMode.FULL and heal.header.reason.startswith("requested:")
    assert not receiver.needs_full
    # And the delta chain resumes on top of it.
    trainer.step()
    assert sync_and_load(sender, receiver, engine, trainer).header.mode is SyncMode.DELTA


def test_full_mode_always_sends_everything(tiny_model_dir: Path) -> None:
    trainer = TinyTrainer(tiny_model_dir, torch.bfloat16)
    sender, receiver, engine = codec("full")
    for _ in range(6):
        sync = sync_and_load(sender, receiver, engine, trainer)
        assert sync.header.mode is SyncMode.FULL and sync.header.base_seq is None
        assert all(p.kind is PayloadKind.FULL and p.positions is None for p in sync.payloads)
        assert sync.metrics["beyond_agent/weight_sync/bytes_sent"] == sync.metrics["beyond_agent/weight_sync/bytes_full"] > 0
        assert sync.metrics["beyond_agent/weight_sync/full"] == 1.0
        trainer.step()


def test_bit_changes_that_compare_equal_are_sent() -> None:
    """0.0 -> -0.0 compares equal and NaN -> NaN compares unequal; the codec looks at bits only."""
    before = torch.zeros(64)
    before[1] = float("nan")
    after = before.clone()
    after[0] = -0.0
    bits(after)[1] = bits(after)[1] | 1  # another NaN payload
    after[5] = 2.0
    sender, receiver = WeightDeltaSender(WeightSyncConfig("delta", full_every=10)), WeightDeltaReceiver()
    first = sender.encode([("w", before)])
    receiver.apply(first.header, first.payloads)
    second = sender.encode([("w", after)])
    (payload,) = second.payloads
    assert payload.kind is PayloadKind.DELTA and payload.positions.tolist() == [0, 1, 5]
    assert payload.positions.dtype == torch.int32
    ((_, served),) = receiver.apply(second.header, second.payloads)
    assert torch.equal(bits(served), bits(after))


def test_layout_changes_and_dense_changes_go_whole_within_a_delta_sync() -> None:
    weights = {"same": torch.arange(100, dtype=torch.float32), "dense": torch.zeros(100),
               "reshaped": torch.zeros(10, 10), "retyped": torch.zeros(100), "removed": torch.ones(3)}
    sender, receiver = WeightDeltaSender(WeightSyncConfig("delta", full_every=10)), WeightDeltaReceiver()
    first = sender.encode(weights.items())
    receiver.apply(first.header, first.payloads)

    weights["same"] = weights["same"].clone()
    weights["same"][7] = -1.0
    weights["dense"] = torch.ones(100)  # every element changed: positions + values would be twice the tensor
    weights["reshaped"] = torch.zeros(20, 5)
    weights["retyped"] = torch.zeros(100, dtype=torch.bfloat16)
    weights["new"] = torch.full((4,), 3.0)
    del weights["removed"]
    second = sender.encode(weights.items())
    kinds = {p.name: p.kind for p in second.payloads}
    assert second.header.mode is SyncMode.DELTA
    assert kinds == {"same": PayloadKind.DELTA, "dense": PayloadKind.FULL, "reshaped": PayloadKind.FULL,
                     "retyped": PayloadKind.FULL, "new": PayloadKind.FULL}
    served = dict(receiver.apply(second.header, second.payloads))
    assert_bitwise_equal(served, list(weights.items()))
    assert second.metrics["beyond_agent/weight_sync/params_full"] == 4


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"mode": "sparse"}, "beyond_agent.weight_sync.mode must be one of ['full', 'delta'], got 'sparse'"),
        ({"mode": "delta", "full_every": 0}, "weight_sync.full_every must be an integer >= 1"),
        ({"mode": "delta", "full_every": True}, "weight_sync.full_every must be an integer >= 1"),
        ({"mode": "delta", "full_every": "10"}, "weight_sync.full_every must be an integer >= 1"),
        ({"mode": "delta", "every": 3},
         "beyond_agent.weight_sync has unknown key(s) ['every']; valid keys: mode, full_every"),
    ],
)
def test_bad_config_names_the_field(section: dict, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        from_section(WeightSyncConfig, section, "beyond_agent.weight_sync")
    assert message in str(caught.value)


def test_config_defaults() -> None:
    assert from_section(WeightSyncConfig, None, "beyond_agent.weight_sync") == WeightSyncConfig("full", 10)
    assert from_section(WeightSyncConfig, {"mode": "delta"}, "beyond_agent.weight_sync").full_every == 10
    assert from_section(WeightSyncConfig, {"full_every": 3}, "beyond_agent.weight_sync") == WeightSyncConfig("full", 3)
