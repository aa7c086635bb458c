#!/usr/bin/env bash
# Reproduce every figure of BENCHMARKS.md on a finished pipeline run and rewrite the file; bench/run.py says what
# each mode does, how long it takes and when it exits 1.
#   scripts/run_benchmarks.sh [CONFIG] [--quick] [--set key=value ...] [--out FILE]
# CONFIG (default configs/tiny.yaml) names the finished run: `scripts/run_pipeline.sh CONFIG` first.
# The check that every part still runs, on the smallest finished run:
#   scripts/run_pipeline.sh configs/tiny-smoke.yaml && scripts/run_benchmarks.sh configs/tiny-smoke.yaml --quick
set -euo pipefail
cd "$(dirname "$0")/.."
config=configs/tiny.yaml
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then config="$1"; shift; fi
scripts/setup_env.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
exec .venv/bin/python -m bench.run --config "$config" "$@"
