"""What a finished benchmark must hold: every part measured something, and every figure of the document is
a number beside its baseline (bench.run fails on what is missing rather than publish a '-')."""

from __future__ import annotations

import re
from typing import Any

# The two capture sides take the same layers of the same model, so they differ by rounding only
# (docs/layer_ids.md); a layer off or another model's states differ by far more.
MAX_CAPTURE_RELATIVE_ERROR = 0.03
# fp8 stores one byte per value and bf16 two; token ids and file headers move the ratio a little off 0.5.
FP8_OVER_BF16_BYTES = (0.4, 0.6)
SERVED_MODES = {"serving": ("none", "ngram", "eagle3"), "storage_serving": ("eagle3-bf16", "eagle3-fp8")}
HEADINGS = ("## Summary", "## 1. Hidden-state capture", "## 2. Generation", "## 3. Training", "## 4. Serving",
            "## 5. Storage", "## 6. Whole pipeline", "## How long the benchmark took", "## How to reproduce")
SUMMARY_ROWS = 9


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _median(figure: Any) -> Any:
    return figure.get("median") if isinstance(figure, dict) else figure


def missing_figures(results: dict[str, Any]) -> list[str]:
    """One line per part that did not measure what it is for; empty when every part did."""
    problems = []
    capture = results["capture"]
    for side in ("vllm", "hf"):
        if not _positive(_median(capture["tokens_per_s"].get(side))):
            problems.append(f"capture: no tokens/s for the {side} side")
    agreement = capture.get("agreement") or {}
    if not agreement.get("same_shape"):
        problems.append(f"capture: vLLM and HF returned different hidden states: {agreement}")
    elif not agreement.get("max_relative_error", 1.0) < MAX_CAPTURE_RELATIVE_ERROR:
        problems.append(f"capture: vLLM's states differ from HF's by {agreement.get('max_relative_error')} "
                        f"(relative), above {MAX_CAPTURE_RELATIVE_ERROR}: not the same layers")
    for group, modes in SERVED_MODES.items():
        served = results[group]["modes"]
        for mode in modes:
            if not _positive(_median((served.get(mode) or {}).get("tokens_per_s"))):
                problems.append(f"{group}: no output tokens/s for {mode}")
    fp8_cost = results["fp8_cost"]
    for arm in ("bf16", "fp8"):
        length = fp8_cost.get(arm)
        if not (_positive(length) and length >= 1.0):
            problems.append(f"storage: no mean acceptance length for the {arm}-storage drafter ({length})")
    ratio = results["storage"].get("ratio_fp8_over_bf16")
    low, high = FP8_OVER_BF16_BYTES
    if not (_positive(ratio) and low < ratio < high):
        problems.append(f"storage: fp8 / bf16 bytes per token is {ratio}, not between {low} and {high}")
    for arm in ("bf16", "fp8"):
        training = results["training"][arm]
        for name in ("steps_per_s", "peak_rss_mb"):
            if not _positive(training.get(name)):
                problems.append(f"training: no {name} for the {arm}-storage drafter")
    return problems


def document_problems(text: str) -> list[str]:
    """One line per missing section, summary row or figure of the markdown; empty when it is whole."""
    problems = [f"no section {heading!r}" for heading in HEADINGS if heading not in text]
    if "None" in text or "nan" in text.lower():
        problems.append("a figure is written as None or nan")
    summary = text.split("## Summary", 1)[-1].split("\n## ", 1)[0]
    rows = [line for line in summary.splitlines() if re.match(r"\| \d \|", line)]
    if len(rows) != SUMMARY_ROWS:
        problems.append(f"the summary has {len(rows)} figures, not {SUMMARY_ROWS}")
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if not re.match(r"^[\d,.]+", cells[2]):
            problems.append(f"summary: the measured figure is not a number: {row}")
        if cells[0] != "6" and not re.search(r"\d", cells[3]):  # figure 6 (the pipeline's wall time) has no baseline
            problems.append(f"summary: the baseline is not a number: {row}")
    if "`scripts/run_benchmarks.sh" not in text:
        problems.append("the command that wrote it is not named")
    return problems
