#!/usr/bin/env bash
# The README's main job: install (once; seconds when up to date), then train the tiny model on BabyAI on
# CPU through the launcher: envservice, the tiny model, the task files, 2 GRPO steps of BeyondAgentTrainer
# with a checkpoint, everything recorded in outputs/experiments/. 5-10 minutes and ~8 GB on 2 cores.
#   bash scripts/quickstart.sh [--dry-run] [-- hydra overrides...]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/install.sh
exec .venv/bin/python launcher.py --conf examples/quickstart/cpu_tiny.yaml --with-envservice "$@"
