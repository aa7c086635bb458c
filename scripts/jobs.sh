#!/usr/bin/env bash
# Job control on the GPU host, for scripts/remote.sh (or by hand in the code folder):
#   scripts/jobs.sh list                        # one line per live job started from this folder
#   scripts/jobs.sh busy [WHAT]                 # exit 2 with one error line while a job or setup runs
#   scripts/jobs.sh stop CONFIG [--set k=v ...] # stop the job holding the run's lock (SIGTERM, then SIGKILL)
#   scripts/jobs.sh setup [cpu|gpu]             # run setup_env.sh detached, logging to logs/setup-<time>.log
#   scripts/jobs.sh follow-setup                # follow the newest setup log until setup ends
# EAGLE_STOP_GRACE (default 30, 180 while stage 04 trains) is how many seconds stop waits after SIGTERM before SIGKILL.
# Exit codes: 0 done, 2 refused or bad arguments, 1 failed (a job that survived SIGKILL, a failed setup).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/joblock.sh
. scripts/joblock.sh
cmd="${1:-}"; shift || true

# Live jobs of this folder, one lock path a line; links whose job has ended are removed on the way.
live_locks() {
  local link
  for link in logs/jobs/*.lock; do
    [ -L "$link" ] || continue
    if lock_live "$link"; then readlink "$link"; else rm -f "$link"; fi
  done
}

setup_pid() {  # the pid of a running setup, or nothing
  [ -f logs/setup.pid ] && kill -0 "$(cat logs/setup.pid)" 2>/dev/null && cat logs/setup.pid
  return 0
}

case "$cmd" in
  list)
    live_locks | while read -r lock; do echo "$(locktool describe "$lock") lock $lock"; done
    pid=$(setup_pid); [ -z "$pid" ] || echo "setup (pid $pid, log $PWD/logs/setup.log)" ;;

  busy)
    # Syncing code or configs under a live job would change what its later stages import and read.
    what="${1:-refusing}"
    mapfile -t locks < <(live_locks)
    if [ ${#locks[@]} -gt 0 ]; then
      more=""; [ ${#locks[@]} -eq 1 ] || more=" (and $(( ${#locks[@]} - 1 )) more: scripts/jobs.sh list)"
      echo "error: $what: a job is running from $PWD: $(locktool describe "${locks[0]}")$more; wait for it or stop it with: scripts/remote.sh stop $(locktool get "${locks[0]}" config)" >&2
      exit 2
    fi
    pid=$(setup_pid)
    if [ -n "$pid" ]; then
      echo "error: $what: setup is running in $PWD (pid $pid); follow it with: scripts/remote.sh log setup" >&2
      exit 2
    fi ;;

  stop)
    [ $# -ge 1 ] || { echo "usage: scripts/jobs.sh stop CONFIG [--set key=value ...]" >&2; exit 2; }
    config="$1"
    run_dir=$(run_dir_of "$@") || exit 2
    lock="$run_dir/logs/run.lock"; run=$(basename "$run_dir")
    case "$(locktool state "$lock")" in
      free) echo "no job is running for run $run"; exit 0 ;;
      stale)
        echo "no job is running for run $run; cleared the stale lock of $(locktool describe "$lock")"
        locktool clear "$lock"; exit 0 ;;
    esac
    pid=$(locktool get "$lock" pid); pgid=$(locktool get "$lock" pgid)
    job=$(locktool describe "$lock")
    # The stage running now is the one whose .pid file names the runner.
    stage="no stage (between stages)"
    for f in "$run_dir"/logs/0*.pid; do
      [ -f "$f" ] && [ "$(cat "$f")" = "$pid" ] && stage=$(basename "$f" .pid)
    done
    # Signal the whole process group (runner, stage, its engine workers); a lock still held by the
    # launcher has no group of its own yet, so only that pid is signalled.
    target="$pid"; [ -z "$pgid" ] || target="-$pgid"
    alive() {  # any process of the target left, zombies (dead, waiting to be reaped) aside
      kill -0 -- "$target" 2>/dev/null || return 1
      command -v ps >/dev/null || return 0
      ps -e -o pid=,pgid=,stat= | awk -v p="$pid" -v g="$pgid" '(g == "" ? $1 == p : $2 == g) && $3 !~ /^Z/ {found = 1} END {exit !found}'
    }
    # Stage 04 answers SIGTERM by completing the checkpoint of an epoch whose training has ended (validation
    # and replay) before it stops (eagle_pipeline/train/stop.py); other stages stop in seconds.
    default_grace=30; [ "$stage" != 04_train ] || default_grace=180
    grace="${EAGLE_STOP_GRACE:-$default_grace}"
    echo "stopping $stage of run $run, job $job: SIGTERM, SIGKILL after ${grace}s"
    kill -TERM -- "$target" 2>/dev/null || true
    signal=SIGTERM
    for _ in $(seq 1 $(( grace * 5 ))); do alive || break; sleep 0.2; done
    if alive; then
      signal=SIGKILL
      kill -KILL -- "$target" 2>/dev/null || true
      for _ in $(seq 1 50); do alive || break; sleep 0.2; done
    fi
    if alive; then
      echo "error: $target is still alive after SIGKILL; check with: ps -eo pid,pgid,stat,args" >&2
      exit 1
    fi
    # After SIGTERM the runner released its lock and recorded the stage's exit code; after SIGKILL it
    # could not, so clean up here (status then shows the stage as interrupted). The kernel has released the
    # flock itself.
    if [ "$(locktool get "$lock" pid)" = "$pid" ]; then
      locktool clear "$lock" || true
      rm -f "$run_dir/logs/$stage.pid"
    fi
    code=""; [ ! -f "$run_dir/logs/$stage.exit" ] || code=", exit $(cat "$run_dir/logs/$stage.exit")"
    echo "stopped $stage of run $run with $signal$code; rerun the same stages to resume: scripts/remote.sh run STAGE|all $config" ;;

  setup)
    # Detached so an SSH drop does not kill pip halfway; setup_env.sh is idempotent (stamp file), so
    # running setup again after a failure or interruption continues where it stopped.
    mkdir -p logs
    pid=$(setup_pid)
    if [ -n "$pid" ]; then echo "setup is already running (pid $pid); log: $PWD/logs/setup.log"; exit 0; fi
    log="setup-$(date -u +%Y%m%dT%H%M%SZ).log"
    ln -sfn "$log" logs/setup.log
    rm -f logs/setup.exit
    # shellcheck disable=SC2016  # expanded by the detached bash, not here
    nohup setsid bash -c 'echo $$ > logs/setup.pid; scripts/setup_env.sh "$@"; code=$?
      echo "== setup_env.sh exited $code"; echo $code > logs/setup.exit; rm -f logs/setup.pid; exit $code' \
      setup "$@" > "logs/$log" 2>&1 < /dev/null &
    # Wait (up to 5 s) for the detached bash to record its pid, so `log setup` right after sees it running.
    for _ in $(seq 1 50); do
      if [ -f logs/setup.pid ] || [ -f logs/setup.exit ]; then break; fi
      sleep 0.1
    done
    echo "setup running detached (pid $!); log: $PWD/logs/$log" ;;

  follow-setup)
    [ -e logs/setup.log ] || { echo "error: no setup log yet in $PWD/logs; run: scripts/remote.sh setup" >&2; exit 2; }
    echo "== $PWD/logs/$(readlink logs/setup.log)"
    pid=$(setup_pid)
    if [ -n "$pid" ]; then tail -n +1 -F --pid="$pid" logs/setup.log 2>/dev/null; else tail -n 50 logs/setup.log; fi
    [ -f logs/setup.exit ] || { echo "setup has not finished (interrupted?); run: scripts/remote.sh setup" >&2; exit 1; }
    code=$(cat logs/setup.exit)
    [ "$code" = 0 ] || echo "error: setup failed (exit $code); fix the cause and run: scripts/remote.sh setup (it continues)" >&2
    [ "$code" = 0 ] || exit 1 ;;

  *)
    sed -n '2,8p' "$0"; exit 2 ;;
esac
