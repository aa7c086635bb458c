#!/usr/bin/env bash
# Drive the pipeline on a GPU host over SSH from a laptop (or on this machine with EAGLE_HOST=local).
#   EAGLE_HOST=user@gpu-host scripts/remote.sh setup [cpu|gpu] [--config CONFIG] [--follow]  # sync, check, build .venv detached
#   EAGLE_HOST=user@gpu-host scripts/remote.sh sync [--configs]   # copy the code; configs only where the host has none
#   EAGLE_HOST=user@gpu-host scripts/remote.sh run all CONFIG     # sync, then all stages detached (tmux or nohup)
#   EAGLE_HOST=user@gpu-host scripts/remote.sh run 2 CONFIG [--set k=v]   # one stage (--no-sync: skip the sync)
#   EAGLE_HOST=user@gpu-host scripts/remote.sh stop CONFIG        # stop the job: SIGTERM, SIGKILL after 30 s (stage 04: 180 s)
#   EAGLE_HOST=user@gpu-host scripts/remote.sh log CONFIG [STAGE] # follow a stage's log (Ctrl-C stops following)
#   EAGLE_HOST=user@gpu-host scripts/remote.sh log setup          # follow the setup log until setup ends
#   EAGLE_HOST=user@gpu-host scripts/remote.sh status CONFIG      # every stage: state, wall time, target starts, figures
#   EAGLE_HOST=user@gpu-host scripts/remote.sh capture CONFIG [--port P] [--set k=v]  # sync, then a capture server
#                                                                 # for online training on another host, detached
#   EAGLE_HOST=user@gpu-host scripts/remote.sh capture-stop CONFIG  # stop that capture server
# EAGLE_REMOTE_DIR (default eagle3-pipeline, relative to the remote home) is where the code lives there.
# One job per run: a second `run` of a run that is still running is refused, and sync (so also run and
# setup) is refused while any job started from that folder runs. Configs edited on the host are kept;
# `sync --configs` overwrites them. EAGLE_STOP_GRACE sets stop's SIGTERM-to-SIGKILL wait in seconds.
# Exit codes: 0 done, 2 refused or bad arguments (one `error:` line), 1 failed.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
cmd="${1:-}"; shift || true
commands="setup, sync, run, stop, log, status, capture, capture-stop"
case "$cmd" in
  help|-h|--help) sed -n '2,18p' "$0"; exit 0 ;;
  "") echo "error: no command given; one of $commands (scripts/remote.sh help shows their arguments)" >&2; exit 2 ;;
  setup|sync|run|stop|log|status|capture|capture-stop) ;;
  *) echo "error: unknown command '$cmd'; one of $commands (scripts/remote.sh help shows their arguments)" >&2; exit 2 ;;
esac
if [ -z "${EAGLE_HOST:-}" ]; then
  echo "error: EAGLE_HOST is not set; set EAGLE_HOST=user@host (or EAGLE_HOST=local to act on this machine)" >&2; exit 2
fi
host="$EAGLE_HOST"
dir="${EAGLE_REMOTE_DIR:-eagle3-pipeline}"

on_host() {  # run a shell command in the code folder on the host (stdin passes through)
  if [ "$host" = local ]; then (mkdir -p "$dir" && cd "$dir" && bash -c "$1"); else ssh -o BatchMode=yes "$host" "mkdir -p $dir && cd $dir && ( $1 )"; fi
}
quote() { printf '%q ' "$@"; }

# Copy each local configs/ file (arriving as a tar on stdin) to the host only where the host has none, or
# where it differs and $overwrite is 1: the README has users edit verifier.path and data.prompts there.
# Runs on the host; it is plain sh so an old or missing copy of the code there does not matter.
# shellcheck disable=SC2016  # expanded on the host
merge_configs='rm -rf .sync && mkdir -p .sync && tar -C .sync -xf - && (cd .sync && find configs -type f) | sort |
  while read -r f; do
    if [ ! -e "$f" ]; then mkdir -p "$(dirname "$f")" && cp -p ".sync/$f" "$f" && echo "added $f"
    elif cmp -s ".sync/$f" "$f"; then :
    elif [ "$overwrite" = 1 ]; then cp -p ".sync/$f" "$f" && echo "overwrote host'"'"'s $f"
    else echo "kept host'"'"'s $f (differs from local); pass --configs to overwrite"; fi
  done; rm -rf .sync'

# Runs on the host: whether process $1 lives (a zombie no parent reaps does not count).
capture_running='running() { [ -r /proc/$1/stat ] && [ "$(sed "s/.*) //" /proc/$1/stat | cut -d" " -f1)" != Z ]; }'

case "$cmd" in
  sync)
    overwrite=0
    case "${1:-}" in --configs) overwrite=1 ;; "") ;; *) echo "error: usage: remote.sh sync [--configs]" >&2; exit 2 ;; esac
    # Never change code or configs under a live job: its later stages would run code it did not start with.
    on_host '[ ! -x scripts/jobs.sh ] || scripts/jobs.sh busy "not syncing"'
    # tar over ssh: needs nothing on either side beyond what every Linux host has. Host-side state
    # (.venv, runs, logs, configs) is left out; configs follow separately so host edits survive.
    tar -C "$here" --exclude=./.venv --exclude=./runs --exclude=./.git --exclude=./logs --exclude=./.sync \
      --exclude=./configs --exclude=__pycache__ -cf - . | on_host "tar -xf -"
    tar -C "$here" -cf - configs | on_host "overwrite=$overwrite; $merge_configs"
    echo "synced $here -> $host:$dir" ;;

  setup)
    kind=""; follow=0; config=""
    while [ $# -gt 0 ]; do
      case "$1" in
        --follow) follow=1 ;;
        cpu|gpu) kind="$1" ;;
        # The GPU preflight checks that torch sees the GPUs this config (a path on the host) uses.
        --config) [ $# -ge 2 ] || { echo "error: usage: remote.sh setup [cpu|gpu] [--config CONFIG] [--follow]" >&2; exit 2; }
                  config=" --config $(quote "$2")"; shift ;;
        *) echo "error: usage: remote.sh setup [cpu|gpu] [--config CONFIG] [--follow]" >&2; exit 2 ;;
      esac
      shift
    done
    "$0" sync
    on_host "scripts/jobs.sh setup ${kind:-gpu}$config"
    if [ "$follow" = 1 ]; then on_host "scripts/jobs.sh follow-setup"; else echo "follow it with: scripts/remote.sh log setup"; fi ;;

  run)
    sync=1; [ "${1:-}" != --no-sync ] || { sync=0; shift; }
    [ $# -ge 2 ] || { echo "error: usage: remote.sh run [--no-sync] STAGE|all CONFIG [--set k=v ...]" >&2; exit 2; }
    [ "$sync" = 0 ] || "$0" sync
    on_host "scripts/launch.sh $(quote "$@")" ;;

  stop)
    [ $# -ge 1 ] || { echo "error: usage: remote.sh stop CONFIG [--set k=v ...]" >&2; exit 2; }
    on_host "scripts/jobs.sh stop $(quote "$@")" ;;

  log)
    [ $# -ge 1 ] || { echo "error: usage: remote.sh log CONFIG [STAGE] | remote.sh log setup" >&2; exit 2; }
    if [ "$1" = setup ]; then on_host "scripts/jobs.sh follow-setup"; exit; fi
    config="$1"; stage="${2:-}"
    on_host "run_dir=\$(.venv/bin/python -c 'import sys; from eagle_pipeline.config import load_config; print(load_config(sys.argv[1]).run_dir)' $(quote "$config")); \
      f=\$(ls -t \$run_dir/logs/${stage:+*$stage*}*.out 2>/dev/null | head -n 1); [ -n \"\$f\" ] || { echo 'no log yet' >&2; exit 2; }; \
      echo \"== \$f\"; tail -n 50 -F \"\$f\"" ;;

  status)
    [ $# -ge 1 ] || { echo "error: usage: remote.sh status CONFIG" >&2; exit 2; }
    on_host ".venv/bin/python scripts/status.py --config $(quote "$@")" ;;

  capture)
    # A vLLM capture server for a trainer on another host (hidden_states.mode: online, docs/online.md); its log says
    # the endpoint to put in hidden_states.capture_endpoints there.
    [ $# -ge 1 ] || { echo "error: usage: remote.sh capture CONFIG [--port P] [--set k=v ...]" >&2; exit 2; }
    config="$1"; shift
    name="$(basename "$config" .yaml)"; extra=""
    [ $# -eq 0 ] || extra="$(quote "$@")"
    "$0" sync
    on_host "$capture_running; mkdir -p logs && pid=logs/capture-$name.pid && log=logs/capture-$name.log && \
      if [ -f \$pid ] && running \$(cat \$pid); then \
        echo \"error: a capture server of $config already runs on $host (pid \$(cat \$pid)); remote.sh capture-stop $config first\" >&2; exit 2; fi; \
      setsid nohup .venv/bin/python -m eagle_pipeline.online.serve_capture --config $(quote "$config") $extra > \$log 2>&1 < /dev/null & \
      echo \$! > \$pid; echo \"capture server of $config starting on $host (pid \$!); its endpoint appears in \$log once it serves\"" ;;

  capture-stop)
    [ $# -eq 1 ] || { echo "error: usage: remote.sh capture-stop CONFIG" >&2; exit 2; }
    name="$(basename "$1" .yaml)"
    # SIGTERM to its process group: the capture server stops vLLM (and a Mooncake master and store it started).
    on_host "$capture_running; pid=logs/capture-$name.pid; if [ -f \$pid ] && running \$(cat \$pid); then \
        kill -TERM -- -\$(cat \$pid); rm -f \$pid; echo \"stopped the capture server of $1 on $host\"; \
      else rm -f \$pid; echo \"error: no capture server of $1 runs on $host\" >&2; exit 2; fi" ;;

esac
