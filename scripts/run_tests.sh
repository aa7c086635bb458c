#!/usr/bin/env bash
# Set up .venv (if needed) and run the test suite. Extra arguments go to pytest, e.g. -m "not vllm".
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
exec .venv/bin/python -m pytest "$@"
