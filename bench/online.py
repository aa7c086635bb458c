"""Online against offline training (hidden_states.mode), on the same conversations and seed: does online training
give the same drafter, and what does each mode cost?

    python -m bench.online --config configs/tiny.yaml --samples 120 --epochs 3

Stage 01 runs once; every arm copies its conversations and runs stages 02-04 for real in its own run folder:
  - offline: stage 02 captures and stores every sample's states, stage 04 reads them;
  - online_file: stage 02 writes the dataset only; stage 04 starts a capture server and trains through
    speculators' online dataset, the states handed over as files (in the engine's dtype) and deleted after use;
  - online_fp8: the same, the states quantized to fp8 in flight (hs_connectors' fp8 connector);
  - online_mooncake: the same, through a Mooncake master and store over TCP (n/a where Mooncake is missing).
The engine runs in --engine-dtype (bfloat16 by default), so the file transfer carries the same bf16 states that
offline stage 02 stores. Online arms use a window of one sample (the trainer asks for each in turn with its steps).

What each figure is, and how "the same drafter" is judged, the document says beside its tables.

Output: the Markdown document (--doc, default docs/benchmarks/online.md) headed by this command, and online.json
with the raw figures in the work folder (--work-dir, default runs/online-bench, emptied by every run).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

from bench import arms
from bench.arms import REPO
from bench.report import section
from bench.run import machine
from eagle_pipeline import atomic
from eagle_pipeline.errors import BadInput
from eagle_pipeline.stage import read_manifest

WORK_MARKER = ".online-bench-work-dir"
ARMS = {  # arm -> hidden_states overrides
    "offline": {"hidden_states.mode": "offline"},
    "online_file": {"hidden_states.mode": "online", "hidden_states.transfer": "file"},
    "online_fp8": {"hidden_states.mode": "online", "hidden_states.transfer": "fp8"},
    "online_mooncake": {"hidden_states.mode": "online", "hidden_states.transfer": "mooncake"},
}


def overrides(args: argparse.Namespace, arm: str, work: Path) -> list[str]:
    values = {"data_root": str(work), "run_name": arm, "data.num_samples": args.samples, "train.epochs": args.epochs,
              "train.val_ratio": args.val_ratio, "train.predict_conversations": args.samples,
              "verifier.dtype": args.engine_dtype, **ARMS[arm]}
    if arm != "offline":
        values["hidden_states.online_window"] = 1
    return [f"{key}={value}" for key, value in values.items()]


def run_arm(args: argparse.Namespace, arm: str, work: Path, log) -> dict[str, Any]:
    sets = overrides(args, arm, work)
    run_dir = work / arm
    if arm != "offline":
        arms.copy_conversations(work / "offline" / "01_generate_data", run_dir / "01_generate_data", args.samples)
    for script in ("02_extract_hidden", "03_build_vocab_map", "04_train"):
        started = time.monotonic()
        arms.run_stage(script, args.config, sets, work / "logs" / f"{arm}-{script}.log", log)
        log(f"{arm}: {script} {time.monotonic() - started:.0f} s")
    stage02, stage04 = read_manifest(run_dir / "02_extract_hidden"), read_manifest(run_dir / "04_train")
    return {"stage02": {"wall_s": stage02["wall_time_s"], **{k: stage02["counts"].get(k) for k in
                                                            ("tokens", "stored_bytes", "capture_tokens_per_s")}},
            "stage04": {"wall_s": stage04["wall_time_s"], "train_tokens_per_s": stage04["counts"]["train_tokens_per_s"],
                        "last": stage04["counts"]["last_checkpoint"], "final_val": stage04["counts"]["final_val"],
                        "best": stage04["counts"]["best"], "online": stage04["counts"].get("online")}}


def last_checkpoint(work: Path, arm: str, figures: dict) -> Path:
    return work / arm / "04_train" / figures[arm]["stage04"]["last"]


def per_conversation_lengths(checkpoint: Path, conversations, draft_tokens: int) -> list[float]:
    """Predicted acceptance length of each conversation (1 + mean accepted drafts over its chains)."""
    from eagle_pipeline.predict.acceptance import predict_acceptance

    result = predict_acceptance(checkpoint, conversations, draft_tokens, record_chains=True)
    accepted: dict[int, list[int]] = {}
    for sequence, _start, count in result["chains"]:
        accepted.setdefault(sequence, []).append(count)
    return [1 + statistics.fmean(accepted[s]) if s in accepted else math.nan for s in range(len(conversations))]


def weight_difference(a: Path, b: Path) -> float:
    """Relative L2 difference of the trained weights (the frozen target embedding left out)."""
    from safetensors.torch import load_file

    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    num = den = 0.0
    for name, tensor in wa.items():
        if "embed_tokens" in name or "verifier" in name or not tensor.is_floating_point():
            continue
        num += float((tensor.float() - wb[name].float()).pow(2).sum())
        den += float(tensor.float().pow(2).sum())
    return math.sqrt(num / den) if den else math.nan


def compare_drafters(work: Path, figures: dict, draft_tokens: int) -> dict[str, Any]:
    """Each online arm's last checkpoint against the offline one, on the offline arm's validation conversations."""
    from eagle_pipeline.train.predicted_acceptance import validation_conversations
    from eagle_pipeline.train.topic_split import read_split

    offline_out = work / "offline" / "04_train"
    rows = len(read_split(offline_out)["val_rows"])
    conversations = validation_conversations(work / "offline" / "02_extract_hidden" / "data", offline_out, rows)
    reference = per_conversation_lengths(last_checkpoint(work, "offline", figures), conversations, draft_tokens)
    out = {"conversations": len(conversations), "offline_mean": statistics.fmean(reference), "arms": {}}
    for arm in figures:
        if arm == "offline" or "error" in figures[arm]:
            continue
        lengths = per_conversation_lengths(last_checkpoint(work, arm, figures), conversations, draft_tokens)
        diffs = [x - y for x, y in zip(lengths, reference) if not (math.isnan(x) or math.isnan(y))]
        half = 1.96 * statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else math.nan
        out["arms"][arm] = {"mean": statistics.fmean(lengths), "mean_difference": statistics.fmean(diffs),
                            "ci95_half_width": half, "conversations": len(diffs),
                            "weight_relative_difference": weight_difference(last_checkpoint(work, arm, figures),
                                                                            last_checkpoint(work, "offline", figures))}
    return out


def _gb(n: float | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _num(x: Any, fmt: str = "{:.0f}") -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else fmt.format(x)


def render(command: str, args: argparse.Namespace, figures: dict, same: dict, env: dict, minutes: float) -> str:
    rows = []
    for arm, f in figures.items():
        if "error" in f:
            rows.append(f"| {arm} | n/a ({f['error']}) | | | | | | | | |")
            continue
        s2, s4, online = f["stage02"], f["stage04"], f["stage04"]["online"]
        if online is None:
            held = f"{_gb(s2['stored_bytes'])} (every sample, on disk)"
            capture = f"{_num(s2['capture_tokens_per_s'])} (stage 02's engine)"
        else:
            peak = online.get("store_peak_bytes", online.get("disk_peak_bytes"))
            where = "in the Mooncake store" if online["transfer"] == "mooncake" else "on disk"
            held = f"{_gb(peak)} peak {where} (bound {_gb(online['window_bound_bytes'])}) + {_gb(online['kept_bytes'])} kept"
            effective = online["capture_tokens"] / s4["wall_s"] if s4["wall_s"] else None
            capture = f"{_num(online['capture_tokens_per_s'])} (server) / {_num(effective)} (over stage 04)"
        val = (s4["final_val"] or {}).get("loss")
        predicted = same["offline_mean"] if arm == "offline" else same["arms"].get(arm, {}).get("mean")
        rows.append(f"| {arm} | {_num(s2['wall_s'])} | {_num(s4['wall_s'])} | {_num(s2['wall_s'] + s4['wall_s'])} | "
                    f"{_num(s4['train_tokens_per_s'])} | "
                    f"{capture} | {held} | {_num(val, '{:.4f}')} | {_num(predicted, '{:.3f}')} |")
    comparisons = []
    for arm, c in same["arms"].items():
        comparisons.append(f"| {arm} | {c['mean_difference']:+.3f} | ±{c['ci95_half_width']:.3f} | "
                           f"{'yes' if abs(c['mean_difference']) <= c['ci95_half_width'] else 'no'} | "
                           f"{c['weight_relative_difference']:.2%} |")
    return "\n".join([*section(
        "# Online against offline training",
        ["Regenerate (this file is the command's output; the raw figures are in `online.json` in its work folder,",
         f"`{args.work_dir}`):"],
        ["```bash", command, "```"],
        f"Measured on {env['cpu']} ({env['cores']} cores), {time.strftime('%Y-%m-%d')}, in {minutes:.0f} minutes, the "
        f"machine's load average {env['load_start']:.1f} at the start and {env['load_end']:.1f} at the end. One run per "
        "arm, in turn: on a shared 2-core machine timings move by tens of percent between runs, so read the timing "
        "columns as orders of magnitude and the drafter columns as the comparison.",
        f"Setup: `{Path(args.config).name}` with {args.samples} conversations (stage 01 once, copied into every arm), "
        f"{args.epochs} epoch(s), the same seed and the same held-out topics ({same['conversations']} validation "
        f"conversations), the engine in {args.engine_dtype}. Online arms: one capture server started by stage 04 on "
        "this host, a window of one sample (the trainer asks for each in turn with its steps), every epoch "
        "capturing every sample again (`bench/online.py` says what each arm is).",
        ["| arm | stage 02 s | stage 04 s | 02 + 04 s | trained tokens/s | capture tokens/s | states held at once | "
         "val loss (last) | predicted acceptance (last) |",
         "|---|---|---|---|---|---|---|---|---|",
         *rows],
        "Trained tokens/s is speculators' per-step figure, whose step time includes fetching the batch: for the "
        "online arms that is the capture itself. Capture tokens/s online: the server's prompt tokens over its "
        "prefill seconds, and the tokens captured over stage 04's wall time (server start, kept rows and "
        "validation included).",
    ), *section(
        "## The same drafter?",
        f"Each arm's last checkpoint replayed on the offline arm's {same['conversations']} validation conversations "
        "(its stored states), conversation by conversation against the offline drafter: the mean difference of "
        "predicted acceptance length and its 95% interval (1.96 standard errors of the paired differences), and "
        "the relative L2 difference of the trained weights.",
        ["| arm | acceptance length − offline | 95% interval | within noise | weights differ by |",
         "|---|---|---|---|---|",
         *comparisons],
    )])


def run(args: argparse.Namespace, argv: list[str] | None = None) -> None:
    from eagle_pipeline.config import load_config
    from eagle_pipeline.online.mooncake import mooncake_problem

    work = Path(args.work_dir)
    chosen = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = sorted(set(chosen) - set(ARMS))
    if unknown or "offline" not in chosen:
        raise BadInput(f"--arms: {unknown or 'offline is needed'}; choose among {', '.join(ARMS)}")
    arms.prepare_work_dir(work, WORK_MARKER, made_by="bench.online", kind="online benchmark work folder")
    started, load_start = time.monotonic(), os.getloadavg()[0]
    log = partial(print, flush=True)
    arms.run_stage("01_generate_data", args.config, overrides(args, "offline", work),
                   work / "logs" / "offline-01_generate_data.log", log)
    figures: dict[str, Any] = {}
    for arm in chosen:
        problem = mooncake_problem() if arm == "online_mooncake" else None
        figures[arm] = {"error": problem} if problem else run_arm(args, arm, work, log)
    draft_tokens = load_config(args.config).train.ttt_steps
    same = compare_drafters(work, figures, draft_tokens)
    env = {**machine(), "load_start": load_start, "load_end": os.getloadavg()[0]}
    minutes = (time.monotonic() - started) / 60
    atomic.write_json(work / "online.json", {"figures": figures, "same_drafter": same, "machine": env, "minutes": minutes})
    command = ".venv/bin/python -m bench.online " + shlex.join(argv if argv is not None else sys.argv[1:])
    atomic.write_text(Path(args.doc), render(command, args, figures, same, env, minutes))
    log(f"wrote {args.doc} ({minutes:.0f} minutes)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.online", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the run config the arms extend (configs/tiny.yaml)")
    parser.add_argument("--samples", type=int, default=120, help="conversations (data.num_samples)")
    parser.add_argument("--epochs", type=int, default=3, help="train.epochs")
    parser.add_argument("--val-ratio", type=float, default=0.12, help="train.val_ratio: the conversations replayed")
    parser.add_argument("--engine-dtype", default="bfloat16", help="verifier.dtype of every arm")
    parser.add_argument("--work-dir", default=str(REPO / "runs" / "online-bench"))
    parser.add_argument("--doc", default=str(REPO / "docs" / "benchmarks" / "online.md"))
    parser.add_argument("--arms", default=",".join(ARMS), help="which arms, comma-separated")
    args = parser.parse_args(argv)
    return arms.run_command(lambda parsed: run(parsed, argv), args, interrupted="online benchmark stopped",
                            logs=f"logs in {args.work_dir}/logs")


if __name__ == "__main__":
    sys.exit(main())
