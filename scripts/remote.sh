#!/usr/bin/env bash
# Drive the pipeline on a GPU host over SSH from a laptop (or on this machine with EAGLE_HOST=local).
#   EAGLE_HOST=user@gpu-host scripts/remote.sh setup              # sync code, build .venv (GPU vLLM pinned)
#   EAGLE_HOST=user@gpu-host scripts/remote.sh sync               # copy the code (not .venv, not runs)
#   EAGLE_HOST=user@gpu-host scripts/remote.sh run all CONFIG     # all stages, detached (tmux or nohup)
#   EAGLE_HOST=user@gpu-host scripts/remote.sh run 2 CONFIG [--set k=v]   # one stage
#   EAGLE_HOST=user@gpu-host scripts/remote.sh log CONFIG [STAGE] # follow a stage's log (Ctrl-C stops following)
#   EAGLE_HOST=user@gpu-host scripts/remote.sh status CONFIG      # table of every stage from the manifests
# EAGLE_REMOTE_DIR (default eagle3-pipeline, relative to the remote home) is where the code lives there.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
host="${EAGLE_HOST:?set EAGLE_HOST=user@host (or EAGLE_HOST=local to act on this machine)}"
dir="${EAGLE_REMOTE_DIR:-eagle3-pipeline}"
cmd="${1:-}"; shift || true

on_host() {  # run a shell command in the code folder on the host
  if [ "$host" = local ]; then (mkdir -p "$dir" && cd "$dir" && bash -c "$1"); else ssh -o BatchMode=yes "$host" "mkdir -p $dir && cd $dir && $1"; fi
}
quote() { printf '%q ' "$@"; }

case "$cmd" in
  sync)
    # tar over ssh: needs nothing on either side beyond what every Linux host has.
    tar -C "$here" --exclude=./.venv --exclude=./runs --exclude=./.git --exclude=__pycache__ -cf - . \
      | if [ "$host" = local ]; then mkdir -p "$dir" && tar -C "$dir" -xf -; else ssh -o BatchMode=yes "$host" "mkdir -p $dir && tar -C $dir -xf -"; fi
    echo "synced $here -> $host:$dir" ;;
  setup)
    "$0" sync
    on_host "scripts/setup_env.sh ${1:-gpu}" ;;
  run)
    [ $# -ge 2 ] || { echo "usage: remote.sh run STAGE|all CONFIG [--set k=v ...]" >&2; exit 2; }
    "$0" sync
    on_host "scripts/launch.sh $(quote "$@")" ;;
  log)
    [ $# -ge 1 ] || { echo "usage: remote.sh log CONFIG [STAGE]" >&2; exit 2; }
    config="$1"; stage="${2:-}"
    on_host "run_dir=\$(.venv/bin/python -c 'import sys; from eagle_pipeline.config import load_config; print(load_config(sys.argv[1]).run_dir)' $(quote "$config")); \
      f=\$(ls -t \$run_dir/logs/${stage:+*$stage*}*.out 2>/dev/null | head -n 1); [ -n \"\$f\" ] || { echo 'no log yet' >&2; exit 2; }; \
      echo \"== \$f\"; tail -n 50 -F \"\$f\"" ;;
  status)
    [ $# -ge 1 ] || { echo "usage: remote.sh status CONFIG" >&2; exit 2; }
    on_host ".venv/bin/python scripts/status.py --config $(quote "$@")" ;;
  *)
    sed -n '2,9p' "$0"; exit 2 ;;
esac
