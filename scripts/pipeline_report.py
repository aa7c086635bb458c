"""Summarise a finished run from its stage manifests as a markdown table (wall time and key figures).

    .venv/bin/python scripts/pipeline_report.py --config configs/tiny.yaml
"""

import argparse
import sys
from pathlib import Path

from eagle_pipeline.config import load_config
from eagle_pipeline.engine_starts import planned_target_starts, probe_starts
from eagle_pipeline.errors import BadInput
from eagle_pipeline.plan.disk import plan_table
from eagle_pipeline.plan.preconditions import check_host
from eagle_pipeline.serve.report import format_number, format_speedup, read_report
from eagle_pipeline.stage import STAGES, read_stage_records


def _per_position(values) -> str:
    return " / ".join(format_number(v) for v in values or []) or "-"


def key_figures(stage: str, counts: dict, stage_dir: Path) -> str:
    """The few figures of a finished stage that say whether it did its job, rounded for reading."""
    c = counts
    if stage == STAGES[1]:
        finish = ", ".join(f"{reason} {n}" for reason, n in (c.get("finish_reasons") or {}).items())
        return (f"{c.get('samples')} conversations, {c.get('completion_tokens')} answer tokens (finish_reason {finish or '-'}), "
                f"{format_number(c.get('output_tokens_per_s'), 1)} output tok/s")
    if stage == STAGES[2]:
        return (f"{c.get('tokens')} tokens, layers {c.get('layer_ids')} + final, {format_number(c.get('capture_tokens_per_s'), 1)} tok/s "
                f"captured, {format_number((c.get('bytes_per_token') or 0) / 1e3, 1)} KB/token, {format_number((c.get('stored_bytes') or 0) / 1e6, 1)} MB")
    if stage == STAGES[3]:
        adopted = f", adopted from {c['from_drafter']}" if c.get("from_drafter") else ""
        return (f"draft vocab {c.get('draft_vocab_size')} of {c.get('target_vocab_size')}, "
                f"coverage {format_number(100 * (c.get('coverage') or 0), 1)}% of the answer tokens{adopted}")
    if stage == STAGES[4]:
        best, val = c.get("best") or {}, c.get("final_val") or {}
        accuracy = [val.get(f"full_acc_{k}") for k in range(3) if f"full_acc_{k}" in val]
        return (f"{c.get('epochs_completed')} epochs, best {best.get('checkpoint', '-')} (predicted acceptance length "
                f"{format_number(best.get('predicted_acceptance_length'))}), last validation accuracy {_per_position(accuracy)}, "
                f"{format_number(c.get('train_tokens_per_s'), 0)} train tok/s, peak RSS {format_number((c.get('peak_rss_mb') or 0) / 1e3, 1)} GB")
    if stage == STAGES[5]:
        checks = c.get("checks") or {}  # name -> true, false or "skipped"
        failed = [name for name, ok in checks.items() if not ok]
        passed = [name for name, ok in checks.items() if ok is True]
        skipped = [name for name, ok in checks.items() if ok == "skipped"]
        return (f"{c.get('checkpoint')} converted; checks {'FAILED: ' + ', '.join(failed) if failed else 'all ok'} "
                f"({', '.join(passed)}{'; skipped: ' + ', '.join(skipped) if skipped else ''})")
    if stage == STAGES[6]:
        diagnosis = (c.get("diagnosis") or {}).get("status", "-")
        try:
            ngram = (read_report(stage_dir / "report.json").get("ngram_acceptance") or {}).get("mean_acceptance_length")
        except BadInput:
            ngram = None
        speed = c.get("tokens_per_s") or {}
        return (f"acceptance length {format_number(c.get('mean_acceptance_length'))} served, {format_number(c.get('predicted_mean_acceptance_length'))} "
                f"predicted ({diagnosis}), n-gram {format_number(ngram)}; per position {_per_position(c.get('per_position_acceptance'))}; "
                f"speed-up {format_speedup(c.get('speedup'))} ({', '.join(f'{mode} {format_number(v, 1)}' for mode, v in speed.items())} tok/s); "
                f"greedy match {c.get('greedy_match')}")
    return ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--plan", action="store_true", help="how often a full pass of this config starts the target, and the disk it plans, per stage")
    args = parser.parse_args()
    try:
        cfg = load_config(args.config, args.overrides)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plan:
        planned = planned_target_starts(cfg)
        print("| stage | target cold starts |\n|---|---|")
        for name, count in planned.items():
            print(f"| {name} | {count} |")
        print(f"| total | {sum(planned.values())} |")
        if cfg.serve.probe_engine == "on_engine_verdict" and probe_starts(cfg):
            print(f"(stage 06's engine probe adds up to {probe_starts(cfg)} more, only after an engine verdict)")
        try:  # what each stage writes into the run folder, against disk_budget_gb
            print("\n" + "\n".join(plan_table(cfg)))
        except BadInput as e:  # the stages' dry runs refuse the target themselves; the starts above hold without it
            print(f"\n(disk plan: needs the target's config.json: {e})")
        try:  # the stages' dry runs left what this host lacks to here (scripts/run_pipeline.sh --dry-run)
            check_host(cfg)
        except BadInput as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    print("| stage | status | wall time (s) | target engine starts (s) | key figures |\n|---|---|---|---|---|")
    total, starts, start_s = 0.0, 0, 0.0
    for record in read_stage_records(cfg.run_dir):
        seconds = record.wall_time_s
        total += seconds or 0
        engines = record.engine_starts
        starts += engines.get("target_starts", 0)
        start_s += engines.get("target_start_s", 0.0)
        started = f"{engines['target_starts']} ({engines['target_start_s']:.0f})" if engines else ""
        status = "damaged" if record.damage else record.status or "not run"
        figures = key_figures(record.name, record.counts, record.folder) if record.status == "complete" else record.damage
        print(f"| {record.name} | {status} | {format_number(seconds, 0) if seconds is not None else ''} | {started} | {figures} |")
    print(f"| total | | {total:.0f} | {starts} ({start_s:.0f}) | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
