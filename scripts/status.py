"""Print a status table of every stage of a run, from the stage manifests and launch logs.

    .venv/bin/python scripts/status.py --config configs/kimi-k2.5-10.yaml
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
from eagle_pipeline.stage import StageRecord, read_stage_records


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


def stage_status(record: StageRecord, logs: Path) -> dict:
    stage, manifest, damage = record.name, record.manifest, record.damage
    exit_file, pid_file = logs / f"{stage}.exit", logs / f"{stage}.pid"
    code = exit_file.read_text().strip() if exit_file.exists() else None
    if pid_file.exists() and alive(pid_file):
        state = "running"
    elif damage:
        state = "damaged"
    elif manifest and record.status == "complete" and code in (None, "0"):
        state = "done"
    elif code not in (None, "0"):
        state = "failed"
    elif manifest:
        state = "interrupted"
    else:
        state = "pending"
    seconds = record.wall_time_s
    note = last_error(logs / f"{stage}.out") if state == "failed" else damage if state == "damaged" else ""
    if state == "failed":
        note = f"exit {code}: {note}"
    return {
        "stage": stage,
        "state": state,
        "samples": record.counts.get("samples", ""),
        "time": str(dt.timedelta(seconds=int(seconds))) if seconds is not None and state != "running" else "",
        "finished": record.finished_at[:19],
        "note": note,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args()
    try:
        cfg = load_config(args.config, args.overrides)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows = [stage_status(record, cfg.run_dir / "logs") for record in read_stage_records(cfg.run_dir)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(f"run {cfg.run_name} in {cfg.run_dir}")
    columns = ["stage", "state", "samples", "time", "finished", "note"]
    widths = {c: max(len(c), *(len(str(r[c])) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for row in rows:
        print("  ".join(str(row[c]).ljust(widths[c]) for c in columns))
    return 0


if __name__ == "__main__":
    sys.exit(main())
