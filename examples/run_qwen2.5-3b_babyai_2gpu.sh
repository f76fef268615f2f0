#!/usr/bin/env bash
# bash examples/run_qwen2.5-3b_babyai_2gpu.sh [--dry-run] [--backup-dir D] [-- hydra overrides...]
#
# Qwen2.5-3B-Instruct on BabyAI with 2 GPUs: the BabyAI example (examples/babyai/babyai.yaml: envservice,
# task files, GRPO with ScalingInter-RL rounds 10 -> 20 -> 30) resized for one 2-GPU node, vLLM and FSDP
# sharing both GPUs. MODEL_PATH overrides the model; secrets and tracker keys go in .env.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export MODEL_PATH="${MODEL_PATH:-Qwen/Qwen2.5-3B-Instruct}"
launcher_args=() user_overrides=()
while [ $# -gt 0 ]; do  # launcher options before `--`, the user's Hydra overrides after it (they win)
  if [ "$1" = "--" ]; then shift; user_overrides=("$@"); break; fi
  launcher_args+=("$1"); shift
done
exec "${PYTHON:-.venv/bin/python}" launcher.py --conf examples/babyai/babyai.yaml --with-envservice \
  "${launcher_args[@]}" -- \
  trainer.n_gpus_per_node=2 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
  actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 \
  trainer.experiment_name=babyai_qwen2.5-3b_2gpu \
  "${user_overrides[@]}"
