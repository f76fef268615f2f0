#!/usr/bin/env bash
# The README's test command: install (once; seconds when up to date), check the import layering
# (import-linter's contracts in pyproject.toml), then run the whole test suite.
#   bash scripts/test.sh [--fast] [pytest args]
#   --fast: everything but the end-to-end training runs (tests marked `training`) and the tests that start a
#           slow third-party program (`startup`: the session's vLLM server, JVMs, planners, Ray, Chromium, fresh
#           verl-importing processes, long fuzzing; tests/conftest.py says which), a few checks on a smaller
#           budget (BEYOND_TEST_FAST=1): the development loop, ~4.5 min on 2 cores (docs/tests.md). CI and the
#           README run it without the flag: everything.
# Tests run in BEYOND_TEST_WORKERS pytest-xdist workers (default 2, one per core of the CI machine, and 3 with
# --fast; 0: in this process), a file (or the files sharing a costly fixture) at a time, longest first (tests/conftest.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
fast=0
pytest_args=()
for arg in "$@"; do
  if [ "$arg" = --fast ]; then fast=1; pytest_args+=(-m "not training and not startup"); export BEYOND_TEST_FAST=1; else pytest_args+=("$arg"); fi
done
# Three workers in the fast loop: its tests wait on servers and timeouts often enough that a third worker on two
# cores finished it 14 % sooner (docs/tests.md); the full run's training runs want the memory of two.
workers="${BEYOND_TEST_WORKERS:-$((fast ? 3 : 2))}"
# One OpenMP thread per process: the workers already use the cores, and each starts torch processes (verl's SFT
# under torchrun, the tests' own models) whose two default threads then spin against the other worker's: an SFT
# step took 4.0 s with two threads and 1.06 s with one beside a busy core (docs/tests.md). Ray's actors and vLLM's
# CPU worker set their own.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
[ "$workers" = 0 ] || pytest_args=(-n "$workers" --dist loadfile --no-loadscope-reorder "${pytest_args[@]}")
bash scripts/install.sh
.venv/bin/lint-imports
# pytest rewrites the asserts of every test module and of its plugins' whole packages (hypothesis, hydra,
# schemathesis...: ~450 modules, 9 s of each worker's collection) and caches the result as .pyc files, unless
# PYTHONDONTWRITEBYTECODE is set (as on the CI and development machines): let it cache them (and our own
# modules' .pyc, for the hundreds of processes the tests start). The files are git-ignored `__pycache__`s.
unset PYTHONDONTWRITEBYTECODE
exec .venv/bin/python -m pytest "${pytest_args[@]}"
