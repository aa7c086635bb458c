#!/usr/bin/env bash
# Start one stage (or all) detached on this machine, logging under the run directory; returns at once.
#   scripts/launch.sh STAGE|all CONFIG [--set key=value ...]
# STAGE is a number (1..6) or a name (02_extract_hidden). Uses tmux when present, else nohup + setsid.
# Per stage it writes <run>/logs/<stage>.out (everything printed), .pid while running, .exit at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || { echo "usage: scripts/launch.sh STAGE|all CONFIG [--set key=value ...]" >&2; exit 2; }
which="$1"; config="$2"; shift 2
python=.venv/bin/python
[ -x "$python" ] || { echo "error: .venv is missing; run scripts/setup_env.sh first" >&2; exit 2; }
run_dir=$("$python" -c "import sys; from eagle_pipeline.config import load_config; print(load_config(sys.argv[1], sys.argv[2:]).run_dir)" "$config" "$@" 2>&1 | tail -n 1)
case "$run_dir" in /*) ;; *) echo "error: $run_dir" >&2; exit 2 ;; esac
stages=(01_generate_data 02_extract_hidden 03_build_vocab_map 04_train 05_convert 06_serve_test)
case "$which" in
  all) selected=("${stages[@]}") ;;
  [1-6]) selected=("${stages[$((which - 1))]}") ;;
  0[1-6]_*) selected=("$which") ;;
  *) echo "error: unknown stage '$which'; use 1..6, a stage name, or all" >&2; exit 2 ;;
esac
mkdir -p "$run_dir/logs"
runner="$run_dir/logs/launch-$(date -u +%Y%m%dT%H%M%S).sh"
{
  echo "#!/usr/bin/env bash"
  echo "cd $(printf %q "$PWD")"
  for stage in "${selected[@]}"; do
    log="$run_dir/logs/$stage"
    echo "rm -f $(printf %q "$log.exit"); echo \$\$ > $(printf %q "$log.pid")"
    printf '%q ' "$python" -u "$stage.py" --config "$config" "$@"
    echo "> $(printf %q "$log.out") 2>&1; code=\$?"
    echo "echo \$code > $(printf %q "$log.exit"); rm -f $(printf %q "$log.pid"); [ \$code -eq 0 ] || exit \$code"
  done
} > "$runner"
chmod +x "$runner"
session="eagle-$(basename "$run_dir")-$(date -u +%H%M%S)"
if command -v tmux >/dev/null 2>&1 && [ -z "${EAGLE_NO_TMUX:-}" ]; then
  tmux new-session -d -s "$session" "$runner"
  echo "started ${selected[*]} in tmux session $session; logs in $run_dir/logs/"
else
  nohup setsid "$runner" > "$run_dir/logs/launch.out" 2>&1 < /dev/null &
  echo "started ${selected[*]} with nohup (pid $!); logs in $run_dir/logs/"
fi
