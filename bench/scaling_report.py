"""The data-scaling study's trend and document: acceptance length = a + b ln(training tokens) fitted to the
measured points and extrapolated to the user's run, the markdown table and the plot (bench/scaling.py plans and
runs the points)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle_pipeline.plots import _figure, _save

TARGET_SAMPLES = 10_000  # the user's run: what the trend is asked to predict


@dataclass(frozen=True)
class Point:
    """One pipeline run of the study: `samples` conversations, with at most one config change."""

    samples: int
    change: tuple[str, str] | None = None  # (config key, value) varied at this size; None: data scaling

    @property
    def name(self) -> str:
        return f"n{self.samples}" + ("" if self.change is None else f"-{self.change[0]}-{self.change[1]}")

    @property
    def overrides(self) -> list[str]:
        return [] if self.change is None else [f"{self.change[0]}={self.change[1]}"]


def fit_log_trend(tokens: list[float], lengths: list[float]) -> dict[str, float] | None:
    """Least squares of length = a + b ln(tokens); None below two distinct sizes."""
    points = [(math.log(t), y) for t, y in zip(tokens, lengths) if t > 0 and y is not None]
    if len({x for x, _ in points}) < 2:
        return None
    b, a = statistics.linear_regression(*zip(*points))
    mean_y = statistics.fmean(y for _, y in points)
    residual = sum((y - a - b * x) ** 2 for x, y in points)
    total = sum((y - mean_y) ** 2 for _, y in points)
    return {"a": a, "b": b, "r2": 1.0 - residual / total if total > 0 else 1.0, "points": len(points)}


def trend_at(fit: dict[str, float], tokens: float) -> float:
    return fit["a"] + fit["b"] * math.log(tokens)


def tokens_for(fit: dict[str, float], length: float) -> float | None:
    """Training tokens at which the trend reaches `length`; None if it never grows."""
    return math.exp((length - fit["a"]) / fit["b"]) if fit["b"] > 0 else None


def summarize(points: dict[str, dict], plan: list[Point], pipeline_report: dict, pipeline_samples: int,
              pipeline_tokens: int) -> dict[str, Any]:
    scaling = [points[p.name] for p in plan if p.change is None]
    ngram = ((pipeline_report.get("modes") or {}).get("ngram") or {}).get("mean_acceptance_length")
    summary: dict[str, Any] = {"ngram_mean_acceptance_length": ngram, "tokens_per_sample": pipeline_tokens / pipeline_samples,
                               "target_samples": TARGET_SAMPLES}
    target_tokens = summary["tokens_per_sample"] * TARGET_SAMPLES
    for kind in ("served", "predicted"):
        fit = fit_log_trend([p["training_tokens"] for p in scaling], [p[f"{kind}_mean_acceptance_length"] for p in scaling])
        if fit is not None:
            fit["at_target_samples"] = trend_at(fit, target_tokens)
            if ngram is not None:
                fit["tokens_to_ngram"] = tokens_for(fit, ngram)
        summary[f"{kind}_fit"] = fit
    span = [p["training_tokens"] for p in scaling]
    summary["token_span"] = max(span) / min(span) if span and min(span) > 0 else None
    return summary


def as_text(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}"


def _positions(values: list[float] | None) -> str:
    return "-" if not values else " / ".join(f"{v:.2f}" for v in values)


def render_markdown(results: dict[str, Any]) -> str:
    meta, summary, points, plan = results["meta"], results["summary"], results["points"], results["plan"]
    lines = [f"# Data scaling of the drafter: {meta['config']}", "",
             f"`{meta['command']}` ({meta['date']}, {meta['total_s'] / 60:.1f} min). Served: vLLM's counters on "
             f"{meta['num_prompts']} held-out prompts, {meta['num_speculative_tokens']} draft tokens; predicted: the "
             f"drafter replayed offline on the same answers. n-gram on the same prompts: "
             f"{as_text(summary['ngram_mean_acceptance_length'], 2)}.", "",
             "| point | samples | training tokens | served acceptance length | per position | predicted | per position |",
             "|---|---|---|---|---|---|---|"]
    for entry in plan:
        p = points[entry["name"]]
        lines.append(f"| {entry['name']} | {p['samples']:,} | {p['training_tokens']:,} | "
                     f"{as_text(p['served_mean_acceptance_length'])} | {_positions(p['served_per_position'])} | "
                     f"{as_text(p['predicted_mean_acceptance_length'])} | {_positions(p['predicted_per_position'])} |")
    lines.append("")
    tokens_10k = summary["tokens_per_sample"] * summary["target_samples"]
    for kind in ("served", "predicted"):
        fit = summary.get(f"{kind}_fit")
        if fit is None:
            lines.append(f"- {kind}: fewer than two data sizes, no trend.")
            continue
        reach = fit.get("tokens_to_ngram")
        lines.append(
            f"- {kind}: acceptance length = {fit['a']:.3f} + {fit['b']:.4f} ln(training tokens) over {fit['points']} sizes "
            f"spanning {summary['token_span']:.0f}x (R² {fit['r2']:.2f}); at {summary['target_samples']:,} samples "
            f"(~{tokens_10k:,.0f} tokens at this run's {summary['tokens_per_sample']:.0f} per sample) it predicts "
            f"{fit['at_target_samples']:.2f}; n-gram's {as_text(summary['ngram_mean_acceptance_length'], 2)} "
            + ("is never reached (the trend does not grow)." if reach is None else
               f"at ~{reach:,.0f} tokens (~{reach / summary['tokens_per_sample']:,.0f} samples)."))
    lines += ["", "An extrapolation of a log-linear fit: acceptance saturates eventually, so read the far end as an "
              "upper bound on what data alone buys.", ""]
    lines += _changes_table(plan, points)
    return "\n".join(lines)


def _changes_table(plan: list[dict[str, Any]], points: dict[str, dict]) -> list[str]:
    """Each single change beside the unchanged point of its size (the reference row, change "-")."""
    sizes = sorted({e["samples"] for e in plan if e["change"] is not None})
    if not sizes:
        return []
    lines = ["| samples | change | served | vs unchanged | predicted | draft vocab covers eval answers | epochs run (best checkpoint) "
             "| training tokens/s | stage 04 s |", "|---|---|---|---|---|---|---|---|---|"]
    for size in sizes:
        reference = next((e for e in plan if e["samples"] == size and e["change"] is None), None)
        ref_served = points[reference["name"]]["served_mean_acceptance_length"] if reference else None
        for entry in ([reference] if reference else []) + [e for e in plan if e["samples"] == size and e["change"]]:
            p = points[entry["name"]]
            served = p["served_mean_acceptance_length"]
            delta = "-" if entry["change"] is None or None in (served, ref_served) else f"{served - ref_served:+.3f}"
            coverage = p.get("draft_vocab_coverage_eval")
            best = p.get("best_checkpoint")
            epochs = as_text(p.get("epochs_completed")) + ("" if best is None else f" ({best.rsplit('/', 1)[-1]})")
            lines.append(f"| {size:,} | {'-' if entry['change'] is None else '='.join(entry['change'])} | {as_text(served)} | "
                         f"{delta} | {as_text(p['predicted_mean_acceptance_length'])} | "
                         f"{'-' if coverage is None else f'{coverage:.1%}'} | {epochs} | {as_text(p.get('train_tokens_per_s'), 0)} | "
                         f"{as_text(p.get('train_wall_s'), 0)} |")
    lines += ["", "vs unchanged: served acceptance length minus the unchanged point's of the same size. Training "
              "tokens/s is the stage's mean over optimizer steps; stage 04 s includes validation and checkpoint replays.", ""]
    return lines


def plot(results: dict[str, Any], path: Path) -> None:
    summary, points = results["summary"], results["points"]
    scaling = [points[e["name"]] for e in results["plan"] if e["change"] is None]
    tokens = [p["training_tokens"] for p in scaling]
    plt, fig, ax = _figure()
    for kind, style in (("served", "o-"), ("predicted", "s--")):
        ys = [p[f"{kind}_mean_acceptance_length"] for p in scaling]
        if any(y is not None for y in ys):
            ax.plot(tokens, ys, style, label=kind)
        fit = summary.get(f"{kind}_fit")
        if fit is not None and tokens:
            end = summary["tokens_per_sample"] * summary["target_samples"]
            xs = [min(tokens) * (end / min(tokens)) ** (i / 40) for i in range(41)]
            ax.plot(xs, [trend_at(fit, x) for x in xs], ":", label=f"{kind} trend")
    if summary["ngram_mean_acceptance_length"] is not None:
        ax.axhline(summary["ngram_mean_acceptance_length"], color="grey", linestyle="-.", label="n-gram")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens (assistant tokens of the conversations trained on)")
    ax.set_ylabel("mean acceptance length")
    ax.set_title(f"Data scaling: {results['meta']['config']}")
    ax.grid(alpha=0.3)
    ax.legend()
    _save(plt, fig, path)
