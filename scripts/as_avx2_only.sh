#!/usr/bin/env bash
# Run a command as an AVX2-only CPU would run it, on a CPU with AVX-512: e.g.
#   scripts/as_avx2_only.sh scripts/run_tests.sh
#   scripts/as_avx2_only.sh scripts/run_pipeline.sh configs/tiny-smoke.yaml
# Every Python process it starts then uses AVX2 kernels only: torch's (ATEN_CPU_CAPABILITY), oneDNN's
# (ONEDNN_MAX_CPU_ISA: no bf16 matmul, as on those CPUs), numpy's (NPY_DISABLE_CPU_FEATURES) and vLLM's
# (its _C_AVX2 library and the attention/MoE paths it picks for a CPU without AVX-512 or AMX; see
# avx2_only/sitecustomize.py). The hardware stays what it is (clock, caches, cores), so times measured
# this way are this machine's with AVX2 code, not another machine's (docs/engines.md, "Machines differ").
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
export PYTHONPATH="$here/avx2_only${PYTHONPATH:+:$PYTHONPATH}"
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
export NPY_DISABLE_CPU_FEATURES="AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR"
exec "$@"
