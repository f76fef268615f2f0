#!/usr/bin/env bash
# The README's test command: install (once; seconds when up to date), check the import layering
# (import-linter's contracts in pyproject.toml), then run the whole test suite.
#   bash scripts/test.sh [--fast] [pytest args]
#   --fast: everything but the end-to-end training runs (tests marked `training`), a few checks on a smaller
#           budget (BEYOND_TEST_FAST=1): the development loop (docs/tests.md). CI and the README run it
#           without the flag: everything.
# Tests run in BEYOND_TEST_WORKERS pytest-xdist workers (default 2, one per core of the CI machine; 0: in this
# process), a file (or the files sharing a costly fixture) at a time, longest first (tests/conftest.py).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
workers="${BEYOND_TEST_WORKERS:-2}"
pytest_args=()
[ "$workers" = 0 ] || pytest_args+=(-n "$workers" --dist loadfile --no-loadscope-reorder)
for arg in "$@"; do
  if [ "$arg" = --fast ]; then pytest_args+=(-m "not training"); export BEYOND_TEST_FAST=1; else pytest_args+=("$arg"); fi
done
bash scripts/install.sh
.venv/bin/lint-imports
exec .venv/bin/python -m pytest "${pytest_args[@]}"
