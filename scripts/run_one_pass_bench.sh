#!/usr/bin/env bash
# Stages 01 + 02 in one pass (configs/tiny-one-pass.yaml) against two passes (configs/tiny.yaml) on the same
# prompts, one after the other on this machine, in fresh run folders: docs/benchmarks/one_pass.md.
#   scripts/run_one_pass_bench.sh [--set data.num_samples=N]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(mktemp -d /tmp/one-pass-bench.XXXX)
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
for config in tiny tiny-one-pass; do
  for stage in 01_generate_data 02_extract_hidden; do
    start=$SECONDS
    .venv/bin/python "$stage.py" --config "configs/$config.yaml" --set "data_root=$root" "$@" \
      > "$root/$config-$stage.log"
    echo "$config $stage $((SECONDS - start))" | tee -a "$root/walls.txt"
  done
done
.venv/bin/python - "$root" "$*" <<'PY'
import json, sys
from pathlib import Path
from eagle_pipeline import atomic
root, extra = Path(sys.argv[1]), sys.argv[2]
walls = {tuple(line.split()[:2]): float(line.split()[2]) for line in (root / "walls.txt").read_text().splitlines()}
def figures(run):
    manifests = {stage: json.loads((root / run / stage / "manifest.json").read_text())
                 for stage in ("01_generate_data", "02_extract_hidden")}
    counts = manifests["01_generate_data"]["counts"]
    starts = sum((m.get("engine_starts") or {}).get("target_starts", 0) for m in manifests.values())
    return counts["samples"], counts["completion_tokens"], starts
rows, total = [], {}
for run, name in (("tiny", "two passes"), ("tiny-one-pass", "one pass")):
    samples, tokens, starts = figures(run)
    w1, w2 = walls[(run, "01_generate_data")], walls[(run, "02_extract_hidden")]
    total[run] = w1 + w2
    rows.append(f"| {name} | {samples} | {tokens:,} | {starts} | {w1:.0f} | {w2:.0f} | {w1 + w2:.0f} |")
text = "\n".join([
    "# One pass against two: stages 01 + 02 on the embedded default", "",
    f"Regenerate: `{' '.join(['scripts/run_one_pass_bench.sh', *extra.split()])}` (this machine, one run; wall "
    "seconds of each stage's command, engine start included).", "",
    "| capture | samples | answer tokens | target starts | stage 01 s | stage 02 s | 01 + 02 s |",
    "|---|---|---|---|---|---|---|",
    *rows, "", f"One pass over two passes: {total['tiny-one-pass'] / total['tiny']:.2f}x the wall time. What it costs "
    "on the GPU host, on paper: docs/one_pass.md, \"Cost\".", ""])
atomic.write_text(Path("docs/benchmarks/one_pass.md"), text)
print(text)
PY
