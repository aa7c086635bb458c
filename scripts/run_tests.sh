#!/usr/bin/env bash
# Set up .venv (if needed) and run the test suite; extra arguments go to pytest.
#   scripts/run_tests.sh                  # the suite: everything but the `heavy` tier (what CI runs)
#   scripts/run_tests.sh -m "not slow"    # the developer loop: no test over a minute, no shared smoke run
#   scripts/run_tests.sh -m "not vllm"    # no real vLLM engine at all
#   EAGLE_TEST_TIER=all scripts/run_tests.sh   # also the `heavy` tier, which the suite leaves out (docs/testing.md)
# Two pytest-xdist workers, each held to its own core (tests/conftest.py), each taking whole test files;
# EAGLE_TEST_WORKERS=0 runs everything in this one process. pytest's summary lists the slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup_env.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
tier=(-m "not heavy")  # a -m of the caller's comes later and wins
[[ "${EAGLE_TEST_TIER:-}" == all ]] && tier=()
.venv/bin/python -m pytest -n "${EAGLE_TEST_WORKERS:-2}" --dist loadfile ${tier[@]+"${tier[@]}"} "$@"
