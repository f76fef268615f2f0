#!/usr/bin/env bash
# The GPU checks (issues #35, #55, #74): the training checks of tests/gpu and the rollout benchmark, each run's
# output and phase times kept.
#   bash scripts/gpu/checks.sh CHECK...     (default: training)
#     train-sync  the quickstart (2 GRPO steps in bf16, a checkpoint) with the model of BEYOND_GPU_MODEL (default
#                 0.5b on a GPU: a random-weight model of Qwen2.5-0.5B's shape; tiny in a CPU rehearsal); the model
#                 and the run are kept in the state folder for train-async
#     train-async the async M2PO example with delta weight sync resumed from train-sync's checkpoint (3 steps); it
#                 stops at once, saying so, when train-sync's run is not kept on this machine; beside it, bench-1.5b's
#                 model is built into the state folder
#     training    both in one call (a GPU node without a call limit)
#     bench-0.5b, bench-1.5b   bench/gpu_rollout.py for one size: our env manager against verl's agent loop
#     bench       both sizes
# On the lent GPU machine each check is its own device call (docs/gpus.md; build_chunks.sh prints them in order):
#   bash scripts/gpu/device/run.sh .gpu/cN -- bash scripts/gpu/checks.sh train-sync
# The state folder (BEYOND_GPU_STATE, default /root/beyond-gpu-state where /root is writable, else
# outputs/gpu-state) outlives a call while the machine stays warm. Output: $OUT/gpu/<run>.log (the launcher's
# whole output), <run>.phases.md (where its time went), bench JSONs, and pytest's summary in the caller's log.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
python=python3
[ -x .venv/bin/python ] && python=.venv/bin/python
out="${OUT:-outputs/gpu-checks}"
export BEYOND_GPU_REPORT_DIR="$out/gpu"
if [ -z "${BEYOND_GPU_STATE:-}" ]; then
  if [ -w /root ]; then BEYOND_GPU_STATE=/root/beyond-gpu-state; else BEYOND_GPU_STATE=outputs/gpu-state; fi
fi
export BEYOND_GPU_STATE
if [ "${BEYOND_GPU_CHECKS_ON_CPU:-0}" = 1 ]; then export BEYOND_GPU_MODEL="${BEYOND_GPU_MODEL:-tiny}"
else export BEYOND_GPU_MODEL="${BEYOND_GPU_MODEL:-0.5b}"; fi
mkdir -p "$BEYOND_GPU_REPORT_DIR" "$BEYOND_GPU_STATE"
[ $# -gt 0 ] || set -- training
tests=tests/gpu/test_training_on_gpu.py
rc=0
for check in "$@"; do
  started=$(date +%s)
  case "$check" in
    train-sync)
      rm -rf "$BEYOND_GPU_STATE/runs/quickstart" "$BEYOND_GPU_STATE/runs/quickstart".*  # a fresh run, kept for train-async
      "$python" -m pytest -q -s -p no:cacheprovider -rA "$tests" -k quickstart_trains || rc=1 ;;
    train-async)
      # bench-1.5b's model, built on the cores this call leaves idle (~20 s of a later call otherwise); not in a CPU
      # rehearsal, whose two cores the run needs
      builder=""
      if [ "$BEYOND_GPU_MODEL" != tiny ]; then
        "$python" -m dev_tools.tiny_model --shape 1.5b --out "$BEYOND_GPU_STATE/models/1.5b" \
          > "$BEYOND_GPU_REPORT_DIR/model-1.5b.log" 2>&1 &
        builder=$!
      fi
      BEYOND_GPU_REQUIRE_KEPT=1 "$python" -m pytest -q -s -p no:cacheprovider -rA "$tests" -k "resume or async or delta" \
        || rc=1
      [ -z "$builder" ] || wait "$builder" || echo "checks.sh: the 1.5b model was not built (bench-1.5b builds it):" \
        "$(tail -1 "$BEYOND_GPU_REPORT_DIR/model-1.5b.log")" ;;
    training) "$python" -m pytest -q -s -p no:cacheprovider -rA "$tests" || rc=1 ;;
    bench|bench-0.5b|bench-1.5b)
      sizes=(0.5b 1.5b); [ "$check" = bench ] || sizes=("${check#bench-}")
      # the models in the state folder: bench-0.5b finds the one train-sync built
      "$python" bench/gpu_rollout.py --sizes "${sizes[@]}" --models "$BEYOND_GPU_STATE/models" --out outputs/gpu-bench \
        || rc=1
      cp outputs/gpu-bench/bench_gpu_rollout_*.json "$BEYOND_GPU_REPORT_DIR/" 2>/dev/null ;;
    *) echo "checks.sh: unknown check '$check' (valid: train-sync, train-async, training, bench, bench-0.5b, bench-1.5b)" >&2
       exit 2 ;;
  esac
  echo "checks.sh: $check took $(( $(date +%s) - started )) s (model: $BEYOND_GPU_MODEL, state: $BEYOND_GPU_STATE)"
  grep -h -a -E "^\[launcher\] training exited|step:[0-9]+ - " "$BEYOND_GPU_REPORT_DIR"/*.log 2>/dev/null \
    | cut -c1-400 | tail -20
done
exit "$rc"
