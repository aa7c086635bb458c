#!/usr/bin/env bash
# DFlash against EAGLE-3 on the same conversations (docs/benchmarks/families.md): the embedded default's pipeline
# for each family (configs/tiny.yaml, configs/tiny-dflash.yaml: the same stages 01-03), then each drafter served
# at concurrency 1 and 4 from its run's converted folder (serve.drafter) under its config's serve settings, the
# second reusing the first's run without speculation (serve.baseline), and the two side by side
# (scripts/compare_runs.py).
#   scripts/run_families.sh            # finished runs and served levels are kept across reruns
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/run_pipeline.sh configs/tiny.yaml
scripts/run_pipeline.sh configs/tiny-dflash.yaml
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
levels=(--set "serve.concurrency=[1,4]" --set data.num_eval_prompts=12)
.venv/bin/python 06_serve_test.py --config configs/tiny.yaml "${levels[@]}" --set run_name=families-eagle3 \
  --set serve.drafter=runs/tiny/05_convert/vllm
.venv/bin/python 06_serve_test.py --config configs/tiny-dflash.yaml "${levels[@]}" --set run_name=families-dflash \
  --set serve.drafter=runs/tiny-dflash/05_convert/vllm \
  --set serve.ngram_baseline=false --set serve.baseline=runs/families-eagle3/06_serve_test
.venv/bin/python scripts/compare_runs.py --run runs/families-eagle3 --run runs/families-dflash \
  --out docs/benchmarks/families.md
