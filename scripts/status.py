"""A run in one table, from its stage manifests and launch logs: each stage's state, wall time, the target's engine
starts and the key figures of a finished stage (or what failed, or what is damaged and the fix).

    .venv/bin/python scripts/status.py --config configs/kimi-k2.5-10.yaml [--json | --plan]
States: done (manifest complete), running (a live launch pid), failed (non-zero exit code, with the
last error line), interrupted (work started, no live process, no exit code), damaged (a manifest that
cannot be read, with what is wrong and the fix), pending (nothing yet).
"""

import argparse
import datetime as dt
import json
import os
import sys
from pathlib import Path

from eagle_pipeline.config import load_config
from eagle_pipeline.errors import BadInput
from eagle_pipeline.plan.disk import plan_table
from eagle_pipeline.plan.engines import target_starts
from eagle_pipeline.plan.preconditions import check_host
from eagle_pipeline.serve.report import format_number, format_speedup, read_report
from eagle_pipeline.stage import STAGES, StageRecord, read_stage_records


def alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text().strip()), 0)
        return True
    except (OSError, ValueError):
        return False


def last_error(out_file: Path) -> str:
    if not out_file.exists():
        return ""
    lines = [line.strip() for line in out_file.read_text(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith(("error:", "failed:")):
            return line
    return lines[-1] if lines else ""


def _per_position(values) -> str:
    return " / ".join(format_number(v) for v in values or []) or "-"


def key_figures(stage: str, counts: dict, stage_dir: Path) -> str:
    """The few figures of a finished stage that say whether it did its job, rounded for reading."""
    c = counts
    if stage == STAGES[1]:
        finish = ", ".join(f"{reason} {n}" for reason, n in (c.get("finish_reasons") or {}).items())
        return (f"{c.get('samples')} conversations, {c.get('completion_tokens')} answer tokens (finish_reason "
                f"{finish or '-'}), {format_number(c.get('output_tokens_per_s'), 1)} output tok/s")
    if stage == STAGES[2]:
        return (f"{c.get('tokens')} tokens, layers {c.get('layer_ids')} + final, "
                f"{format_number(c.get('capture_tokens_per_s'), 1)} tok/s captured, "
                f"{format_number((c.get('bytes_per_token') or 0) / 1e3, 1)} KB/token, "
                f"{format_number((c.get('stored_bytes') or 0) / 1e6, 1)} MB")
    if stage == STAGES[3]:
        adopted = f", adopted from {c['from_drafter']}" if c.get("from_drafter") else ""
        return (f"draft vocab {c.get('draft_vocab_size')} of {c.get('target_vocab_size')}, "
                f"coverage {format_number(100 * (c.get('coverage') or 0), 1)}% of the answer tokens{adopted}")
    if stage == STAGES[4]:
        best, val = c.get("best") or {}, c.get("final_val") or {}
        accuracy = [val.get(f"full_acc_{k}") for k in range(3) if f"full_acc_{k}" in val]
        return (f"{c.get('epochs_completed')} epochs, best {best.get('checkpoint', '-')} (predicted acceptance length "
                f"{format_number(best.get('predicted_acceptance_length'))}), last validation accuracy "
                f"{_per_position(accuracy)}, {format_number(c.get('train_tokens_per_s'), 0)} train tok/s, peak RSS "
                f"{format_number((c.get('peak_rss_mb') or 0) / 1e3, 1)} GB")
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
        speed = ", ".join(f"{mode} {format_number(v, 1)}" for mode, v in (c.get("tokens_per_s") or {}).items())
        return (f"acceptance length {format_number(c.get('mean_acceptance_length'))} served, "
                f"{format_number(c.get('predicted_mean_acceptance_length'))} predicted ({diagnosis}), n-gram "
                f"{format_number(ngram)}; per position {_per_position(c.get('per_position_acceptance'))}; "
                f"speed-up {format_speedup(c.get('speedup'))} ({speed} tok/s); greedy match {c.get('greedy_match')}")
    return ""


def stage_status(record: StageRecord, logs: Path) -> dict:
    stage, manifest, damage = record.name, record.manifest, record.damage
    counts, engines = manifest.get("counts") or {}, manifest.get("engine_starts") or {}
    exit_file, pid_file = logs / f"{stage}.exit", logs / f"{stage}.pid"
    code = exit_file.read_text().strip() if exit_file.exists() else None
    if pid_file.exists() and alive(pid_file):
        state = "running"
    elif damage:
        state = "damaged"
    elif manifest.get("status") == "complete" and code in (None, "0"):
        state = "done"
    elif code not in (None, "0"):
        state = "failed"
    elif manifest:
        state = "interrupted"
    else:
        state = "pending"
    seconds = manifest.get("wall_time_s") if state != "running" else None
    note = f"exit {code}: {last_error(logs / f'{stage}.out')}" if state == "failed" else damage
    return {
        "stage": stage,
        "state": state,
        "samples": counts.get("samples", ""),
        "time": str(dt.timedelta(seconds=int(seconds))) if seconds is not None else "",
        "wall_time_s": seconds,
        "finished": (manifest.get("finished_at") or "")[:19],
        "target_starts": engines.get("target_starts"),
        "target_start_s": engines.get("target_start_s"),
        "figures": key_figures(stage, counts, record.folder) if state == "done" else "",
        "note": note,
    }


def print_table(rows: list[list[str]]) -> None:
    """Markdown, each column but the last padded to its widest cell, so that it reads in a terminal too."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)] + [0]
    rows.insert(1, ["-" * w for w in widths[:-1]] + ["---"])
    for row in rows:
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths)) + " |")


def print_plan(cfg) -> int:
    """How often a full pass of `cfg` starts the target and the disk it plans, per stage; then what the host
    lacks (scripts/run_pipeline.sh --dry-run ends with this)."""
    planned, probe = target_starts(cfg), sum(target_starts(cfg, counted=False).values())
    print("| stage | target cold starts |\n|---|---|")
    for name, count in planned.items():
        print(f"| {name} | {count} |")
    print(f"| total | {sum(planned.values())} |")
    if probe:
        print(f"(stage 06's engine probe adds up to {probe} more, only after an engine verdict)")
    try:  # what each stage writes into the run folder, against disk_budget_gb
        print("\n" + "\n".join(plan_table(cfg)))
    except BadInput as e:  # the stages' dry runs refuse the target themselves; the starts above hold without it
        print(f"\n(disk plan: needs the target's config.json: {e})")
    try:  # the stages' dry runs left what this host lacks to here
        check_host(cfg)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plan", action="store_true",
                        help="how often a full pass of this config starts the target, and the disk it plans, per stage")
    args = parser.parse_args()
    try:
        cfg = load_config(args.config, args.overrides)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.plan:
        return print_plan(cfg)
    rows = [stage_status(record, cfg.run_dir / "logs") for record in read_stage_records(cfg.run_dir)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"run {cfg.run_name} in {cfg.run_dir}")
    total = {"stage": "total", "state": "", "figures": "", "note": ""}
    for key in ("wall_time_s", "target_starts", "target_start_s"):
        total[key] = sum(row[key] or 0 for row in rows)
    table = [["stage", "state", "wall time (s)", "target engine starts (s)", "key figures"]]
    for row in [*rows, total]:
        seconds = format_number(row["wall_time_s"], 0) if row["wall_time_s"] is not None else ""
        started = f"{row['target_starts']} ({row['target_start_s']:.0f})" if row["target_starts"] is not None else ""
        table.append([row["stage"], row["state"], seconds, started, row["figures"] or row["note"]])
    print_table(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
