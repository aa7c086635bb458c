"""Two or more finished runs side by side, drafter against drafter (EAGLE-3 against DFlash on the same data, say):
acceptance per position, output tokens/s and speed-up over no speculation at each load, and which method wins at
each concurrency among every one served (each run's drafter, n-gram, none); training time and peak memory (of the
run that trained the drafter, for a run that served another's with serve.drafter).

    .venv/bin/python scripts/compare_runs.py --run runs/tiny --run runs/tiny-quality [--out FILE.md]
With --out, the markdown goes there (headed by this command) and a PNG of tokens/s per load beside it.
"""

import argparse
import shlex
import sys
from pathlib import Path

from eagle_pipeline import atomic, plots
from eagle_pipeline.config import resolve_path
from eagle_pipeline.errors import BadInput
from eagle_pipeline.serve.report import format_number, read_report
from eagle_pipeline.stage import STAGES, read_stage_records

BASELINES = ("none", "ngram")


def run_figures(run_dir: Path) -> dict:
    """A finished run's figures: its drafter's mode, acceptance, tokens/s per level of every mode, training cost."""
    records = {record.name: record for record in read_stage_records(run_dir)}
    served = records[STAGES[6]].manifest
    if served.get("status") != "complete":
        raise BadInput(f"--run: stage 06 of {run_dir} has not finished; run it first")
    report = read_report(run_dir / STAGES[6] / "report.json")
    modes = report["modes"]
    drafter = next(mode for mode in modes if mode not in (*BASELINES, "schedule"))
    levels = {mode: {row["concurrency"]: row["tokens_per_s"] for row in summary.get("levels") or []}
              for mode, summary in modes.items() if mode != "schedule"}
    training = records[STAGES[4]].manifest
    drafter_dir = (served.get("config") or {}).get("serve", {}).get("drafter")
    if not training and drafter_dir:  # a folder stage 05 of another run wrote: <run>/05_convert/vllm
        training = read_stage_records(resolve_path(drafter_dir).parent.parent)[3].manifest
    return {"name": run_dir.name, "drafter": drafter, "k": report["num_speculative_tokens"],
            "acceptance": report["mean_acceptance_length"], "per_position": report["per_position_acceptance"],
            "predicted": report.get("predicted_mean_acceptance_length"), "levels": levels,
            "train_s": training.get("wall_time_s"), "peak_rss_mb": (training.get("counts") or {}).get("peak_rss_mb")}


def compare(runs: list[dict]) -> list[str]:
    """The markdown: one row per run, then one per load with every served method's tokens/s and the winner."""
    lines = ["| run | drafter | k | acceptance length (predicted) | acceptance per position | training s | peak RSS GB |",
             "|---|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r['name']} | {r['drafter']} | {r['k']} | {format_number(r['acceptance'])} "
                     f"({format_number(r['predicted'])}) | {' / '.join(format_number(v) for v in r['per_position'])} "
                     f"| {format_number(r['train_s'], 0)} | {format_number((r['peak_rss_mb'] or 0) / 1e3, 1)} |")
    methods = {f"{r['name']} {r['drafter']}": r["levels"][r["drafter"]] for r in runs}
    for baseline in BASELINES:  # each run served its own baselines; the first run's that has one stands for both
        served = next((r["levels"][baseline] for r in runs if baseline in r["levels"]), None)
        if served:
            methods[baseline] = served
    concurrency = sorted({c for served in methods.values() for c in served})
    none = methods.get("none", {})
    lines += ["", "| concurrency | " + " | ".join(f"{m} tok/s (speed-up)" for m in methods) + " | winner |",
              "|---|" + "---|" * (len(methods) + 1)]
    for c in concurrency:
        cells = [f"{format_number(served.get(c), 1)} "
                 f"({format_number(served[c] / none[c] if c in served and none.get(c) else None)}x)"
                 for served in methods.values()]
        winner = max((m for m in methods if c in methods[m]), key=lambda m: methods[m][c])
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {winner} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", action="append", required=True, type=Path, help="a finished run's folder (twice or "
                        "more)")
    parser.add_argument("--out", type=Path, help="write the markdown here, and a PNG beside it")
    args = parser.parse_args()
    try:
        if len(args.run) < 2:
            raise BadInput("--run: name at least two finished runs to compare")
        runs = [run_figures(run_dir) for run_dir in args.run]
        if len({r["name"] for r in runs}) < len(runs):
            raise BadInput("--run: two runs share a name; name different runs")
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    lines = compare(runs)
    print("\n".join(lines))
    if args.out:
        command = shlex.join(["scripts/compare_runs.py", *(f"--run={r}" for r in args.run), f"--out={args.out}"])
        atomic.write_text(args.out, f"Regenerated by `{command}` on finished runs.\n\n" + "\n".join(lines) + "\n")
        series = {f"{r['name']} {r['drafter']}": r["levels"][r["drafter"]] for r in runs}
        series |= {m: runs[0]["levels"][m] for m in BASELINES if m in runs[0]["levels"]}
        xs = sorted({c for s in series.values() for c in s})
        plots.curve(xs, {m: [s.get(c, 0.0) for c in xs] for m, s in series.items()}, args.out.with_suffix(".png"),
                    "output tokens/s by method and load", "requests in flight", "output tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
