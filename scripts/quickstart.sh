#!/usr/bin/env bash
# The README's main job: install (once; seconds when up to date), then run the CPU quickstart.
#   bash scripts/quickstart.sh [quickstart args]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
exec .venv/bin/python -m recipe.beyond_agent.quickstart "$@"
