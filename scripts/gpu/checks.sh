#!/usr/bin/env bash
# The GPU checks (issues #35, #55): the training checks of tests/gpu and the rollout benchmark, each run's output kept.
#   bash scripts/gpu/checks.sh [training] [bench | bench-0.5b | bench-1.5b]     (default: training)
#     training    tests/gpu/test_training_on_gpu.py: the quickstart (2 GRPO steps in bf16, a checkpoint), then the
#                 async M2PO example resumed from it with delta weight sync (3 steps): 2 training runs
#     bench       bench/gpu_rollout.py: our env manager against verl's agent loop, both model sizes (its JSONs);
#     bench-SIZE  the same for one size
# On the lent GPU machine the set is two calls after the wheel calls (docs/gpus.md; build_chunks.sh prints them):
#   bash scripts/gpu/device/run.sh .gpu/cN -- bash scripts/gpu/checks.sh training
#   bash scripts/gpu/device/run.sh .gpu/cN -- bash scripts/gpu/checks.sh bench
# One device call runs at most 10 minutes. Output: $OUT/gpu/<run>.log per training run (the
# launcher's whole output), $OUT/gpu/bench_gpu_rollout_*.json, and pytest's summary in the caller's log. (A call
# brings back at most 8 files from $OUT.)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python
out="${OUT:-outputs/gpu-checks}"
export BEYOND_GPU_REPORT_DIR="$out/gpu"
mkdir -p "$BEYOND_GPU_REPORT_DIR"
[ $# -gt 0 ] || set -- training
rc=0
for check in "$@"; do
  started=$(date +%s)
  case "$check" in
    training) "$python" -m pytest -q -p no:cacheprovider -rA tests/gpu/test_training_on_gpu.py || rc=1 ;;
    bench|bench-0.5b|bench-1.5b)
           sizes=(0.5b 1.5b); [ "$check" = bench ] || sizes=("${check#bench-}")
           "$python" bench/gpu_rollout.py --sizes "${sizes[@]}" --out outputs/gpu-bench || rc=1
           cp outputs/gpu-bench/bench_gpu_rollout_*.json "$BEYOND_GPU_REPORT_DIR/" 2>/dev/null ;;
    *) echo "checks.sh: unknown check '$check' (valid: training, bench, bench-0.5b, bench-1.5b)" >&2; exit 2 ;;
  esac
  echo "checks.sh: $check took $(( $(date +%s) - started )) s"
  grep -h -a -E "^\[launcher\] training exited|step:[0-9]+ - " "$BEYOND_GPU_REPORT_DIR"/*.log 2>/dev/null \
    | cut -c1-400 | tail -20
done
exit "$rc"
