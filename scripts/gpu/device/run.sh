#!/usr/bin/env bash
# Device side, the last call: install the carried wheels (install.sh), record the machine, then run a command
# from the project root with its output teed to $OUT/log.
#   bash scripts/gpu/device/run.sh .gpu/cN -- COMMAND [ARGS...]
# $OUT/machine.txt gets nvidia-smi's line and the image's own packages (pip freeze, before ours are on the path),
# which is what scripts/gpu/device/wheels.txt is chosen against.
set -uo pipefail
chunk="${1:?usage: run.sh CHUNK_DIR -- COMMAND [ARGS...]}"; shift
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "run.sh: no command after --" >&2; exit 2; }
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
out="${OUT:-/tmp/gpu-out}"; mkdir -p "$out"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
  "${PYTHON:-python3}" --version; "${PYTHON:-python3}" -m pip freeze 2>/dev/null; } > "$out/machine.txt" 2>&1
started=$(date +%s)
# shellcheck source=install.sh
. scripts/gpu/device/install.sh "$chunk" || exit $?
echo "run.sh: wheels ready in $(( $(date +%s) - started )) s; running: $*"
"$@" 2>&1 | tee -a "$out/log"
rc=${PIPESTATUS[0]}
echo "run.sh: rc $rc after $(( $(date +%s) - started )) s"
exit "$rc"
