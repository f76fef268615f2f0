#!/usr/bin/env bash
# The README's test command: install (once; seconds when up to date), check the import layering
# (import-linter's contracts in pyproject.toml), then run the whole test suite.
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
.venv/bin/lint-imports
exec .venv/bin/python -m pytest "$@"
