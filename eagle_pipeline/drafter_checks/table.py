"""The drafter checks' results as a fixed-width table, one line per check, for the terminal."""

from __future__ import annotations

import sys
from typing import Any

from eagle_pipeline.drafter_checks.all_checks import CHECK_NAMES


def _summary(name: str, check: dict[str, Any]) -> str:
    detail = check.get("detail")
    if check.get("skipped"):
        return str(detail)
    if isinstance(detail, dict):
        problems = detail.get("problems") or detail.get("unloaded_parameters") or []
        if detail.get("error"):
            return detail["error"].splitlines()[0][:200]
        if problems:
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            return problems[0][:200] + more
        if name == "parity":
            return (f"per-position acceptance {detail['a']['acceptance_rate_per_position']} vs "
                    f"{detail['b']['acceptance_rate_per_position']} (tolerance {detail['tolerance']})")
        if name == "vllm_logits":
            worst = max(part["relative_difference"] for part in detail.values() if isinstance(part, dict)
                        and "relative_difference" in part)
            return (f"{detail.get('model_class')} computes the checkpoint's logits (differs by {worst:.1g} of the "
                    f"largest, tolerance {detail['tolerance']:g})")
        if name == "vllm_load":
            return f"{detail.get('model_class')} loaded every tensor"
        if name == "shapes":
            return f"{detail.get('num_tensors')} tensors match the config" + (
                " and the reference" if "reference" in detail else "")
        if name == "config":
            return "transformers and vLLM read the expected fields"
    return str(detail)[:200]


def format_table(result: dict[str, Any]) -> str:
    """The checks as a fixed-width table: check, result, one-line detail."""
    rows = []
    for name in CHECK_NAMES:
        check = result["checks"].get(name)
        if check is None:
            continue
        status = "SKIP" if check.get("skipped") else ("PASS" if check["ok"] else "FAIL")
        rows.append((name, status, _summary(name, check)))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
    lines += [f"{n:<{width}}  {s:<6}  {d}" for n, s, d in rows]
    return "\n".join(lines)


def print_table(result: dict[str, Any], file=None) -> None:
    print(format_table(result), file=file or sys.stdout)
