"""Stage 01's generation throughput under different engine settings, measured A/B by running the stage itself.

    python -m bench.generation_ab --config configs/tiny.yaml --samples 200 \\
        --arm generation.batch_size=50 --arm generation.batch_size=200 \\
        --arm "generation.batch_size=200 verifier.cpu_kvcache_gib=4" --repeats 2

Each arm is a set of config overrides; how the arms run and what is compared: docs/benchmarks/generation.md.
Greedy answers do not depend on the batch, so every arm must write the same answers: the table says whether
they did.

Output in <data_root>/<run_name>-generation-ab/ (or --work-dir): generation_ab.json, generation_ab.md and one
run folder per arm and repetition (emptied by every run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from bench import arms
from bench.stats import interleaved_order, paired_ratios, spread
from eagle_pipeline import atomic
from eagle_pipeline.config import load_config
from eagle_pipeline.errors import BadInput
from eagle_pipeline.stage import read_manifest

WORK_MARKER = ".generation-ab-work-dir"


def parse_arm(text: str) -> list[str]:
    overrides = text.split()
    if not overrides or any("=" not in o or o.startswith("=") for o in overrides):
        raise BadInput(f"--arm: {text!r} must be one or more KEY=VALUE config overrides, e.g. generation.batch_size=200")
    return overrides


def prepare_work_dir(path: Path) -> None:
    arms.prepare_work_dir(path, WORK_MARKER, "bench.generation_ab", "generation A/B folder")


def summarize(labels: list[str], runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    first = labels[0]
    summary: dict[str, Any] = {}
    for label in labels:
        rates = [r["output_tokens_per_s"] for r in runs[label]]
        summary[label] = {
            "output_tokens_per_s": spread(rates),
            "ratio_to_first": spread(paired_ratios(rates, [r["output_tokens_per_s"] for r in runs[first]])),
            "same_answers_as_first": all(r["answers"] == f["answers"] for r, f in zip(runs[label], runs[first])),
        }
    return summary


def render_markdown(results: dict[str, Any]) -> str:
    meta, summary = results["meta"], results["summary"]
    lines = [f"# Generation throughput A/B: {meta['config']}", "",
             f"`{meta['command']}` ({meta['date']}, {meta['total_s'] / 60:.1f} min): stage 01 on {meta['samples']} "
             f"prompts, {meta['repeats']} repetition(s) per arm, order rotated each repetition.", "",
             "| arm | output tokens/s | ratio to the first arm | same answers |", "|---|---|---|---|"]
    for label, figures in summary.items():
        rate, ratio = figures["output_tokens_per_s"], figures["ratio_to_first"]
        lines.append(f"| {label} | {rate['median']:,.0f} [{rate['min']:,.0f}-{rate['max']:,.0f}] | "
                     f"{ratio['median']:.2f}x | {'yes' if figures['same_answers_as_first'] else 'NO'} |")
    return "\n".join(lines + [""])


def run(args: argparse.Namespace) -> Path:
    if args.samples < 1 or args.repeats < 1:
        raise BadInput("--samples and --repeats must be 1 or more")
    cfg = load_config(args.config, args.overrides)
    arm_overrides = [parse_arm(text) for text in args.arm]
    if len(arm_overrides) < 2:
        raise BadInput("--arm: give at least two arms to compare, e.g. --arm generation.batch_size=50 "
                       "--arm generation.batch_size=200")
    for overrides in arm_overrides:
        load_config(args.config, [*args.overrides, *overrides])  # the config's own error names a bad key or value
    labels = [" ".join(o) for o in arm_overrides]
    work = arms.work_dir(args, cfg, "generation-ab")
    prepare_work_dir(work)
    config = str(Path(args.config).resolve())
    started = time.monotonic()
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label in labels}
    for repetition in range(args.repeats):
        for label in interleaved_order(labels, repetition):
            name = f"arm{labels.index(label)}-rep{repetition}"
            print(f"[generation-ab] repetition {repetition + 1} of {args.repeats}: {label}", flush=True)
            overrides = [*args.overrides, f"data_root={work}", f"run_name={name}", f"data.num_samples={args.samples}",
                         *arm_overrides[labels.index(label)]]
            arms.run_stage("01_generate_data", config, overrides, work / "logs" / f"{name}.log",
                           lambda line: print(line, flush=True))
            manifest = read_manifest(work / name / "01_generate_data")
            counts = manifest["counts"]
            runs[label].append({"output_tokens_per_s": counts["output_tokens_per_s"],
                                "generation_seconds": counts["generation_seconds"],
                                "completion_tokens": counts["completion_tokens"],
                                "answers": manifest["output_fingerprint"]})
            print(f"[generation-ab] {label}: {counts['output_tokens_per_s']} output tokens/s", flush=True)
    words = ["python -m bench.generation_ab --config", args.config, "--samples", str(args.samples)]
    words += [f"--arm {json.dumps(text) if ' ' in text else text}" for text in args.arm]
    words += ["--repeats", str(args.repeats)] + [f"--set {o}" for o in args.overrides]
    results = {"meta": {"command": " ".join(words), "config": args.config, "samples": args.samples, "repeats": args.repeats,
                        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "total_s": time.monotonic() - started},
               "runs": runs, "summary": summarize(labels, runs)}
    atomic.write_json(work / "generation_ab.json", results)
    atomic.write_text(work / "generation_ab.md", render_markdown(results))
    print(render_markdown(results))
    return work


def main(argv: list[str] | None = None) -> int:
    parser = arms.parser("python -m bench.generation_ab", __doc__, "generation-ab")
    parser.add_argument("--samples", type=int, default=200, help="prompts each run answers (default 200)")
    parser.add_argument("--arm", action="append", default=[], metavar='"KEY=VALUE ..."',
                        help="one arm's config overrides; repeat for each arm (the first is the reference)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per arm (default 2)")
    args = parser.parse_args(argv)
    return arms.run_command(run, args, interrupted="rerun to measure again (the work folder is emptied)",
                            logs="each run's stage log is in the work folder's logs/")


if __name__ == "__main__":
    sys.exit(main())
