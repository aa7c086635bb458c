# Shared by launch.sh and jobs.sh (sourced, not run): the run lock that lets one job at a time use a run.
#
# A job is one detached runner (written by launch.sh) running one or more stages of one run. While it
# lives it holds <run>/logs/run.lock, a file of key=value lines:
#   pid, pid_start   the runner's pid and its start time (so a pid reused after a reboot is not "alive")
#   pgid             its process group: stop signals the whole group (stage + its engine workers)
#   host, started, stages, config, command, runner
# and <code folder>/logs/jobs/<run name>.lock links to it, so `sync` can see every job of the folder.

# The start time of a process (clock ticks since boot, from /proc), empty where /proc has none.
proc_start() {
  [ -r "/proc/$1/stat" ] || return 0
  sed 's/^.*) //' "/proc/$1/stat" | cut -d' ' -f20
}

# The process group of a process, from /proc (empty where /proc has none).
proc_pgid() {
  [ -r "/proc/$1/stat" ] || return 0
  sed 's/^.*) //' "/proc/$1/stat" | cut -d' ' -f3
}

# The value of KEY in lock FILE (empty when missing).
lock_get() {
  sed -n "s/^$2=//p" "$1" 2>/dev/null | head -n 1
}

# True while the process named in lock FILE is the one that took it.
lock_live() {
  local pid start
  pid=$(lock_get "$1" pid)
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  start=$(lock_get "$1" pid_start)
  [ -z "$start" ] || [ "$start" = "$(proc_start "$pid")" ]
}

# One line naming the job in lock FILE, for refusals and reports.
lock_describe() {
  echo "stages $(lock_get "$1" stages) of $(lock_get "$1" config) (pid $(lock_get "$1" pid) on $(lock_get "$1" host), started $(lock_get "$1" started))"
}

# The run directory of CONFIG with the stage options that follow it (--set k=v, --force, --dry-run).
# Prints an `error:` line and fails when the config does not load.
run_dir_of() {
  local out
  out=$(.venv/bin/python -c "import sys
from eagle_pipeline.config import load_config
from eagle_pipeline.errors import BadInput
from eagle_pipeline.stage import parse_args
a = parse_args('', ['--config', *sys.argv[1:]])
try:
    print(load_config(a.config, a.overrides).run_dir)
except BadInput as e:
    print(f'error: {e}')" "$@" 2>&1 | tail -n 1)
  case "$out" in
    /*) echo "$out" ;;
    error:*) echo "$out" >&2; return 2 ;;
    *) echo "error: $out" >&2; return 2 ;;
  esac
}
