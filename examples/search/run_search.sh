#!/usr/bin/env bash
# bash examples/search/run_search.sh [--dry-run] [--backup-dir D] [-- hydra overrides...]
#
# Serves search with envservice and trains on it; the settings are in examples/search/search.yaml, secrets and
# tracker keys in .env (see .env.example). PYTHON picks the interpreter (default: the checkout's .venv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-.venv/bin/python}" launcher.py --conf examples/search/search.yaml --with-envservice "$@"
