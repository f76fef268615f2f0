#!/usr/bin/env bash
# bash examples/terminal/run_terminal.sh [--dry-run] [--backup-dir D] [-- hydra overrides...]
#
# Serves terminal with envservice and trains on it; the settings are in examples/terminal/terminal.yaml, secrets and
# tracker keys in .env (see .env.example). PYTHON picks the interpreter (default: the checkout's .venv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-.venv/bin/python}" launcher.py --conf examples/terminal/terminal.yaml --with-envservice "$@"
