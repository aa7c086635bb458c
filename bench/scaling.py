"""How the drafter's acceptance grows with training data, and what epochs, draft vocabulary and TTT steps
change at one data size: one drafter per point, served by vLLM and replayed offline.

    scripts/run_scaling.sh configs/tiny.yaml --sizes 16,32,64,128,256,500
    scripts/run_scaling.sh configs/tiny.yaml --sizes 128 --vary train.epochs=2,8 --vary train.ttt_steps=1
    python -m bench.scaling --config configs/tiny.yaml [...]       # what the script runs

Needs the finished run of the same config (`scripts/run_pipeline.sh CONFIG`), which it only reads; what a
point runs (one training and one server, no generation or capture): docs/benchmarks/scaling.md; the point at
the pipeline run's own size with no change is the pipeline run itself. The trend: bench/scaling_report.py.

Output in <data_root>/<run_name>-scaling/ (or --work-dir): scaling.md, scaling.json, scaling.png and one
run folder per point. A rerun keeps finished points and resumes torn ones; a work folder made from
another pipeline run is refused.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from bench import arms
from bench.figures import read_pipeline_run
from bench.scaling_report import Point, as_text, plot, render_markdown, summarize
from eagle_pipeline import atomic
from eagle_pipeline.config import RunConfig, load_config
from eagle_pipeline.errors import BadInput
from eagle_pipeline.serve.baseline import ANSWERS, BASELINE_DIR
from eagle_pipeline.stage import read_manifest

SOURCE_FILE = "source.json"  # which pipeline run the work folder's points were cut from
POINT_FILE = "point.json"  # a measured point's figures, written last: its presence means the point is done


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise BadInput(f"--sizes: {text!r} is not a comma-separated list of sample counts, e.g. 16,32,64") from None
    if not sizes or sizes[0] < 1:
        raise BadInput(f"--sizes: {text!r} must name at least one sample count of 1 or more, e.g. 16,32,64")
    return sizes


def parse_vary(text: str) -> list[tuple[str, str]]:
    key, sep, values = text.partition("=")
    if not sep or not key.strip() or not values.strip():
        raise BadInput(f"--vary: {text!r} must be KEY=V1,V2 (a config key and its values), e.g. train.epochs=2,8")
    return [(key.strip(), v.strip()) for v in values.split(",") if v.strip()]


def plan_points(sizes: list[int], changes: list[tuple[str, str]], at: int | None, available: int) -> list[Point]:
    """The data-scaling points, then each change at `at` (default: the largest size)."""
    too_many = [n for n in sizes + ([at] if at else []) if n > available]
    if too_many:
        raise BadInput(f"--sizes: {max(too_many)} samples asked for, but the pipeline run has {available} conversations; "
                       f"lower it, or raise data.num_samples and rerun the pipeline")
    at = at or sizes[-1]
    return [Point(n) for n in sizes] + [Point(at, change) for change in changes]


def check_changes(config: str, overrides: list[str], changes: list[tuple[str, str]]) -> None:
    """Every varied value is a valid config value (the config's own error names the key otherwise), and
    none touches what the points share with the pipeline run (its conversations and captured states)."""
    for key, value in changes:
        if key.split(".")[0] in ("data", "generation", "hidden_states", "verifier", "seed", "run_name", "data_root"):
            raise BadInput(f"--vary: {key} shapes the pipeline run's conversations or captured states, which every "
                           f"point reuses; vary train.*, vocab.* or serve.* keys")
        load_config(config, [*overrides, f"{key}={value}"])


def eval_answer_coverage(t2d_path: Path, answer_token_ids: list[list[int]]) -> float | None:
    """The share of the eval answers' tokens that the draft vocabulary holds: a drafter can never propose
    the rest, so this bounds its per-token acceptance on those prompts."""
    import numpy as np

    if not t2d_path.is_file():
        return None
    in_draft = np.load(t2d_path)
    ids = np.fromiter((t for answer in answer_token_ids for t in answer), dtype=np.int64)
    return float(in_draft[ids].mean()) if ids.size else None


def point_result(run_dir: Path, stage02: dict, report: dict, wall_s: float | None,
                 answer_token_ids: list[list[int]]) -> dict[str, Any]:
    counts = stage02["counts"]
    vocab = (read_manifest(run_dir / "03_build_vocab_map") or {}).get("counts", {})
    train = read_manifest(run_dir / "04_train") or {}
    train_counts = train.get("counts", {})
    return {
        "run_dir": str(run_dir),
        "samples": counts["samples"],
        "training_tokens": counts["assistant_tokens"],
        "served_mean_acceptance_length": report.get("mean_acceptance_length"),
        "served_per_position": report.get("per_position_acceptance"),
        "predicted_mean_acceptance_length": report.get("predicted_mean_acceptance_length"),
        "predicted_per_position": report.get("predicted_per_position_acceptance"),
        "num_drafts": (report.get("modes", {}).get("eagle3") or {}).get("num_drafts"),
        "diagnosis": (report.get("diagnosis") or {}).get("status"),
        "draft_vocab_coverage_train": vocab.get("coverage"),
        "draft_vocab_coverage_eval": eval_answer_coverage(run_dir / "03_build_vocab_map" / "t2d.npy", answer_token_ids),
        "epochs_completed": train_counts.get("epochs_completed"),
        "best_checkpoint": (train_counts.get("best") or {}).get("checkpoint"),
        "train_tokens_per_s": train_counts.get("train_tokens_per_s"),
        "train_wall_s": train.get("wall_time_s"),
        "wall_s": wall_s,
    }


def run_point(point: Point, args: argparse.Namespace, cfg: RunConfig, work: Path, vocab_size: int,
              answer_token_ids: list[list[int]], log) -> dict[str, Any]:
    run_dir = work / point.name
    if (run_dir / POINT_FILE).is_file():
        log(f"{point.name}: already measured")
        return json.loads((run_dir / POINT_FILE).read_text())
    started = time.monotonic()
    if (read_manifest(run_dir / "01_generate_data") or {}).get("status") != "complete":
        shutil.rmtree(run_dir, ignore_errors=True)  # a copy torn before its manifest: start the point again
        arms.copy_conversations(cfg.stage_dir("01_generate_data"), run_dir / "01_generate_data", point.samples)
        arms.copy_captured_states(cfg.stage_dir("02_extract_hidden"), run_dir / "02_extract_hidden", point.samples)
    overrides = [*args.overrides, f"data_root={work}", f"run_name={point.name}", f"data.num_samples={point.samples}",
                 *point.overrides]
    config = str(Path(args.config).resolve())
    for script in ("02_extract_hidden", "03_build_vocab_map", "04_train"):
        log(f"{point.name}: {script}")
        arms.run_stage(script, config, overrides, work / "logs" / f"{point.name}-{script}.log", log)
    drafter = run_dir / "drafter-vllm"
    if not (drafter / "config.json").is_file():  # the conversion writes the folder whole or not at all
        arms.convert_drafter(run_dir, drafter, vocab_size)
    log(f"{point.name}: 06_serve_test (its drafter against the pipeline run's no-speculation answers)")
    serve = [f"serve.drafter={drafter}", f"serve.baseline={cfg.stage_dir('06_serve_test')}", "serve.ngram_baseline=false",
             # Every figure is wanted, small drafters' too: the floor is the pipeline's bar, not the study's.
             "serve.min_acceptance_length=1.0"]
    try:
        arms.run_stage("06_serve_test", config, [*overrides, *serve], work / "logs" / f"{point.name}-06_serve_test.log", log)
    except RuntimeError:
        # Exit 1 with a complete report is a diagnosis FAIL (served below the replay): a figure to keep, with its status.
        if (read_manifest(run_dir / "06_serve_test") or {}).get("status") != "complete":
            raise
    report = json.loads((run_dir / "06_serve_test" / "report.json").read_text())
    result = point_result(run_dir, read_manifest(run_dir / "02_extract_hidden"), report, round(time.monotonic() - started, 1),
                          answer_token_ids)
    atomic.write_json(run_dir / POINT_FILE, result)
    return result


def check_source(work: Path, manifests: dict[str, dict]) -> None:
    """Points cut from one pipeline run only: a work folder made from another is refused, never mixed."""
    source = {name: manifests[name].get("output_fingerprint") for name in ("01_generate_data", "02_extract_hidden",
                                                                             "06_serve_test")}
    path = work / SOURCE_FILE
    if path.is_file():
        if json.loads(path.read_text()) != source:
            raise BadInput(f"--work-dir: {work} holds points cut from another pipeline run (its {SOURCE_FILE} differs); "
                           f"delete the folder or choose another --work-dir")
        return
    work.mkdir(parents=True, exist_ok=True)
    atomic.write_json(path, source)


def run(args: argparse.Namespace) -> Path:
    cfg = load_config(args.config, args.overrides)
    manifests = read_pipeline_run(cfg, args.config)
    available = manifests["01_generate_data"]["counts"]["samples"]
    changes = [change for text in args.vary for change in parse_vary(text)]
    check_changes(args.config, args.overrides, changes)
    plan = plan_points(parse_sizes(args.sizes), changes, args.at, available)
    work = arms.work_dir(args, cfg, "scaling")
    if work.exists() and any(work.iterdir()) and not (work / SOURCE_FILE).is_file():
        raise BadInput(f"--work-dir: {work} exists and is not a scaling study's folder; choose an empty or new folder")
    check_source(work, manifests)
    (work / "logs").mkdir(exist_ok=True)
    started = time.monotonic()
    log = partial(print, "[scaling]", flush=True)
    from eagle_pipeline.verifier import Verifier

    vocab_size = Verifier.from_config(cfg).vocab_size
    pipeline_report = json.loads((cfg.stage_dir("06_serve_test") / "report.json").read_text())
    # The no-speculation answers every point is served against (serve.baseline): what the coverage is of.
    baseline = json.loads((cfg.stage_dir("06_serve_test") / BASELINE_DIR / ANSWERS).read_text())
    answer_token_ids = [answer for _prompt, answer in baseline["token_ids"]]
    points: dict[str, dict] = {}
    for i, point in enumerate(plan, 1):
        log(f"point {i} of {len(plan)}: {point.name}")
        if point.samples == available and point.change is None:
            points[point.name] = point_result(cfg.run_dir, manifests["02_extract_hidden"], pipeline_report, None,
                                              answer_token_ids)
            log(f"{point.name}: the pipeline run itself")
            continue
        points[point.name] = run_point(point, args, cfg, work, vocab_size, answer_token_ids, log)
        p = points[point.name]
        log(f"{point.name}: {p['training_tokens']:,} training tokens, served {as_text(p['served_mean_acceptance_length'])}, "
            f"predicted {as_text(p['predicted_mean_acceptance_length'])}")

    pipeline_counts = manifests["02_extract_hidden"]["counts"]
    words = ["scripts/run_scaling.sh", args.config, "--sizes", args.sizes]
    for text in args.vary:
        words += ["--vary", text]
    if args.at:
        words += ["--at", str(args.at)]
    for assignment in args.overrides:
        words += ["--set", assignment]
    results = {
        "meta": {"command": " ".join(words), "config": args.config, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                 "total_s": time.monotonic() - started, "pipeline_run": str(cfg.run_dir), "work_dir": str(work),
                 "num_prompts": pipeline_report["num_prompts"],
                 "num_speculative_tokens": pipeline_report["num_speculative_tokens"]},
        "plan": [{"name": p.name, "samples": p.samples, "change": list(p.change) if p.change else None} for p in plan],
        "points": points,
        "summary": summarize(points, plan, pipeline_report, pipeline_counts["samples"],
                             pipeline_counts["assistant_tokens"]),
    }
    atomic.write_json(work / "scaling.json", results)
    atomic.write_text(work / "scaling.md", render_markdown(results))
    plot(results, work / "scaling.png")
    log(f"wrote {work / 'scaling.md'}, scaling.json and scaling.png in {results['meta']['total_s'] / 60:.1f} min")
    print(render_markdown(results))
    return work


def main(argv: list[str] | None = None) -> int:
    parser = arms.parser("python -m bench.scaling", __doc__, "scaling")
    parser.add_argument("--sizes", required=True, help="comma-separated sample counts to train on, e.g. 16,32,64,128,256,500")
    parser.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2",
                        help="a config key and values to try at one size (--at), e.g. train.epochs=2,8; repeatable")
    parser.add_argument("--at", type=int, help="the sample count the --vary points train on (default: the largest size)")
    args = parser.parse_args(argv)
    return arms.run_command(run, args, interrupted="finished points are kept; rerun to resume",
                            logs="each point's stage logs are in the work folder's logs/")


if __name__ == "__main__":
    sys.exit(main())
