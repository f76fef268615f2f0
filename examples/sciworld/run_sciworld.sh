#!/usr/bin/env bash
# bash examples/sciworld/run_sciworld.sh [--dry-run] [--backup-dir D] [-- hydra overrides...]
#
# Serves sciworld with envservice and trains on it; the settings are in examples/sciworld/sciworld.yaml, secrets and
# tracker keys in .env (see .env.example). PYTHON picks the interpreter (default: the checkout's .venv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-.venv/bin/python}" launcher.py --conf examples/sciworld/sciworld.yaml --with-envservice "$@"
