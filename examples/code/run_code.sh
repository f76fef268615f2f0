#!/usr/bin/env bash
# bash examples/code/run_code.sh [--dry-run] [--backup-dir D] [-- hydra overrides...]
#
# Serves code with envservice and trains on it; the settings are in examples/code/code.yaml, secrets and
# tracker keys in .env (see .env.example). PYTHON picks the interpreter (default: the checkout's .venv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-.venv/bin/python}" launcher.py --conf examples/code/code.yaml --with-envservice "$@"
