"""Running upstream verl and vLLM on a machine without an accelerator, through their plugin seams.

- ``platform.py``: a verl platform registered as ``"cpu"`` (selected with ``VERL_PLATFORM=cpu``) plus the
  ``torch.cuda``-style device-module shim verl calls.
- ``verl_plugin.py``: the ``verl.plugins`` entry point; registers the platform and the actor's and critic's
  engines in every process that imports verl, and only when ``VERL_PLATFORM=cpu``.
- ``actor_engine.py``: verl's FSDP language-model engine without the garbage-collector pass (~0.5 s) it makes
  at each change of mode on a device named ``cpu`` although nothing moves.
- ``value_engine.py``: verl's FSDP value-model engine (the critic, for GAE) loading the model with the
  configured attention instead of verl's hard-coded flash-attn; chosen by verl's ``EngineRegistry`` for
  this platform's vendor only.
- ``vllm_plugin.py``: the ``vllm.general_plugins`` entry point; keeps vLLM's CPU Linear layers on
  plain ``torch.nn.functional.linear`` so verl's in-place weight sync reaches them.
- ``overrides.py``: the Hydra overrides and environment a CPU run needs, each with its reason.
- ``smoke_data.py`` / ``smoke_reward.py``: a tiny offline dataset and reward for the CPU smoke run.

Nothing here is imported on GPU runs unless ``VERL_PLATFORM=cpu`` is set; this package's ``__init__``
imports nothing heavy on purpose.
"""
