#!/usr/bin/env bash
# bash examples/webshop/run_webshop_m2po_delta.sh [--dry-run] [--backup-dir D] [-- hydra overrides...]
#
# Trains on AgentGym's WebShop server (start it yourself; WEBSHOP_URL in .env, default
# http://127.0.0.1:36001) through envservice with the AgentBench seed's recipe (M2PO, async rollout, delta
# weight sync); the settings are in examples/webshop/webshop_m2po_delta.yaml.
# PYTHON picks the interpreter (default: the checkout's .venv).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
exec "${PYTHON:-.venv/bin/python}" launcher.py --conf examples/webshop/webshop_m2po_delta.yaml --with-envservice "$@"
