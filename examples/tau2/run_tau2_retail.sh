#!/usr/bin/env bash
# bash examples/tau2/run_tau2_retail.sh [--dry-run] [--backup-dir D] [-- hydra overrides...]
#
# Serves tau2_retail with envservice and trains on it; settings in examples/tau2/tau2_retail.yaml, secrets and
# tracker keys in .env (see .env.example). PYTHON picks the interpreter (default: the checkout's .venv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-.venv/bin/python}" launcher.py --conf examples/tau2/tau2_retail.yaml --with-envservice "$@"
