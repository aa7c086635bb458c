#!/usr/bin/env bash
# Start one stage (or all) detached on this machine, logging under the run directory; returns at once.
#   scripts/launch.sh STAGE|all CONFIG [--set key=value ...]
# STAGE is a number (1..6) or a name (02_extract_hidden). Uses tmux when present, else nohup + setsid.
# Per stage it writes <run>/logs/<stage>.out (everything printed), .pid while running, .exit at the end.
# One job per run: the detached runner holds <run>/logs/run.lock (a flock, eagle_pipeline/locks.py) until it
# exits (success, failure or scripts/jobs.sh stop); a second launch is refused while it lives. A record left
# by a job that ended without releasing it (SIGKILL, reboot) is stale and is taken over with a note.
# Exit codes: 0 started, 2 refused (bad arguments, no .venv, setup still running, run already running).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/joblock.sh
. scripts/joblock.sh
[ $# -ge 2 ] || { echo "usage: scripts/launch.sh STAGE|all CONFIG [--set key=value ...]" >&2; exit 2; }
which="$1"; config="$2"; shift 2
python=.venv/bin/python
if [ -f logs/setup.pid ] && kill -0 "$(cat logs/setup.pid)" 2>/dev/null; then
  echo "error: setup is still running (pid $(cat logs/setup.pid), log $PWD/logs/setup.log); start the run when it has finished" >&2
  exit 2
fi
[ -x "$python" ] || { echo "error: .venv is missing; run scripts/setup_env.sh first" >&2; exit 2; }
run_dir=$(run_dir_of "$config" "$@") || exit 2
read -r -a stages <<< "$("$python" -c "from eagle_pipeline.stage import STAGES; print(*STAGES.values())")"
case "$which" in
  all) selected=("${stages[@]}") ;;
  [1-6]) selected=("${stages[$((which - 1))]}") ;;
  0[1-6]_*) selected=("$which") ;;
  *) echo "error: unknown stage '$which'; use 1..6, a stage name, or all" >&2; exit 2 ;;
esac
mkdir -p "$run_dir/logs" logs/jobs
lock="$run_dir/logs/run.lock"
link="$PWD/logs/jobs/$(printf %s "$run_dir" | tr -c 'A-Za-z0-9._-' _).lock"  # sync looks here for live jobs

refuse_running() {
  echo "error: run $(basename "$run_dir") is already running: $(locktool describe "$lock"); stop it with: scripts/remote.sh stop $(locktool get "$lock" config) (on the host: scripts/jobs.sh stop $(locktool get "$lock" config))" >&2
  exit 2
}

# A live holder means the GPUs are busy with this run: refuse. A dead one left its record behind (SIGKILL,
# reboot): say so; the runner takes the lock over, and the stages resume from their own manifests.
case "$(locktool state "$lock")" in
  live) refuse_running ;;
  stale) echo "note: taking over the stale lock of $(locktool describe "$lock"), which is no longer running" >&2 ;;
esac

# The runner takes the lock itself (`python -m eagle_pipeline.locks hold`, which runs the runner again under it):
# of two launches at once, one runner gets it and the other launcher refuses, naming that job.
launch="$$-$(date -u +%s%N)"
runner="$run_dir/logs/launch-$(date -u +%Y%m%dT%H%M%S)-$$.sh"
rm -f "$runner.started"
{
  echo "#!/usr/bin/env bash"
  echo "# Written by scripts/launch.sh: runs ${selected[*]} of $config while holding $lock."
  echo "cd $(printf %q "$PWD")"
  echo "if [ -z \"\${EAGLE_RUN_LOCK_HELD:-}\" ]; then"
  printf '  EAGLE_RUN_LOCK_HELD=1 exec %q -m eagle_pipeline.locks hold %q --link %q ' "$python" "$lock" "$link"
  printf '%q ' "run=$(basename "$run_dir")" "stages=${selected[*]}" "config=$config" "launch=$launch" \
    "command=scripts/launch.sh $(printf '%q ' "$which" "$config" "$@")"
  echo "-- \"\$0\""
  echo "fi"
  echo "# The lock's holder (this process's parent) is the job's pid: the stages' .pid files name it."
  echo "job=\$PPID; echo \$job > $(printf %q "$runner.started")"
  echo "# A signal (scripts/jobs.sh stop sends SIGTERM to the group) reaches the stage too; bash runs the trap"
  echo "# once the stage has exited, so its exit code is still recorded and no further stage starts."
  echo "stopped=; trap 'stopped=TERM' TERM; trap 'stopped=INT' INT; trap 'stopped=HUP' HUP"
  for stage in "${selected[@]}"; do
    log="$run_dir/logs/$stage"
    echo "[ -z \"\$stopped\" ] || exit 143"
    echo "rm -f $(printf %q "$log.exit"); echo \$job > $(printf %q "$log.pid")"
    printf '%q ' "$python" -u "$stage.py" --config "$config" "$@"
    echo "> $(printf %q "$log.out") 2>&1; code=\$?"
    echo "echo \$code > $(printf %q "$log.exit"); rm -f $(printf %q "$log.pid")"
    echo "[ -z \"\$stopped\" ] || { echo \"== stopped by SIG\$stopped (exit \$code); rerun to resume\" >> $(printf %q "$log.out"); exit 143; }"
    echo "[ \$code -eq 0 ] || exit \$code"
  done
} > "$runner"
chmod +x "$runner"

session="eagle-$(basename "$run_dir")-$(date -u +%H%M%S)"
if command -v tmux >/dev/null 2>&1 && [ -z "${EAGLE_NO_TMUX:-}" ]; then
  tmux new-session -d -s "$session" "$runner"
  how="in tmux session $session"
else
  nohup setsid "$runner" > "$run_dir/logs/launch.out" 2>&1 < /dev/null &
  how="with nohup"
fi

# Return once the runner holds the lock, so the next command (a second run, stop, sync) sees the job; refuse
# when another launch's runner got it first.
for _ in $(seq 1 100); do
  [ ! -f "$runner.started" ] || break
  if lock_live "$lock" && [ "$(locktool get "$lock" launch)" != "$launch" ]; then refuse_running; fi
  sleep 0.1
done
if [ ! -f "$runner.started" ]; then
  echo "error: the runner $runner did not start within 10 s; see $run_dir/logs/launch.out" >&2
  exit 1
fi
echo "started ${selected[*]} $how (pid $(cat "$runner.started")); logs in $run_dir/logs/"
rm -f "$runner.started"
