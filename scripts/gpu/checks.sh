#!/usr/bin/env bash
# The GPU checks (issue #35): the smoke tests of tests/gpu and the rollout benchmark, each run's output kept.
#   bash scripts/gpu/checks.sh [quickstart] [async] [bench | bench-0.5b | bench-1.5b]   (default: quickstart async)
#     quickstart  tests/gpu/test_quickstart_on_gpu.py: 2 GRPO steps in bf16, a checkpoint, a resume (2 runs)
#     async       tests/gpu/test_async_m2po_on_gpu.py: async M2PO with delta weight sync, 3 steps (1 run)
#     bench       bench/gpu_rollout.py: our env manager against verl's agent loop, both model sizes (its JSONs);
#     bench-SIZE  the same for one size
# On the lent GPU machine the set is two calls after the wheel calls (docs/gpus.md; build_chunks.sh prints them):
#   bash scripts/gpu/device/run.sh .gpu/cN -- bash scripts/gpu/checks.sh async bench-0.5b
#   bash scripts/gpu/device/run.sh .gpu/cN -- bash scripts/gpu/checks.sh quickstart bench-1.5b
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
[ $# -gt 0 ] || set -- quickstart async
rc=0
for check in "$@"; do
  started=$(date +%s)
  case "$check" in
    quickstart) "$python" -m pytest -q -p no:cacheprovider -rA tests/gpu/test_quickstart_on_gpu.py || rc=1 ;;
    async) "$python" -m pytest -q -p no:cacheprovider -rA tests/gpu/test_async_m2po_on_gpu.py || rc=1 ;;
    bench|bench-0.5b|bench-1.5b)
           sizes=(0.5b 1.5b); [ "$check" = bench ] || sizes=("${check#bench-}")
           "$python" bench/gpu_rollout.py --sizes "${sizes[@]}" --out outputs/gpu-bench || rc=1
           cp outputs/gpu-bench/bench_gpu_rollout_*.json "$BEYOND_GPU_REPORT_DIR/" 2>/dev/null ;;
    *) echo "checks.sh: unknown check '$check' (valid: quickstart, async, bench, bench-0.5b, bench-1.5b)" >&2; exit 2 ;;
  esac
  echo "checks.sh: $check took $(( $(date +%s) - started )) s"
  grep -h -a -E "^\[launcher\] training exited|step:[0-9]+ - " "$BEYOND_GPU_REPORT_DIR"/*.log 2>/dev/null \
    | cut -c1-400 | tail -20
done
exit "$rc"
