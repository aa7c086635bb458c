"""Summarise a finished run from its stage manifests as a markdown table (wall time and key figures).

    .venv/bin/python scripts/pipeline_report.py --config configs/tiny.yaml
"""

import argparse
import sys

from eagle_pipeline.config import load_config
from eagle_pipeline.stage import STAGES, read_manifest


def key_figures(stage: str, counts: dict) -> str:
    c = counts
    if stage == "01_generate_data":
        return f"{c.get('samples')} conversations, {c.get('completion_tokens')} response tokens, {c.get('output_tokens_per_s')} output tok/s"
    if stage == "02_extract_hidden":
        return (f"{c.get('tokens')} tokens, {c.get('capture_tokens_per_s')} tok/s capture, {c.get('bytes_per_token')} B/token, "
                f"{(c.get('stored_bytes') or 0) / 1e6:.0f} MB")
    if stage == "03_build_vocab_map":
        return f"draft vocab {c.get('draft_vocab_size')}, coverage {c.get('coverage')}"
    if stage == "04_train":
        val = c.get("final_val") or {}
        acc = {k: round(float(v), 3) for k, v in val.items() if str(k).startswith("full_acc")}
        return (f"{c.get('epochs_completed')} epochs, {c.get('train_tokens_per_s')} train tok/s, peak RSS {c.get('peak_rss_mb')} MB, "
                f"val {acc}")
    if stage == "05_convert":
        return f"checks {c.get('checks')}"
    if stage == "06_serve_test":
        tps = {k: round(v, 1) for k, v in (c.get("tokens_per_s") or {}).items() if v is not None}
        per = [round(x, 3) for x in c.get("per_position_acceptance") or []]
        return (f"mean acceptance length {c.get('mean_acceptance_length')}, per position {per}, tok/s {tps}, "
                f"speed-up {c.get('speedup')}, greedy match {c.get('greedy_match')}")
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    print("| stage | status | wall time (s) | key figures |\n|---|---|---|---|")
    total = 0.0
    for stage in STAGES.values():
        manifest = read_manifest(cfg.stage_dir(stage)) or {}
        seconds = manifest.get("wall_time_s")
        total += seconds or 0
        print(f"| {stage} | {manifest.get('status', 'missing')} | {seconds if seconds is not None else ''} | "
              f"{key_figures(stage, manifest.get('counts', {})) if manifest else ''} |")
    print(f"| total | | {total:.0f} | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
