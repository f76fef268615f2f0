#!/usr/bin/env bash
# bash examples/alfworld/run_alfworld_m2po_delta.sh [--dry-run] [--backup-dir D] [-- hydra overrides...]
#
# Serves alfworld with envservice and trains it with the AgentBench seed's recipe (M2PO, async rollout, delta
# weight sync); the settings are in examples/alfworld/alfworld_m2po_delta.yaml, secrets and tracker keys in .env
# (see .env.example). PYTHON picks the interpreter (default: the checkout's .venv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-.venv/bin/python}" launcher.py --conf examples/alfworld/alfworld_m2po_delta.yaml --with-envservice "$@"
