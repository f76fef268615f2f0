#!/usr/bin/env bash
# The README's test command: install (once; seconds when up to date), then run the whole test suite.
#   bash scripts/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest "$@"
