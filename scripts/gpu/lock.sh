#!/usr/bin/env bash
# The GPU stack, resolved and pinned in scripts/gpu/requirements.lock (what `scripts/install.sh --gpu` installs).
#
#   bash scripts/gpu/lock.sh           write the lock again (after changing REQUIRED_VERL.txt, pyproject.toml
#                                      or EXCLUDE_NEWER below)
#   bash scripts/gpu/lock.sh --check   fail unless the committed lock is still a full resolution of the inputs
#                                      and every pin has a wheel (the resolve-only check the test suite runs;
#                                      needs PyPI, no GPU)
#
# Resolved on any machine for the GPU machines' platform (uv's --python-platform / --python-version), from
# PyPI as of EXCLUDE_NEWER. The check does not ask for today's resolution to equal the lock: releases keep
# appearing on the index with upload times before EXCLUDE_NEWER (ml-dtypes 0.7.0, stamped 2026-11-16, was not
# there when the lock was last written, on 2026-11-28, and a fresh resolution took it), so equality failed CI on an
# unchanged lock. It resolves the inputs with the lock's pins as constraints and asks for exactly the lock back:
# a pin the inputs no longer admit fails the resolution, and a pin missing or no longer needed shows in the diff.
# The inputs: verl's release from beyond_agent/REQUIRED_VERL.txt with its vllm and gpu extras, and our own
# dependencies with the gpu, test and envs extras.
set -euo pipefail
cd "$(dirname "$0")/../.."

EXCLUDE_NEWER="2026-11-25T00:00:00Z"
PLATFORM="x86_64-manylinux_2_35"   # glibc >= 2.35: Ubuntu 22.04 or newer (2.28 would leave vLLM's llguidance
                                   # without a wheel)
# The pins with no wheel for that platform, built from source by the installer: flash-attn (CUDA; see
# install.sh), jericho and fast-downward-textworld (C/C++, TextWorld/ALFWorld envs, as on CPU), antlr4 and
# chess (pure Python). The check fails when any other pin would need a build.
SOURCE_BUILDS="flash-attn jericho fast-downward-textworld antlr4-python3-runtime chess"
PYTHON_VERSION="3.11"
LOCK="${BEYOND_GPU_LOCK:-scripts/gpu/requirements.lock}"   # the variable: for the test of --check

mode=write
case "${1:-}" in
  "") ;;
  --check) mode=check ;;
  *) echo "lock.sh: unknown argument '$1' (valid: --check)" >&2; exit 2 ;;
esac

uv=(.venv/bin/python -m uv)
[ -x .venv/bin/python ] && .venv/bin/python -m uv --version >/dev/null 2>&1 || uv=(uv)
verl_version="$(sed -n 's/^version=//p' beyond_agent/REQUIRED_VERL.txt)"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo "verl[vllm,gpu]==${verl_version}" > "$work/verl.in"

# No annotations: they name the temporary input file, and the check compares the whole file.
resolve() {  # resolve the inputs into $work/requirements.lock; extra arguments go to uv (the check's constraints)
  "${uv[@]}" pip compile pyproject.toml "$work/verl.in" scripts/gpu/pins.txt --extra gpu --extra test --extra envs \
    --python-platform "$PLATFORM" --python-version "$PYTHON_VERSION" --exclude-newer "$EXCLUDE_NEWER" \
    --no-annotate --custom-compile-command "bash scripts/gpu/lock.sh" --quiet -o "$work/requirements.lock" "$@"
}
stale="run bash scripts/gpu/lock.sh and commit it"

if [ "$mode" = write ]; then
  resolve
  cp "$work/requirements.lock" "$LOCK"
  echo "lock.sh: wrote $LOCK ($(grep -c '==' "$LOCK") pins; platform $PLATFORM, Python $PYTHON_VERSION, PyPI as of $EXCLUDE_NEWER)"
elif ! resolve --constraint "$LOCK"; then
  echo "lock.sh: $LOCK is not a resolution of the inputs (uv says why above); $stale" >&2
  exit 1
elif ! diff -u "$LOCK" "$work/requirements.lock"; then
  echo "lock.sh: $LOCK is not a full resolution of the inputs (+ a pin it lacks, - one no longer needed); $stale" >&2
  exit 1
else
  no_binary=()
  for package in $SOURCE_BUILDS; do no_binary+=(--no-binary "$package"); done
  if ! "${uv[@]}" pip compile "$LOCK" --no-deps --only-binary :all: "${no_binary[@]}" \
       --python-platform "$PLATFORM" --python-version "$PYTHON_VERSION" --exclude-newer "$EXCLUDE_NEWER" \
       --quiet -o "$work/wheels.txt"; then
    echo "lock.sh: a pin of $LOCK outside SOURCE_BUILDS has no wheel for $PLATFORM / Python $PYTHON_VERSION" >&2
    exit 1
  fi
  echo "lock.sh: $LOCK resolves as committed ($(grep -c '==' "$LOCK") pins; from source only: $SOURCE_BUILDS)"
fi
