#!/usr/bin/env bash
# bash examples/appworld/run_appworld.sh [--dry-run] [--backup-dir D] [-- hydra overrides...]
#
# Serves AppWorld (in its own environment when APPWORLD_ACTIVATION is set) and trains on it; the settings
# are in examples/appworld/appworld.yaml, secrets and
# tracker keys in .env (see .env.example). PYTHON picks the interpreter (default: the checkout's .venv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-.venv/bin/python}" launcher.py --conf examples/appworld/appworld.yaml --with-appworld "$@"
