"""The critic's value model on CPU: verl's FSDP value-model engine, loaded with the configured attention.

Why: verl 0.9 builds the critic (``Role.Critic`` -> ``verl.workers.engine_workers.TrainingWorker``) with
the engine ``EngineRegistry`` finds for ``("value_model", critic.strategy)``, i.e.
``FSDPEngineWithValueHead``. Its ``_build_module`` loads the model through
``verl.utils.model.load_valuehead_model``, which passes ``attn_implementation="flash_attention_2"`` to
``from_pretrained``; that argument beats the config's ``_attn_implementation`` (set from
``critic.model.override_config.attn_implementation``), and flash-attn has no CPU build, so the critic
dies at init with "FlashAttention2 has been toggled on, but it cannot be used ...". The actor's engine
passes no such argument, which is why sdpa in the config is enough there.

How: :class:`CPUValueHeadEngine` is that engine with one change: while its module is built, verl's
loader is replaced by :func:`load_value_model`, which loads the same token-classification head
(``num_labels=1``, set by verl before the call) with the attention the config names. Everything else
(FSDP wrapping, monkey patches, dtype, gradient checkpointing, forward, checkpoints) is verl's.

Selection: :func:`register_cpu_value_engine` registers it for vendor ``"cpu"``, the vendor name of our
platform (``verl_cpu.platform.PlatformCPU``). ``EngineRegistry.get_engine_cls`` tries the
``(device, vendor)`` key before the plain device, so a run with ``VERL_PLATFORM=cpu`` (where
``VERL_ENGINE_DEVICE=cuda`` makes the device ``cuda``) gets this engine, and any other run, whose vendor
is ``nvidia``/``huawei``/..., keeps verl's. ``verl_plugin.py`` calls it only when ``VERL_PLATFORM=cpu``.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithValueHead

from verl_cpu.actor_engine import NoIdleCollect, register_on_cpu

VALUE_MODEL = "value_model"


def load_value_model(local_path, torch_dtype, model_config, trust_remote_code):
    """The critic's model with a one-label token-classification head, attention as ``model_config`` says.

    Takes the arguments verl's ``load_valuehead_model`` takes. There is no fallback to trl's
    ``AutoModelForCausalLMWithValueHead``: the models we train on CPU (Qwen2 and the like) have a
    ``*ForTokenClassification`` class in transformers.
    """
    from transformers import AutoModelForTokenClassification

    return AutoModelForTokenClassification.from_pretrained(
        pretrained_model_name_or_path=local_path, torch_dtype=torch_dtype, config=model_config,
        trust_remote_code=trust_remote_code,
    )


@contextmanager
def value_model_loader(loader: Callable) -> Iterator[None]:
    """Within the block, ``verl.utils.model.load_valuehead_model`` is ``loader``; restored afterwards.

    verl's ``_build_module`` imports that name from its module at call time, so this reaches exactly the
    one call that loads the critic, in this process, for the duration of the build.
    """
    import verl.utils.model as verl_model

    original = verl_model.load_valuehead_model
    verl_model.load_valuehead_model = loader
    try:
        yield
    finally:
        verl_model.load_valuehead_model = original


class CPUValueHeadEngine(NoIdleCollect, FSDPEngineWithValueHead):
    """verl's FSDP value-model engine whose module is loaded with the configured attention (sdpa on CPU), without
    the idle garbage-collector pass of a mode change (``actor_engine.NoIdleCollect``)."""

    def _build_module(self):
        with value_model_loader(load_value_model):
            return super()._build_module()


def register_cpu_value_engine() -> type[CPUValueHeadEngine]:
    """Register :class:`CPUValueHeadEngine` for the critic on our CPU platform's vendor (idempotent)."""
    return register_on_cpu(VALUE_MODEL, CPUValueHeadEngine)
