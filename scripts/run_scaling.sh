#!/usr/bin/env bash
# The drafter's acceptance against training data (and single changes at one size), on a finished pipeline run.
#   scripts/run_scaling.sh [CONFIG] --sizes 16,32,64,128,256,500 [--vary train.epochs=2,8] [--at N] [--set key=value ...]
# CONFIG (default configs/tiny.yaml) names the finished run: `scripts/run_pipeline.sh CONFIG` first.
# Each point trains one drafter and starts one vLLM server; finished points are kept across reruns.
set -euo pipefail
cd "$(dirname "$0")/.."
config=configs/tiny.yaml
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then config="$1"; shift; fi
scripts/setup_env.sh
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
exec .venv/bin/python -m bench.scaling --config "$config" "$@"
