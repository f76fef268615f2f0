#!/usr/bin/env bash
# bash examples/webarena/run_webarena.sh [--dry-run] [--backup-dir D] [-- hydra overrides...]
#
# Trains on AgentGym's WebArena server (start it yourself; WEBARENA_URL in .env, default
# http://127.0.0.1:36005) through envservice; the settings are in examples/webarena/webarena.yaml.
# PYTHON picks the interpreter (default: the checkout's .venv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-.venv/bin/python}" launcher.py --conf examples/webarena/webarena.yaml --with-envservice "$@"
