#!/usr/bin/env bash
# Run every stage of the pipeline in order on one config (default: the embedded CPU config).
#   scripts/run_pipeline.sh [CONFIG] [--set key=value ...]
# Each stage skips work that is already finished, so rerunning after a failure resumes where it stopped.
# Ends with one table of every stage's state, wall time, target starts and key figures (scripts/status.py).
set -euo pipefail
cd "$(dirname "$0")/.."
config="${1:-configs/tiny.yaml}"
shift || true
scripts/setup_env.sh
export PYTHONUNBUFFERED=1
# A dry run plans every stage on any host: what this host lacks (GPUs, software) is said once, at the end.
case " $* " in *" --dry-run "*) export EAGLE_DRY_RUN_HOST=later ;; esac
stages=$(.venv/bin/python -c "from eagle_pipeline.stage import STAGES; print(*STAGES.values())")
for stage in $stages; do
  [ -f "$stage.py" ] || continue
  echo "=== $stage ($(date -u +%H:%M:%S))"
  start=$(date +%s)
  .venv/bin/python "$stage.py" --config "$config" "$@"
  echo "=== $stage finished in $(( $(date +%s) - start )) s"
done
# The summary reads the same config, with the same --set overrides (the stages' other flags are not its own).
overrides=(); plan=()
while [ $# -gt 0 ]; do
  case "$1" in
    --set) overrides+=(--set "$2"); shift 2 ;;
    --set=*) overrides+=("$1"); shift ;;
    --dry-run) plan=(--plan); shift ;;
    *) shift ;;
  esac
done
echo "=== $([ ${#plan[@]} -eq 0 ] && echo summary || echo "target cold starts and disk planned")"
.venv/bin/python scripts/status.py --config "$config" "${overrides[@]}" "${plan[@]}"
