#!/usr/bin/env bash
# Set up .venv (if needed) and run the test suite. Extra arguments go to pytest, e.g. -m "not vllm".
# Ends with the suite's wall time; pytest's own summary lists the slowest tests (pytest.ini: --durations).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
start=$(date +%s)
status=0
.venv/bin/python -m pytest "$@" || status=$?
echo "test suite finished in $(( $(date +%s) - start )) s on $(nproc) cores ($(grep -c avx512f /proc/cpuinfo || true) with AVX-512), exit $status"
exit $status
