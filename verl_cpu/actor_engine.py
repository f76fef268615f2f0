"""The actor's engine on CPU: verl's FSDP language-model engine without the garbage-collector pass it makes each
time the actor changes mode although nothing moves.

Why: verl 0.9's engine context (``BaseEngineCtx._context_switch``) returns early only when the target device is
not named ``"cpu"`` and nothing is offloaded; on our platform the device *is* named ``"cpu"``, so every switch to
train or eval mode calls ``FSDPEngine.to("cpu", model=False, optimizer=False)``, which takes verl's "load back to
the device" branch and ends it with ``gc.collect()``. Nothing was offloaded, so nothing loads: the pass is all it
does, over the trainer worker's ~880 000 objects, 0.45-0.7 s each, four times a training step (timed on the
2-core CPU machine, 2026-11-28: about 2 s of a 6-9 s step; docs/benchmarks.md, "Where a weight sync's seconds
go"). GPU runs never reach that branch without something to move.

How: :class:`NoIdleCollect` skips ``to`` when it is asked to move neither the model nor the optimizer (verl's own
argument check still runs); any call that moves something is verl's. :class:`CPULanguageModelEngine` is verl's
``FSDPEngineWithLMHead`` with it, registered like the critic's engine (``value_engine.py``) for this platform's
vendor only, so a run without ``VERL_PLATFORM=cpu`` keeps verl's engine.

The same engine builds the reference model (a KL loss, `actor.use_kl_loss`), which verl's FSDP2 wrap gives
``CPUOffloadPolicy(pin_memory=True)``: pinning needs an accelerator, so on CPU the reference model's start failed
with "Cannot access accelerator device when none is available". :class:`UnpinnedReference` builds it with the same
policy unpinned (its weights are in CPU memory either way).
"""

from __future__ import annotations

from typing import Any

from verl.workers.engine.base import BaseEngine, EngineRegistry
from verl.workers.engine.fsdp import transformer_impl
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

from verl_cpu.platform import PLATFORM_NAME

LANGUAGE_MODEL = "language_model"
FSDP_BACKENDS = ["fsdp", "fsdp2"]
# The devices verl's engine lookup may see on our platform: "cuda" when VERL_ENGINE_DEVICE=cuda (as
# verl_cpu.overrides.CPU_ENV sets), else the platform's own "cpu".
ENGINE_DEVICES = ["cuda", PLATFORM_NAME]


class NoIdleCollect:
    """Mixin for verl's FSDP engines on CPU: a ``to`` that moves nothing does nothing (module docstring)."""

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True):
        if not model and not optimizer:
            return BaseEngine.to(self, device, model=model, optimizer=optimizer, grad=grad)  # its argument check
        return super().to(device, model=model, optimizer=optimizer, grad=grad)


class UnpinnedReference:
    """Mixin for verl's FSDP engines on CPU: a forward-only model (the reference) wrapped with verl's CPU offload
    policy, unpinned (module docstring)."""

    def _build_fsdp_module(self, module: Any) -> Any:
        if not self.engine_config.forward_only:
            return super()._build_fsdp_module(module)
        pinned = transformer_impl.CPUOffloadPolicy

        def unpinned(**options: Any) -> Any:
            return pinned(**{**options, "pin_memory": False})

        transformer_impl.CPUOffloadPolicy = unpinned  # for this call only: verl names it inside the method
        try:
            return super()._build_fsdp_module(module)
        finally:
            transformer_impl.CPUOffloadPolicy = pinned


class CPULanguageModelEngine(NoIdleCollect, UnpinnedReference, FSDPEngineWithLMHead):
    """verl's FSDP language-model engine (actor, reference) with :class:`NoIdleCollect` and
    :class:`UnpinnedReference`."""


_registered: set[str] = set()


def register_on_cpu(model_type: str, engine_cls: type) -> type:
    """Register `engine_cls` for `model_type` (verl's FSDP backends) on our CPU platform's vendor, once a process."""
    if model_type not in _registered:
        EngineRegistry.register(model_type=model_type, backend=FSDP_BACKENDS, device=ENGINE_DEVICES,
                                vendor=PLATFORM_NAME)(engine_cls)
        _registered.add(model_type)
    return engine_cls


def register_cpu_actor_engine() -> type[CPULanguageModelEngine]:
    """Register :class:`CPULanguageModelEngine` for the actor (and reference) on our CPU platform's vendor."""
    return register_on_cpu(LANGUAGE_MODEL, CPULanguageModelEngine)
