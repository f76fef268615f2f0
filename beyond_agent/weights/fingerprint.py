"""A cheap fingerprint of model weights, computed alike on the trainer's side and inside the vLLM worker.

After every weight sync the `served_weights` integrity monitor compares the served model with the trained one: a sync
that did not apply, an adapter not loaded (rollouts on the base model), weights of another step. Both sides reduce
their tensors to the same few float64 sums, so nothing the size of the model crosses a process:

- `total` (sum of the elements), `squares` (sum of their squares) and `magnitude` (sum of their absolute values),
  each in float64 over the values as the rollout holds them (the trainer casts each tensor to the rollout's dtype
  first: what a sync sends is what vLLM stores, rounded the same way);
- sums do not care how the tensors are named, ordered, fused (vLLM's `qkv_proj` is q, k and v stacked), sharded
  (FSDP's local shards add up) or padded with zeros (vLLM pads the vocabulary rows with zeros); the element count
  is reported, not compared, for that last reason.

A LoRA adapter is fingerprinted as what it changes, `scaling x lora_B @ lora_A` per target module, since vLLM keeps
its own packing of the adapter's tensors (`vllm_extension.active_adapter_changes` on the served side: the adapter's
slot of each layer's stacked buffers, what requests use).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Fingerprint:
    """Sums over every element of a set of tensors (see the module's docstring)."""

    total: float = 0.0
    squares: float = 0.0
    magnitude: float = 0.0
    elements: int = 0

    def __add__(self, other: Fingerprint) -> Fingerprint:
        return Fingerprint(self.total + other.total, self.squares + other.squares, self.magnitude + other.magnitude,
                           self.elements + other.elements)

    def as_dict(self) -> dict:
        return asdict(self)

    def differs_from(self, other: Fingerprint, rtol: float) -> bool:
        """Whether the two sets of values differ beyond `rtol` of their size: `squares` against the larger of the two
        sums of squares, `total` against the larger sum of magnitudes (float64 sums in another order differ by
        ~1e-15 of them)."""
        scale = max(self.squares, other.squares)
        spread = max(self.magnitude, other.magnitude)
        return (abs(self.squares - other.squares) > rtol * scale or abs(self.total - other.total) > rtol * spread
                or not all(math.isfinite(value) for value in (self.total, other.total, self.squares, other.squares)))

    def __str__(self) -> str:
        return f"sum {self.total:.9g}, sum of squares {self.squares:.9g} over {self.elements} elements"


CHUNK_ELEMENTS = 1 << 24
"""Elements summed at a time: a float64 copy of 16 Mi elements is 128 MiB (a 7B model's embedding whole would be
4 GiB beside vLLM's own memory)."""


def tensor_fingerprint(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> Fingerprint:
    """One tensor's sums, over its values cast to `dtype` first (None: as they are), a chunk at a time."""
    flat = tensor.detach().reshape(-1)
    total = squares = magnitude = 0.0
    for start in range(0, flat.numel(), CHUNK_ELEMENTS):
        values = flat[start:start + CHUNK_ELEMENTS]
        if dtype is not None and values.dtype != dtype:
            values = values.to(dtype)
        values = values.double()
        total += values.sum().item()
        squares += values.square().sum().item()
        magnitude += values.abs().sum().item()
    return Fingerprint(total, squares, magnitude, flat.numel())


def tensors_fingerprint(tensors: Iterable[torch.Tensor], dtype: torch.dtype | None = None) -> Fingerprint:
    """The sums over every element of every tensor (one tensor in float64 at a time)."""
    fingerprint = Fingerprint()
    for tensor in tensors:
        fingerprint += tensor_fingerprint(tensor, dtype)
    return fingerprint


ADAPTER_RTOL = 1e-5
"""How far an adapter's fingerprints may be apart: each side multiplies lora_B by lora_A itself (float32 products in
another order, ~1e-7 of the values)."""
WEIGHTS_RTOL = 1e-9
"""How far the full weights' fingerprints may be apart: the same values summed in another order (float64)."""


# ----- the trainer's side: run on each actor worker (Ray's `__ray_call__`) -------------------------------------------

def actor_training_worker(worker) -> Any:
    """The actor's training worker (verl's TrainingWorker) inside a verl worker actor: the worker's own `actor`, or
    that of the actor role of verl's colocated worker (`worker_dict`)."""
    candidates = [worker, *getattr(worker, "worker_dict", {}).values()]
    for candidate in candidates:
        actor = getattr(candidate, "actor", None)
        if isinstance(getattr(getattr(actor, "engine", None), "module", None), torch.nn.Module):
            return actor
    raise RuntimeError(f"no actor training module (worker.actor.engine.module) on {type(worker).__name__}")


def training_module(worker) -> torch.nn.Module:
    """The actor's training module inside a verl worker actor (`actor_training_worker`)."""
    return actor_training_worker(worker).engine.module


def _first_rank() -> bool:
    """Whether this process is rank 0 (or runs alone)."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _owned_local_values(parameter: torch.Tensor) -> torch.Tensor | None:
    """This rank's share of a parameter, so that the ranks' sums add up to the whole: an FSDP shard; None for a copy
    another rank counts (a replicated DTensor dimension off coordinate 0, a plain tensor off rank 0)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(parameter, DTensor):
        coordinate = parameter.device_mesh.get_coordinate()
        if coordinate is None:
            return None
        if any(isinstance(placement, Replicate) and coordinate[dim] != 0
               for dim, placement in enumerate(parameter.placements)):
            return None
        return parameter.to_local()
    return parameter if _first_rank() else None


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def lora_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """PEFT's LoRA layers of the module (each with `lora_A`/`lora_B`/`scaling` of the `default` adapter)."""
    return [layer for layer in module.modules()
            if isinstance(getattr(layer, "lora_A", None), torch.nn.ModuleDict) and "default" in layer.lora_A]


def adapter_change(layer: torch.nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """What a LoRA layer adds to its weight, as vLLM serves it: lora_A and lora_B in the served dtype, the scaling
    folded into lora_B in that dtype (vLLM's `optimize()`), their product in float32."""
    lora_a = _full(layer.lora_A["default"].weight.detach()).to(dtype)
    lora_b = _full(layer.lora_B["default"].weight.detach()).to(dtype) * layer.scaling["default"]
    return lora_b.float() @ lora_a.float()


def trainer_part(worker, served_dtype: str) -> dict:
    """This actor rank's part of the trained model's fingerprints: {"weights": its share of the base weights,
    "adapter": the whole adapter's change (every rank computes it, rank 0 reports it), or None without LoRA and on
    the other ranks}."""
    from verl.utils.torch_dtypes import PrecisionType

    dtype = PrecisionType.to_dtype(served_dtype)
    module = training_module(worker)
    base = [values for name, parameter in module.named_parameters()
            if "lora_" not in name and (values := _owned_local_values(parameter)) is not None]
    layers = lora_layers(module)
    adapter = tensors_fingerprint(adapter_change(layer, dtype) for layer in layers) if layers else None
    return {"weights": tensors_fingerprint(base, dtype).as_dict(),
            "adapter": adapter.as_dict() if adapter is not None and _first_rank() else None}


def trained_fingerprints(parts: list[dict]) -> dict:
    """The ranks' parts (`trainer_part`) as the whole model's {"weights", "adapter"} fingerprints (as dicts)."""
    weights = sum((Fingerprint(**part["weights"]) for part in parts), Fingerprint())
    adapters = [part["adapter"] for part in parts if part["adapter"] is not None]  # rank 0's, with LoRA
    return {"weights": weights.as_dict(), "adapter": adapters[0] if adapters else None}


# ----- the served side: inside each vLLM worker (our worker extension) -----------------------------------------------

SERVED_DIFFER_MARKER = "served weights differ from the trained ones"
"""Starts the error a vLLM worker raises when its fingerprint is not the trainer's (the driver looks for it)."""


def compare(expected: dict, served: dict) -> list[str]:
    """What differs between the trained (`expected`) and the served fingerprints, in words; [] when they match."""
    problems = []
    trained_weights, served_weights = Fingerprint(**expected["weights"]), Fingerprint(**served["weights"])
    if trained_weights.differs_from(served_weights, WEIGHTS_RTOL):
        problems.append(f"base weights: trained {trained_weights}; served {served_weights}")
    if expected.get("adapter") is not None:
        trained_adapter = Fingerprint(**expected["adapter"])
        if served.get("adapter") is None:
            problems.append(f"LoRA adapter: trained {trained_adapter}; none is loaded (requests see the base model)")
        elif trained_adapter.differs_from(served_adapter := Fingerprint(**served["adapter"]), ADAPTER_RTOL):
            problems.append(f"LoRA adapter: trained {trained_adapter}; served {served_adapter}")
    return problems


# ----- the driver: both sides asked, the answers compared ------------------------------------------------------------

def served_mismatch(actor_workers: list, servers: list, served_dtype: str, sync: str) -> str | None:
    """What differs between the trained model (the actor workers' parts, through Ray's `__ray_call__`) and what each
    vLLM server's workers serve (verl's server `collective_rpc` of our extension's `beyond_check_served`, which raises
    on a difference); None when every worker serves the trained model. Any other error is raised."""
    import ray

    parts = ray.get([worker.__ray_call__.remote(trainer_part, served_dtype) for worker in actor_workers])
    expected = trained_fingerprints(parts)
    checks = [server.collective_rpc.remote("beyond_check_served", args=(expected, sync)) for server in servers]
    problems = []
    for check in checks:
        try:
            ray.get(check)
        except Exception as error:  # noqa: BLE001 - ours is told apart by its marker; anything else is raised
            text = str(error)
            if SERVED_DIFFER_MARKER not in text:
                raise
            problems.append(text[text.index(SERVED_DIFFER_MARKER):].split("', please check")[0].splitlines()[0])
    return "; ".join(dict.fromkeys(problems)) or None
