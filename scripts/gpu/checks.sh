#!/usr/bin/env bash
# The GPU checks (issue #35): the smoke tests of tests/gpu and the rollout benchmark, each run's output kept.
#   bash scripts/gpu/checks.sh [quickstart] [async] [bench]     (default: quickstart async)
#     quickstart  tests/gpu/test_quickstart_on_gpu.py: 2 GRPO steps in bf16, a checkpoint, a resume (2 runs)
#     async       tests/gpu/test_async_m2po_on_gpu.py: async M2PO with delta weight sync, 3 steps (1 run)
#     bench       bench/gpu_rollout.py: our env manager against verl's agent loop, two model sizes (its JSONs)
# On the lent GPU machine it is the last call's command, after the wheels are in (docs/gpus.md):
#   bash scripts/gpu/device/run.sh .gpu/cN -- bash scripts/gpu/checks.sh quickstart
# One device call runs at most 10 minutes, so pick what fits. Output: $OUT/gpu/<run>.log per training run (the
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
    bench) "$python" bench/gpu_rollout.py --out outputs/gpu-bench || rc=1
           cp outputs/gpu-bench/bench_gpu_rollout_*.json "$BEYOND_GPU_REPORT_DIR/" 2>/dev/null ;;
    *) echo "checks.sh: unknown check '$check' (valid: quickstart, async, bench)" >&2; exit 2 ;;
  esac
  echo "checks.sh: $check took $(( $(date +%s) - started )) s"
  grep -h -a -E "^\[launcher\] training exited|step:[0-9]+ - " "$BEYOND_GPU_REPORT_DIR"/*.log 2>/dev/null \
    | cut -c1-400 | tail -20
done
exit "$rc"
