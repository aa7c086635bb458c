"""Figures from stage outputs: what a finished pipeline run already measured (stage wall times,
generation speed, storage, training), and what fp8 storage cost in acceptance length. Pure: files in,
dicts out, so they can be tested without running a model."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from eagle_pipeline.config import RunConfig
from eagle_pipeline.errors import BadInput
from eagle_pipeline.stage import STAGES, read_manifest
from eagle_pipeline.train.metrics import METRICS_CSV, read_metrics
from eagle_pipeline.train.runner import RUN_STATS_FILE


def read_pipeline_run(cfg: RunConfig, config_arg: str) -> dict[str, Any]:
    """Every stage's manifest of the run `cfg` names; all six must be complete."""
    manifests = {name: read_manifest(cfg.stage_dir(name)) for name in STAGES.values()}
    missing = [name for name, m in manifests.items() if not m or m.get("status") != "complete"]
    if missing:
        raise BadInput(f"{cfg.run_dir}: no finished pipeline run to benchmark ({', '.join(missing)} not complete); "
                       f"run `scripts/run_pipeline.sh {config_arg}` first")
    return manifests


def pipeline_figures(manifests: dict[str, dict], run_dir: Path) -> dict[str, Any]:
    """Figures 2 and 6 and the pipeline's own training, storage and serving figures, from the manifests."""
    gen = manifests["01_generate_data"]
    gen_counts, gen_config = gen["counts"], gen["config"]
    stages = {name: m.get("wall_time_s") for name, m in manifests.items()}
    train_dir = run_dir / "04_train"
    report_path = run_dir / "06_serve_test" / "report.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    return {
        "run_dir": str(run_dir),
        "finished_at": manifests["06_serve_test"].get("finished_at"),
        "config": gen_config,
        "stages_wall_s": stages,
        "total_wall_s": sum(v or 0 for v in stages.values()),
        "generation": {
            "output_tokens_per_s": gen_counts.get("output_tokens_per_s"),
            "batch_size": gen_config["generation"]["batch_size"],
            "max_tokens": gen_config["generation"]["max_tokens"],
            "samples": gen_counts.get("samples"),
            "prompt_tokens": gen_counts.get("prompt_tokens"),
            "completion_tokens": gen_counts.get("completion_tokens"),
            "generation_seconds": gen_counts.get("generation_seconds"),
        },
        "capture": {k: manifests["02_extract_hidden"]["counts"].get(k)
                    for k in ("capture_tokens_per_s", "bytes_per_token", "tokens", "samples", "stored_bytes")},
        "training": training_figures(manifests["04_train"], train_dir),
        "serving": {k: report.get(k) for k in ("num_prompts", "mean_acceptance_length", "per_position_acceptance",
                                               "tokens_per_s", "speedup", "greedy_match", "concurrency", "verdict")},
    }


def training_figures(manifest: dict[str, Any], train_dir: Path) -> dict[str, Any]:
    """Throughput, step rate and memory of one stage-04 run, from its manifest, run_stats.json and metrics.csv
    (what each figure counts: BENCHMARKS.md section 3)."""
    counts = manifest["counts"]
    stats_path = train_dir / RUN_STATS_FILE
    stats = json.loads(stats_path.read_text()) if stats_path.is_file() else {}
    step_rates = [row["tokens_per_s"] for row in read_metrics(train_dir / METRICS_CSV)
                  if row["split"] == "train" and row.get("tokens_per_s") is not None]
    steps, step_seconds = stats.get("steps"), stats.get("train_step_seconds")
    val = counts.get("final_val") or {}
    return {
        "epochs": counts.get("epochs_completed"),
        "steps": steps,
        "tokens_per_s_median_step": statistics.median(step_rates) if step_rates else None,
        "tokens_per_s_mean": counts.get("train_tokens_per_s"),
        "steps_per_s": steps / step_seconds if steps and step_seconds else None,
        "peak_rss_mb": counts.get("peak_rss_mb"),
        "wall_s": manifest.get("wall_time_s"),
        "val_full_acc": [float(val[k]) for k in sorted(k for k in val if k.startswith("full_acc_"))],
    }


def storage_figures(manifest: dict[str, Any]) -> dict[str, Any]:
    """Bytes per token and per 1,000 samples of one stage-02 output (as written: headers and token ids too)."""
    c = manifest["counts"]
    return {
        "storage_dtype": manifest["config"]["hidden_states"]["storage_dtype"],
        "samples": c["samples"],
        "tokens": c["tokens"],
        "stored_bytes": c["stored_bytes"],
        "bytes_per_token": c["stored_bytes"] / c["tokens"],
        "bytes_per_1k_samples": c["stored_bytes"] / c["samples"] * 1000,
        "num_hidden_states": c["num_hidden_states"],
        "hidden_size": c["hidden_size"],
        "capture_tokens_per_s": c.get("capture_tokens_per_s"),
    }


def fp8_verdict(difference: float | None, stderr: float | None, bf16_length: float | None, default_storage: str) -> str:
    """One sentence on what fp8 storage cost in acceptance length, judged against the measurement's noise."""
    default = f"The embedded default stores hidden states as {default_storage}."
    if difference is None or stderr is None:
        return f"No acceptance was measured for one of the drafters. {default}"
    share = f" ({difference / (bf16_length - 1):+.0%} of the accepted draft tokens)" if bf16_length and bf16_length > 1 else ""
    if abs(difference) <= 2 * stderr:
        return (f"The difference{share} is within two standard errors ({2 * stderr:.3f}): no cost is measurable at "
                f"this size, so a larger run has to show whether it is negligible. {default}")
    if difference < 0:
        return f"fp8 storage loses {-difference:.3f} accepted tokens per step{share}, beyond the noise. {default}"
    return f"fp8 storage measured {difference:.3f} higher{share}, beyond the noise. {default}"


def fp8_cost(modes: dict[str, Any], epochs: int, default_storage: str) -> dict[str, Any]:
    """Mean acceptance length of the fp8-storage drafter against the bf16 one, with its standard error."""
    bf16, fp8 = modes["eagle3-bf16"], modes["eagle3-fp8"]
    a, b = bf16["mean_acceptance_length"], fp8["mean_acceptance_length"]
    se_a, se_b = bf16["mean_acceptance_length_stderr"], fp8["mean_acceptance_length_stderr"]
    difference = (b - a) if a is not None and b is not None else None
    stderr = (se_a**2 + se_b**2) ** 0.5 if se_a is not None and se_b is not None else None
    return {"epochs": epochs, "bf16": a, "fp8": b, "difference": difference, "stderr": stderr,
            "verdict": fp8_verdict(difference, stderr, a, default_storage)}
