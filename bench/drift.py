"""Which of today's benchmark figures moved against BENCHMARKS.md's, and by how much.

`bench.run` prints these lines after writing its files and never fails on them: a figure that moved is a
regression to look at in the log (CI's included), not a stop for a change that is about something else.

Both sides are read from the summary table that bench/report.py writes, so the published document is the
reference and nothing else has to be kept. A quick run measures at another size than the full run that wrote
BENCHMARKS.md (2 capture samples instead of 64, the smoke run's batch of 4 instead of 50, one epoch, two served
prompts), so it is compared on the figures that do not depend on the size: ratios between two sides measured
together, shares of the machine's own matmul ceiling, and the bytes a token's states take. A full run is
compared on every figure. The bands are wide enough for run-to-run noise on a shared 2-core machine and narrow
enough that a lost kernel or a slower path shows: a change of 30% in an interleaved ratio is not noise.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

MEASURED, BASELINE, RATIO = 2, 3, 4  # columns of the summary table: #, figure, measured, baseline, ratio


@dataclass(frozen=True)
class Figure:
    row: int  # index among the summary's figure rows (bench/report.py's order)
    column: int
    name: str
    band: float  # relative change still counted as noise
    size_free: bool  # comparable between a quick run and the full run that wrote BENCHMARKS.md


FIGURES = (
    Figure(0, RATIO, "capture, vLLM over HF transformers", 0.20, True),
    Figure(1, RATIO, "capture's share of the float32 matmul ceiling", 0.25, True),
    Figure(2, RATIO, "generation's share of the float32 matmul ceiling", 0.30, True),
    Figure(3, RATIO, "training tokens/s, bf16 over fp8 storage", 0.20, True),
    Figure(6, MEASURED, "training data, bytes per token (bf16)", 0.02, True),
    Figure(6, RATIO, "training data, fp8 over bf16 bytes", 0.05, True),
    Figure(0, MEASURED, "capture tokens/s (vLLM)", 0.25, False),
    Figure(2, MEASURED, "generation output tokens/s", 0.25, False),
    Figure(3, MEASURED, "training tokens/s (bf16 storage)", 0.25, False),
    Figure(4, MEASURED, "serving tokens/s with the drafter", 0.25, False),
    Figure(4, RATIO, "serving, drafter over no speculation", 0.20, False),
    Figure(5, MEASURED, "mean acceptance length, drafter", 0.10, False),
    Figure(8, MEASURED, "whole pipeline, wall time (s)", 0.25, False),
)

_NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?")


def summary_rows(text: str) -> list[list[str]]:
    """The summary table's figure rows, as cells."""
    summary = text.split("## Summary", 1)[-1].split("\n## ", 1)[0]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in summary.splitlines() if re.match(r"\| \d \|", line)]


def first_number(cell: str) -> float | None:
    text = number_text(cell)
    return float(text.replace(",", "")) if text else None


def number_text(cell: str) -> str | None:
    """The cell's first number as the document writes it."""
    match = _NUMBER.search(cell)
    return match.group() if match else None


def machine_line(text: str) -> str | None:
    return next((line[len("- Machine: "):] for line in text.splitlines() if line.startswith("- Machine: ")), None)


def compare(published: str, today: str, *, quick: bool) -> list[str]:
    """Lines saying how `today`'s summary (a freshly rendered document) compares with `published`'s."""
    old_rows, new_rows = summary_rows(published), summary_rows(today)
    if not old_rows:
        return ["benchmark drift: BENCHMARKS.md has no summary table to compare with"]
    moved, within, skipped = [], 0, []
    for figure in FIGURES:
        if quick and not figure.size_free:
            skipped.append(figure.name)
            continue
        try:
            old_cell, new_cell = old_rows[figure.row][figure.column], new_rows[figure.row][figure.column]
        except IndexError:
            old_cell = new_cell = ""
        old, new = first_number(old_cell), first_number(new_cell)
        if old is None or new is None or old == 0:
            skipped.append(figure.name)
            continue
        change = new / old - 1
        if abs(change) > figure.band:
            moved.append(f"  moved: {figure.name}: {number_text(old_cell)} -> {number_text(new_cell)} "
                         f"({change:+.0%}; band ±{figure.band:.0%})")
        else:
            within += 1
    lines = [f"benchmark drift against BENCHMARKS.md: {within} figure(s) within their noise band, {len(moved)} moved"
             + (":" if moved else "")]
    lines += moved
    if skipped:
        reason = "measured at another size in a quick run" if quick else "not a number on one side"
        lines.append(f"  not compared ({reason}): {', '.join(skipped)}")
    old_machine, new_machine = machine_line(published), machine_line(today)
    if old_machine != new_machine:
        lines.append(f"  BENCHMARKS.md was measured on: {old_machine}; this run: {new_machine}")
    return lines

