#!/usr/bin/env bash
# Run every stage of the pipeline in order on one config (default: the embedded CPU config).
#   scripts/run_pipeline.sh [CONFIG] [--set key=value ...]
# Each stage skips work that is already finished, so rerunning after a failure resumes where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
config="${1:-configs/tiny.yaml}"
shift || true
scripts/setup_env.sh
export PYTHONUNBUFFERED=1
for stage in 01_generate_data 02_extract_hidden 03_build_vocab_map 04_train 05_convert 06_serve_test; do
  [ -f "$stage.py" ] || continue
  echo "=== $stage ($(date -u +%H:%M:%S))"
  start=$(date +%s)
  .venv/bin/python "$stage.py" --config "$config" "$@"
  echo "=== $stage finished in $(( $(date +%s) - start )) s"
done
