#!/usr/bin/env bash
# Set up .venv (if needed) and run the test suite; extra arguments go to pytest.
#   scripts/run_tests.sh                  # everything (what CI runs)
#   scripts/run_tests.sh -m "not slow"    # the developer loop: no test over a minute, no shared smoke run
#   scripts/run_tests.sh -m "not vllm"    # no real vLLM engine at all
# Two pytest-xdist workers, each held to its own core (tests/conftest.py), each taking whole test files;
# EAGLE_TEST_WORKERS=0 runs everything in this one process. pytest's summary lists the slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
.venv/bin/python -m pytest -n "${EAGLE_TEST_WORKERS:-2}" --dist loadfile "$@"
