"""How the drafter's acceptance grows with training data, and what epochs, draft vocabulary and TTT steps
change at one data size: one drafter per point, served by vLLM and replayed offline.

    scripts/run_scaling.sh configs/tiny.yaml --sizes 16,32,64,128,256,500
    scripts/run_scaling.sh configs/tiny.yaml --sizes 128 --vary train.epochs=2,8 --vary train.ttt_steps=1
    python -m bench.scaling --config configs/tiny.yaml [...]       # what the script runs

Needs the finished run of the same config (`scripts/run_pipeline.sh CONFIG`), which it only reads. Each
point starts from that run's first N conversations and their captured states (no generation, no capture:
stage 02 resumes with nothing left to do), builds its own draft vocabulary (stage 03), trains (stage 04), is
converted for vLLM and served by stage 06 against the pipeline run's own no-speculation answers
(`serve.baseline`), so a point costs one training and one server; stage 06 also replays the drafter on
those answers (the predicted acceptance). The point at the pipeline run's own size with no change is the
pipeline run itself. Data-scaling points are fitted with acceptance length = a + b ln(training tokens),
which is extrapolated to 10,000 samples and to n-gram's acceptance length on the same prompts.

Output in <data_root>/<run_name>-scaling/ (or --work-dir): scaling.md, scaling.json, scaling.png and one
run folder per point. A rerun keeps finished points and resumes torn ones; a work folder made from
another pipeline run is refused.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import arms
from bench.exit_codes import run_command
from bench.figures import read_pipeline_run
from eagle_pipeline import atomic
from eagle_pipeline.config import RunConfig, load_config
from eagle_pipeline.errors import BadInput
from eagle_pipeline.serve.baseline import ANSWERS, BASELINE_DIR
from eagle_pipeline.stage import read_manifest

TARGET_SAMPLES = 10_000  # the user's run: what the trend is asked to predict
SOURCE_FILE = "source.json"  # which pipeline run the work folder's points were cut from
POINT_FILE = "point.json"  # a measured point's figures, written last: its presence means the point is done


@dataclass(frozen=True)
class Point:
    samples: int
    change: tuple[str, str] | None = None  # (config key, value) varied at this size; None: data scaling

    @property
    def name(self) -> str:
        return f"n{self.samples}" + ("" if self.change is None else f"-{self.change[0]}-{self.change[1]}")

    @property
    def overrides(self) -> list[str]:
        return [] if self.change is None else [f"{self.change[0]}={self.change[1]}"]


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


def fit_log_trend(tokens: list[float], lengths: list[float]) -> dict[str, float] | None:
    """Least squares of length = a + b ln(tokens); None below two distinct sizes."""
    points = [(math.log(t), y) for t, y in zip(tokens, lengths) if t > 0 and y is not None]
    if len({x for x, _ in points}) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    sxx = sum((x - mean_x) ** 2 for x, _ in points)
    b = sum((x - mean_x) * (y - mean_y) for x, y in points) / sxx
    a = mean_y - b * mean_x
    residual = sum((y - a - b * x) ** 2 for x, y in points)
    total = sum((y - mean_y) ** 2 for _, y in points)
    return {"a": a, "b": b, "r2": 1.0 - residual / total if total > 0 else 1.0, "points": len(points)}


def trend_at(fit: dict[str, float], tokens: float) -> float:
    return fit["a"] + fit["b"] * math.log(tokens)


def tokens_for(fit: dict[str, float], length: float) -> float | None:
    """Training tokens at which the trend reaches `length`; None if it never grows."""
    return math.exp((length - fit["a"]) / fit["b"]) if fit["b"] > 0 else None


# --------------------------------------------------------------------------------------------------------
# One point: stages 02-04 on a prefix of the pipeline run, converted, served by stage 06


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
    if not (drafter / "config.json").is_file():
        partial = run_dir / ".drafter-vllm.partial"
        shutil.rmtree(partial, ignore_errors=True)
        arms.convert_drafter(run_dir, partial, vocab_size)
        shutil.rmtree(drafter, ignore_errors=True)
        partial.rename(drafter)
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


# --------------------------------------------------------------------------------------------------------
# The document


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


def _num(value: Any, digits: int = 3) -> str:
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
             f"{_num(summary['ngram_mean_acceptance_length'], 2)}.", "",
             "| point | samples | training tokens | served acceptance length | per position | predicted | per position |",
             "|---|---|---|---|---|---|---|"]
    for entry in plan:
        p = points[entry["name"]]
        lines.append(f"| {entry['name']} | {p['samples']:,} | {p['training_tokens']:,} | "
                     f"{_num(p['served_mean_acceptance_length'])} | {_positions(p['served_per_position'])} | "
                     f"{_num(p['predicted_mean_acceptance_length'])} | {_positions(p['predicted_per_position'])} |")
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
            f"{fit['at_target_samples']:.2f}; n-gram's {_num(summary['ngram_mean_acceptance_length'], 2)} "
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
            epochs = _num(p.get("epochs_completed")) + ("" if best is None else f" ({best.rsplit('/', 1)[-1]})")
            lines.append(f"| {size:,} | {'-' if entry['change'] is None else '='.join(entry['change'])} | {_num(served)} | "
                         f"{delta} | {_num(p['predicted_mean_acceptance_length'])} | "
                         f"{'-' if coverage is None else f'{coverage:.1%}'} | {epochs} | {_num(p.get('train_tokens_per_s'), 0)} | "
                         f"{_num(p.get('train_wall_s'), 0)} |")
    lines += ["", "vs unchanged: served acceptance length minus the unchanged point's of the same size. Training "
              "tokens/s is the stage's mean over optimizer steps; stage 04 s includes validation and checkpoint replays.", ""]
    return lines


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, points = results["summary"], results["points"]
    scaling = [points[e["name"]] for e in results["plan"] if e["change"] is None]
    tokens = [p["training_tokens"] for p in scaling]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
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
    fig.tight_layout()
    atomic.write_with(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> Path:
    cfg = load_config(args.config, args.overrides)
    manifests = read_pipeline_run(cfg, args.config)
    available = manifests["01_generate_data"]["counts"]["samples"]
    changes = [change for text in args.vary for change in parse_vary(text)]
    check_changes(args.config, args.overrides, changes)
    plan = plan_points(parse_sizes(args.sizes), changes, args.at, available)
    work = Path(args.work_dir).resolve() if args.work_dir else cfg.resolve_path(cfg.data_root) / f"{cfg.run_name}-scaling"
    if work.exists() and any(work.iterdir()) and not (work / SOURCE_FILE).is_file():
        raise BadInput(f"--work-dir: {work} exists and is not a scaling study's folder; choose an empty or new folder")
    check_source(work, manifests)
    (work / "logs").mkdir(exist_ok=True)
    started = time.monotonic()

    def log(message: str) -> None:
        print(f"[scaling] {message}", flush=True)

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
        log(f"{point.name}: {p['training_tokens']:,} training tokens, served {_num(p['served_mean_acceptance_length'])}, "
            f"predicted {_num(p['predicted_mean_acceptance_length'])}")

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
    parser = argparse.ArgumentParser(prog="python -m bench.scaling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the config of the finished pipeline run (e.g. configs/tiny.yaml)")
    parser.add_argument("--sizes", required=True, help="comma-separated sample counts to train on, e.g. 16,32,64,128,256,500")
    parser.add_argument("--vary", action="append", default=[], metavar="KEY=V1,V2",
                        help="a config key and values to try at one size (--at), e.g. train.epochs=2,8; repeatable")
    parser.add_argument("--at", type=int, help="the sample count the --vary points train on (default: the largest size)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, as for the stage scripts (applies to the run read and every point)")
    parser.add_argument("--work-dir", help="folder for the points (default: <data_root>/<run_name>-scaling)")
    args = parser.parse_args(argv)
    return run_command(run, args, interrupted="finished points are kept; rerun to resume",
                       logs="each point's stage logs are in the work folder's logs/")


if __name__ == "__main__":
    sys.exit(main())
