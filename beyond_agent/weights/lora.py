"""LoRA RL on verl's own LoRA path: the settings it needs from us, checked before Ray starts, and its sync metrics.

verl 0.9 trains a LoRA adapter when `actor_rollout_ref.model.lora_rank > 0` (FSDP + PEFT on the actor, with
`lora_alpha`, `target_modules`, `exclude_modules`), starts vLLM with LoRA enabled (one adapter slot, rank rounded
up to one vLLM allows) and, after each actor update, sends only the adapter's tensors with its PEFT config;
generation requests then name that adapter. What this module adds, all through verl's seams:

- our vLLM worker extension (`rollout.engine_kwargs.vllm.worker_extension_cls`), which loads the adapter with
  vLLM's own name mapping (verl 0.9's loader fails on vLLM 0.32, see `vllm_extension`) and reports each sync;
- the refusals, naming the key, of what this path does not serve;
- the adapter's size (`LoraPlan`), counted by PEFT on a meta-device copy of the model: the bytes each sync
  sends, logged per step as `beyond_agent/weight_sync/bytes_sent` beside the sync's measured `beyond_agent/weight_sync/transfer_s`.

One adapter per run: verl's actor holds PEFT's single `default` adapter and its vLLM server one slot (fixed
adapter id 123), so several adapters on one base would need a trainer that holds and updates several.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import open_dict
from verl.utils.torch_dtypes import PrecisionType

from beyond_agent.gpu_plan import lora_rank
from beyond_agent.weights.verl_backend import WORKER_EXTENSION_CLASS


@dataclass(frozen=True)
class LoraPlan:
    """The adapter a run trains, as verl will build it."""

    rank: int
    """`actor_rollout_ref.model.lora_rank`."""
    alpha: int
    """`actor_rollout_ref.model.lora_alpha` (the adapter's output is scaled by alpha / rank)."""
    adapter_parameters: int | None
    """Trainable adapter elements (lora_A and lora_B of every targeted module), counted by PEFT; None when the
    model's config.json is not a local file (a hub name: nothing is downloaded to count)."""
    element_bytes: int
    """Bytes per element as sent: verl casts the adapter to the actor's `fsdp_config.model_dtype`."""

    @property
    def adapter_bytes(self) -> int | None:
        """What one adapter sync sends (None: unknown)."""
        return None if self.adapter_parameters is None else self.adapter_parameters * self.element_bytes


def configure_lora(config: Any, weight_sync_mode: str) -> LoraPlan | None:
    """Point vLLM at our worker extension for a LoRA run and refuse what the path does not serve, naming the key.

    Returns None for full fine-tuning (nothing is changed). Raises ValueError.
    """
    rank = lora_rank(config.actor_rollout_ref.model)
    if rank <= 0:
        return None
    model = config.actor_rollout_ref.model
    rollout = config.actor_rollout_ref.rollout
    vllm_kwargs = (rollout.get("engine_kwargs") or {}).get("vllm") or {}
    refusals = [
        (weight_sync_mode == "delta", "beyond_agent.weight_sync.mode=delta (weight_sync.mode=full already sends the "
         "adapter alone; verl's checkpoint-engine seam, which delta mode uses, drops the adapter's config)"),
        (rollout.name != "vllm", f"actor_rollout_ref.rollout.name={rollout.name} (LoRA is served by vllm here)"),
        (bool((model.get("lora") or {}).get("merge")), "actor_rollout_ref.model.lora.merge=true (every sync would "
         "send the whole merged model; leave it false and the adapter alone is sent)"),
        (vllm_kwargs.get("worker_extension_cls") not in (None, "", WORKER_EXTENSION_CLASS),
         f"actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls={vllm_kwargs.get('worker_extension_cls')}"
         " (LoRA adapters are loaded by ours)"),
    ]
    problems = [why for refused, why in refusals if refused]
    if problems:
        raise ValueError(f"LoRA (actor_rollout_ref.model.lora_rank={rank}) cannot run with " + "; ".join(problems))
    with open_dict(config):
        rollout.engine_kwargs.vllm.worker_extension_cls = WORKER_EXTENSION_CLASS
    actor_fsdp = (config.actor_rollout_ref.get("actor") or {}).get("fsdp_config") or {}
    dtype = str(actor_fsdp.get("model_dtype") or "fp32")
    try:  # verl's own reading of the key
        element_bytes = PrecisionType.to_dtype(dtype).itemsize
    except RuntimeError:
        raise ValueError(f"actor_rollout_ref.actor.fsdp_config.model_dtype={dtype}: one of fp32, bf16, fp16") from None
    from transformers import AutoConfig

    alpha = int(model.get("lora_alpha", 16))
    parameters = None
    if (Path(str(model.path)) / "config.json").is_file():
        parameters = adapter_parameter_count(AutoConfig.from_pretrained(str(model.path)), rank, alpha,
                                             _plain(model.get("target_modules", "all-linear")),
                                             _plain(model.get("exclude_modules")))
    return LoraPlan(rank=rank, alpha=alpha, adapter_parameters=parameters, element_bytes=element_bytes)


def adapter_parameter_count(hf_config: Any, rank: int, alpha: int, target_modules: Any,
                            exclude_modules: Any = None) -> int:
    """The adapter's trainable elements, as PEFT builds them on a model of `hf_config` (a transformers config) on
    the meta device: no weights are read or allocated.

    Raises ValueError naming `target_modules` when PEFT finds none of them in the model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(hf_config)
    lora = LoraConfig(task_type="CAUSAL_LM", r=rank, lora_alpha=alpha, target_modules=target_modules,
                      exclude_modules=exclude_modules, bias="none")
    try:
        adapted = get_peft_model(base, lora)
    except ValueError as error:
        raise ValueError(f"actor_rollout_ref.model.target_modules={target_modules}: {error}") from None
    return sum(param.numel() for param in adapted.parameters() if param.requires_grad)


def _plain(value: Any) -> Any:
    """An OmegaConf list as a Python list (PEFT checks types)."""
    from omegaconf import ListConfig, OmegaConf

    return OmegaConf.to_container(value) if isinstance(value, ListConfig) else value
