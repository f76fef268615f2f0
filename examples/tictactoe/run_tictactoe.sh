#!/usr/bin/env bash
# bash examples/tictactoe/run_tictactoe.sh [--dry-run] [--backup-dir D] [-- hydra overrides...]
#
# Serves tictactoe with envservice and trains the model against itself on it; the settings are in
# examples/tictactoe/tictactoe.yaml, secrets and tracker keys in .env (see .env.example). PYTHON picks the
# interpreter (default: the checkout's .venv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-.venv/bin/python}" launcher.py --conf examples/tictactoe/tictactoe.yaml --with-envservice "$@"
