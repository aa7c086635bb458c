#!/usr/bin/env bash
# Set up .venv (if needed) and run the test suite. Extra arguments go to pytest, e.g. -m "not vllm".
# Ends with the suite's wall time; pytest's own summary lists the slowest tests (pytest.ini: --durations).
# Two workers (pytest-xdist): most of the suite is vLLM engine starts, which keep one core busy each, so two
# at a time fill a 2-core machine. tests/conftest.py orders the test files for them, and one shared smoke
# run is built in the background while the tests that do not need it run. EAGLE_TEST_WORKERS=0 runs
# everything in this one process instead.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
start=$(date +%s)
status=0
.venv/bin/python -m pytest -n "${EAGLE_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@" || status=$?
echo "test suite finished in $(( $(date +%s) - start )) s on $(nproc) cores ($(grep -c avx512f /proc/cpuinfo || true) with AVX-512), exit $status"
exit $status
