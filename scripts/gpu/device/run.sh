#!/usr/bin/env bash
# Device side, each check's call: install the wheels from the stashed chunks and the carried last one (install.sh;
# once per warm machine), record the machine, then run a command from the project root with its output teed to
# $OUT/log.
#   bash scripts/gpu/device/run.sh .gpu/cN -- COMMAND [ARGS...]   the first check, carrying the last chunk
#   bash scripts/gpu/device/run.sh -- COMMAND [ARGS...]           the later ones, carrying nothing
# $OUT/machine.txt gets nvidia-smi's line and the image's own packages (pip freeze, before ours are on the path),
# which is what scripts/gpu/device/wheels.txt is chosen against.
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: run.sh [CHUNK_DIR] -- COMMAND [ARGS...]" >&2; exit 2; }
chunk=""
if [ "$1" != "--" ]; then chunk="$1"; shift; fi
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "run.sh: no command after --" >&2; exit 2; }
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
out="${OUT:-/tmp/gpu-out}"; mkdir -p "$out"
# Whether the image's torch has byte code where this Python looks for it, and whether Python may write there (the
# package is found, not imported).
IMAGE_BYTE_CODE='import importlib.util as u, os
spec = u.find_spec("torch")
found = spec is not None
print("image torch:", spec.origin if found else "none", "- byte code:", found and os.path.exists(u.cache_from_source(spec.origin)),
      "- writable:", found and os.access(os.path.dirname(spec.origin), os.W_OK))'
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || echo "no nvidia-smi"
  "${PYTHON:-python3}" --version
  echo "Python's environment: $(env | grep -E '^PYTHON' | tr '\n' ' ')"
  "${PYTHON:-python3}" -c "$IMAGE_BYTE_CODE"
  "${PYTHON:-python3}" -m pip freeze 2>/dev/null; } > "$out/machine.txt" 2>&1
started=$(date +%s)
# shellcheck source=install.sh
. scripts/gpu/device/install.sh "$chunk" || exit $?
echo "run.sh: wheels ready in $(( $(date +%s) - started )) s; running: $*"
"$@" 2>&1 | tee -a "$out/log"
rc=${PIPESTATUS[0]}
echo "run.sh: rc $rc after $(( $(date +%s) - started )) s"
exit "$rc"
