#!/usr/bin/env bash
# Device side, sourced by run.sh: join the stashed chunks and this call's, check the compressed tar's sha256, install
# the wheels into /root/site once per warm machine, put the flash_attn stand-in beside them and set the environment.
#   . scripts/gpu/device/install.sh [CHUNK_DIR_OF_THIS_CALL]   (none: a later call, the wheels already installed)
# Returns 2, naming the chunks it lacks, when a stash call was skipped or the machine went cold between calls.
# DEVICE_HOME (default /root) and PYTHON (default python3) are for the test of these scripts.
device_home="${DEVICE_HOME:-/root}"
python="${PYTHON:-python3}"
stash="$device_home/stash"
site="$device_home/site"
pycache="$device_home/pycache"
device_dir="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
mkdir -p "$stash"
if [ -n "${1:-}" ]; then bash "$device_dir/stash.sh" "$1" >/dev/null || return 2; fi   # this call's chunk
sha="$(sed -n 's/^sha256 //p' "$stash/PARTS" 2>/dev/null)"
parts="$(sed -n 's/^parts //p' "$stash/PARTS" 2>/dev/null)"
if [ -z "$sha" ]; then
  echo "install.sh: no chunk is on this machine (a fresh machine, or one given back since the stash calls): run the" \
       "stash calls, then the first check carrying the last chunk (build_chunks.sh prints them)" >&2
  return 2
fi
if [ ! -f "$site/.installed-$sha" ]; then
  lacking=""
  for n in $(seq 1 "$parts"); do [ -f "$stash/wheels.tar.$n" ] || lacking="$lacking .gpu/c$n"; done
  if [ -n "$lacking" ]; then
    echo "install.sh: this machine lacks the chunks$lacking of $parts (a stash call was skipped, or the machine" \
         "was given back between calls): run bash scripts/gpu/device/stash.sh for each, back to back" >&2
    return 2
  fi
  joined="$device_home/wheels.tar.xz"
  got="$(for n in $(seq 1 "$parts"); do cat "$stash/wheels.tar.$n"; done | tee "$joined" | sha256sum | cut -d' ' -f1)"
  if [ "$got" != "$sha" ]; then
    rm -f "$joined"
    echo "install.sh: the joined chunks' sha256 is $got, not $sha (parts of two builds?): build the chunks again" \
         "and stash every one" >&2
    return 2
  fi
  rm -rf "$device_home/wheels" "$site"
  # One xz stream of the stored wheels (build_chunks.sh), decompressed on all cores; Python's lzma where the image
  # has no xz.
  unpacked_at=$(date +%s)
  if command -v xz >/dev/null; then xz -dc -T0 "$joined" | tar -C "$device_home" -x
  else "$python" -c 'import lzma, sys, tarfile; tarfile.open(fileobj=lzma.open(sys.argv[1])).extractall(sys.argv[2], filter="data")' \
         "$joined" "$device_home"; fi
  rm -f "$joined"
  echo "install.sh: wheels unpacked in $(( $(date +%s) - unpacked_at )) s"
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$device_home"/wheels/*.whl \
    2>&1 | grep -v -i "target directory" | tail -5
  installed=$(find "$site" -maxdepth 1 -name '*.dist-info' | wc -l)
  expected=$(find "$device_home/wheels" -name '*.whl' | wc -l)
  if [ "$installed" -ne "$expected" ]; then
    echo "install.sh: $installed of $expected wheels installed into $site (pip's errors above)" >&2
    return 2
  fi
  # Byte code for every installed module at once, on all cores, into the folder every later process reads
  # (PYTHONPYCACHEPREFIX below): on 2026-11-28 each vLLM and Ray process on the H200 took 22-38 s from its start to
  # its first line, as imports compiling their sources do (here: 25-30 s without .pyc, 12 s with them). Files
  # that do not compile (a wheel's stray Python 2 tests) are left to fail where they are imported, as before.
  rm -rf "$pycache"
  compiled_at=$(date +%s)
  PYTHONPYCACHEPREFIX="$pycache" "$python" -m compileall -q -j 0 "$site" >/dev/null 2>&1
  echo "install.sh: byte code of $site compiled in $(( $(date +%s) - compiled_at )) s"
  touch "$site/.installed-$sha"
fi
cp -r "$device_dir/shim/flash_attn" "$site/"
# The project first: verl's wheel ships top-level `tests` and `scripts` packages of its own.
export PYTHONPATH="$(cd "$device_dir/../../.." && pwd):$site" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
  PYGAME_HIDE_SUPPORT_PROMPT=1
# Byte code: the wheels' from the install above, the rest (the image's torch, this project) written once by the
# first process that imports it and read by every later one, in this call and the next, whatever the image says
# about writing byte code (PYTHONDONTWRITEBYTECODE) or where its packages may be written.
export PYTHONPYCACHEPREFIX="$pycache"
unset PYTHONDONTWRITEBYTECODE
# The CPU platform's settings (verl_cpu/overrides.py) must not leak into a GPU run.
unset VERL_PLATFORM VERL_ENGINE_DEVICE VLLM_TARGET_DEVICE
echo "install.sh: $(find "$site" -maxdepth 1 -name '*.dist-info' | wc -l) packages in $site on PYTHONPATH"
