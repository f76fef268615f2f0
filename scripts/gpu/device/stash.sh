#!/usr/bin/env bash
# Device side, one call per chunk but the last: keep the carried chunk on the machine, which stays warm ~30 s
# after a call (carried folders do not persist between calls; /root/stash does while the machine is held).
#   bash scripts/gpu/device/stash.sh .gpu/cN
# DEVICE_HOME (default /root) is for the test of these scripts.
set -euo pipefail
stash="${DEVICE_HOME:-/root}/stash"
chunk="${1:?usage: stash.sh CHUNK_DIR (e.g. .gpu/c1)}"
[ -f "$chunk/PARTS" ] || { echo "stash.sh: $chunk has no PARTS file; carry it with carry=[\"$chunk\"]" >&2; exit 2; }
mkdir -p "$stash"
cp "$chunk"/wheels.tar.* "$chunk/PARTS" "$stash/"
echo "stash.sh: $stash holds $(ls "$stash"/wheels.tar.* | wc -l) of $(sed -n 's/^parts //p' "$chunk/PARTS") parts"
