# Shared by launch.sh and jobs.sh (sourced, not run): the run lock that lets one job at a time use a run.
#
# A job is one detached runner (written by launch.sh) running one or more stages of one run. While it
# lives, `python -m eagle_pipeline.locks hold` holds <run>/logs/run.lock for it: a flock, as every lock of the
# pipeline (eagle_pipeline/locks.py), released by the kernel however the job ends, whose record (JSON) names
#   pid, pgid        the holder (the runner's first process) and its process group: stop signals the whole
#                    group (runner, stage and its engine workers)
#   host, started, run, stages, config, command, launch
# and <code folder>/logs/jobs/<run name>.lock links to it while it is held, so `sync` can see every job of the
# folder.

# `python -m eagle_pipeline.locks ACTION LOCK [KEY]` (state, get, describe, clear: eagle_pipeline/locks.py), by the
# run's .venv, else by the system's Python (locks.py needs no package).
locktool() {
  if [ -x .venv/bin/python ]; then .venv/bin/python -m eagle_pipeline.locks "$@"; else python3 -m eagle_pipeline.locks "$@"; fi
}

# True while a live job holds lock FILE.
lock_live() {
  [ "$(locktool state "$1")" = live ]
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
