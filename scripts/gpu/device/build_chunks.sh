#!/usr/bin/env bash
# Here (a machine that reaches PyPI): download the wheels of scripts/gpu/device/wheels.txt, check each against
# scripts/gpu/device/wheels.sha256, and cut them into chunks that one device call each can carry.
#
#   bash scripts/gpu/device/build_chunks.sh            -> .gpu/c1 .. .gpu/cN (ignored by git)
#   bash scripts/gpu/device/build_chunks.sh --record   the same, writing wheels.sha256 anew from this download
#                                                      (after changing wheels.txt; commit both)
#
# A device call carries at most 64 MiB, the working tree included, so a chunk is at most 64 MiB less the tree
# less 1 MiB (CHUNK_MIB overrides), and the compressed tar is cut into chunks of that size. Each chunk folder holds its
# part and the file PARTS (the compressed tar's sha256 and how many parts there are), so the device side can tell which
# chunks it still lacks. Downloads are kept in .gpu/wheels (WHEEL_CACHE=DIR elsewhere) and reused. It prints the
# device calls to make. GPU_WHEEL_LIST (a wheels.txt, its sha256 file beside it as <name>.sha256) and
# GPU_CHUNK_DIR (instead of .gpu) are for the test of this script.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
list="${GPU_WHEEL_LIST:-scripts/gpu/device/wheels.txt}"
sums="${list%.txt}.sha256"
out="${GPU_CHUNK_DIR:-.gpu}"
cache="${WHEEL_CACHE:-$out/wheels}"
record=false
case "${1:-}" in
  "") ;;
  --record) record=true ;;
  *) echo "build_chunks.sh: unknown argument '$1' (valid: --record)" >&2; exit 2 ;;
esac
# Wheels with only an sdist on PyPI, built here: their bytes change with the build, so no sha256 is kept.
BUILT_HERE="antlr4_python3_runtime"
built_here() { [[ " $BUILT_HERE " == *" ${1%%-*} "* ]]; }   # $1: a wheel's file name

mkdir -p "$cache"
wheels=()
while read -r line; do
  case "$line" in ""|"#"*) continue ;; esac
  wheels+=("$line")
done < "$list"

# pip matches a manylinux tag exactly, so every glibc level up to the image's (Ubuntu 24.04: 2.39) is listed.
platforms=()
for tag in manylinux_2_39 manylinux_2_35 manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 \
           manylinux_2_26 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
python_here=python3
[ -x .venv/bin/python ] && python_here=.venv/bin/python
pip=("$python_here" -m pip)

missing=0
for wheel in "${wheels[@]}"; do
  [ -f "$cache/$wheel" ] && continue
  name="${wheel%%-*}"; rest="${wheel#*-}"; version="${rest%%-*}"
  if built_here "$wheel"; then
    "${pip[@]}" wheel -q --no-deps -w "$cache" "$name==$version"
  else
    "${pip[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${platforms[@]}" -d "$cache" "$name==$version"
  fi
  [ -f "$cache/$wheel" ] || { echo "build_chunks.sh: $name==$version did not download as $wheel" >&2; missing=1; }
done
[ "$missing" = 0 ] || exit 1

if $record; then
  { echo "# sha256 of each downloaded wheel of wheels.txt (written by build_chunks.sh --record; wheels built here have none)"
    for wheel in "${wheels[@]}"; do
      built_here "$wheel" && continue
      (cd "$cache" && sha256sum "$wheel")
    done; } > "$sums"
  echo "build_chunks.sh: recorded $sums"
fi
if ! grep -v '^#' "$sums" | (cd "$cache" && sha256sum --check --quiet --strict -); then
  echo "build_chunks.sh: a wheel differs from $sums (above); delete it from $cache and run again," \
       "or run with --record after changing wheels.txt" >&2
  exit 1
fi

tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 -r du -cb 2>/dev/null | tail -1 | cut -f1)
chunk_mib="${CHUNK_MIB:-$(( 64 - (tree_bytes + 1048575) / 1048576 - 1 ))}"

stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT
mkdir "$stage/wheels"
# The wheels with their members stored (store_wheels.py), in one tar, in one xz stream: xz over the members'
# contents carries fewer chunks than the deflated wheels (each chunk is a device call; docs/gpus.md has the figures).
# Blocks of 64 MiB let the device's xz decompress on all its cores. The same wheels give the same tar (sorted names,
# no times or owners).
"$python_here" scripts/gpu/device/store_wheels.py "$cache" "$stage/wheels" "${wheels[@]}"
tar -C "$stage" --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -cf "$stage/wheels.tar" wheels
rm -rf "$stage/wheels"
wheel_bytes=$(cd "$cache" && du -cb "${wheels[@]}" | tail -1 | cut -f1)
xz -9 -T0 --block-size=64MiB "$stage/wheels.tar"
tar_bytes=$(stat -c %s "$stage/wheels.tar.xz")
# Full chunks, and what is left in the last one: the stash calls carry the full ones, the first check the small
# rest (a call's seconds grow with what it carries: ~8.6 s for a 63 MiB stash call on the H200, 2026-11-28).
(cd "$stage" && split -b "${chunk_mib}M" -d -a 2 wheels.tar.xz part.)
parts=("$stage"/part.*)
sha="$(sha256sum "$stage/wheels.tar.xz" | cut -d' ' -f1)"
rm -rf "$out"/c[0-9]*
for i in "${!parts[@]}"; do
  n=$((i + 1))
  mkdir -p "$out/c$n"
  mv "${parts[$i]}" "$out/c$n/wheels.tar.$n"
  printf 'sha256 %s\nparts %s\n' "$sha" "${#parts[@]}" > "$out/c$n/PARTS"
done
last=${#parts[@]}
echo "build_chunks.sh: ${#wheels[@]} wheels, $((wheel_bytes / 1048576)) MiB, compressed to $((tar_bytes / 1048576)) MiB" \
     "in $last chunks of at most ${chunk_mib} MiB under $out/ (sha256 $sha; the working tree is $((tree_bytes / 1048576)) MiB)"
echo "Device calls, back to back while the machine stays warm (docs/gpus.md):"
for n in $(seq 1 $((last - 1))); do
  echo "  run(command=\"bash scripts/gpu/device/stash.sh $out/c$n\", carry=[\"$out/c$n\"])"
done
# The checks, one device call each, in priority order, with what each is expected to take on the H200 (docs/gpus.md
# derives each from the measured phases). The first carries the last chunk and installs the wheels; the others
# carry nothing and find them installed. train-async continues train-sync's run, kept under /root while the machine
# is warm; bench-0.5b takes train-sync's model, bench-1.5b the one train-async built beside its run.
echo "Then the checks, one call each, in this order (expected device seconds; stop where the session's time ends):"
first=true
while read -r checks expected limit; do
  if $first; then
    echo "  run(command=\"bash scripts/gpu/device/run.sh $out/c$last -- bash scripts/gpu/checks.sh $checks\", carry=[\"$out/c$last\"], timeout_s=$limit)   # ~${expected} s"
    first=false
  else
    echo "  run(command=\"bash scripts/gpu/device/run.sh -- bash scripts/gpu/checks.sh $checks\", timeout_s=$limit)   # ~${expected} s"
  fi
done <<'CALLS'
train-sync 235 300
train-async 175 300
bench-0.5b 155 300
bench-1.5b 180 300
CALLS
