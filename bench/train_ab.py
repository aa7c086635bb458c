"""Stage 04's training throughput, A/B: how the batches are packed and padded, on the pipeline run's data.

    python -m bench.train_ab --config configs/tiny.yaml --steps 60 --repeats 2

The arms (ARMS; what each changes: the table of docs/benchmarks/training.md) each run speculators' own trainer
with the run's train settings, from scratch, for `--steps` optimizer steps on the finished run's stage 02 data and
stage 03 vocabulary, interleaved as that page says; the bf16 arms run where the run trains in float32 and this CPU
has a bf16 matmul kernel (n/a with the reason otherwise). `shipped` and `unpadded` train on the same batches from
the same start, so their step losses must agree: the table gives the largest relative difference. Batches per
epoch and how full they are come from the samplers themselves, over the run's training split.

Output in <data_root>/<run_name>-train-ab/ (or --work-dir): train_ab.json, train_ab.md and one training
folder per arm and repetition (emptied by every run).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any
from unittest.mock import patch

import numpy as np

from bench import arms
from bench.flops import unavailable_matmul_kernels
from bench.stats import interleaved_order, not_available, paired_ratios, spread
from eagle_pipeline import atomic
from eagle_pipeline.config import load_config
from eagle_pipeline.errors import BadInput
from eagle_pipeline.stage import require_complete, require_sample_layout
from eagle_pipeline.train.metrics import METRICS_CSV, read_metrics
from eagle_pipeline.train.settings import TrainRun
from eagle_pipeline.train.topic_split import read_split
from eagle_pipeline.verifier import Verifier

WORK_MARKER = ".train-ab-work-dir"
ARMS = ("shipped", "unpadded", "best_fit", "unpadded_bf16", "best_fit_bf16", "unpadded_bf16_sdpa")
PACKING = {"shipped": "sequential", "unpadded": "sequential", "best_fit": "best_fit", "unpadded_bf16": "sequential",
           "best_fit_bf16": "best_fit", "unpadded_bf16_sdpa": "sequential"}
BF16_ARMS = ("unpadded_bf16", "best_fit_bf16", "unpadded_bf16_sdpa")  # autocast, where bf16_arm_unavailable allows
SDPA_ARMS = ("shipped", "unpadded_bf16_sdpa")  # speculators' own attention over the dense TTT mask


def bf16_arm_unavailable(train_dtype: str) -> str | None:
    """Why the bf16 arms cannot run here ("n/a (...)"), or None when it can."""
    if train_dtype != "float32":
        return not_available(f"the run already trains in {train_dtype}")
    missing = unavailable_matmul_kernels("bfloat16")
    if "torch" in missing:  # speculators' drafter runs torch's own kernels
        return missing["torch"]
    return None


def packing_figures(split_dir: Path, train_data_ratio: float, total_seq_len: int, seed: int) -> dict[str, dict[str, float]]:
    """Batches per epoch and the share of their tokens that are real, per packing, for epoch 0's shuffle of
    the training rows (the split view's first `train_data_ratio` of its rows)."""
    from datasets import load_from_disk

    from patches import speculators_packing

    all_lengths = load_from_disk(str(split_dir)).with_format(None)["seq_len"]
    train_rows = round(train_data_ratio * len(all_lengths))
    lengths = np.clip(np.array(all_lengths[:train_rows]), 0, total_seq_len)
    order = np.random.default_rng(seed).permutation(len(lengths))
    packers = {"sequential": speculators_packing.shipped_packing(), "best_fit": speculators_packing.best_fit_batches}
    figures = {}
    for name, pack in packers.items():
        batches = pack(lengths[order], total_seq_len, 0, 1)
        real = sum(int(lengths[order][batch].sum()) for batch in batches)
        figures[name] = {"batches": len(batches), "fill": real / (len(batches) * total_seq_len)}
    return figures


def run(args: argparse.Namespace) -> int:
    from eagle_pipeline.train import runner
    from patches import speculators_packing, speculators_ttt_attention

    cfg = load_config(args.config, args.overrides)
    if args.steps < 2 or args.repeats < 1:
        raise BadInput("--steps must be at least 2 and --repeats at least 1")
    if cfg.train.num_gpus != 0:
        raise BadInput("train.num_gpus: this benchmark measures CPU training; set it to 0")
    _, layout = require_sample_layout(cfg)
    require_complete(cfg, 3)
    work = arms.work_dir(args, cfg, "train-ab")
    arms.prepare_work_dir(work, WORK_MARKER, "bench.train_ab", "training A/B folder")
    verifier = Verifier.from_config(cfg)
    vocab_dir = cfg.stage_dir("03_build_vocab_map")
    data_dir = cfg.stage_dir("02_extract_hidden") / "data"

    def train_run(out_dir: Path) -> TrainRun:
        return TrainRun(data_dir=data_dir, d2t_path=vocab_dir / "d2t.npy", t2d_path=vocab_dir / "t2d.npy",
                        verifier_dir=verifier.path, out_dir=out_dir, layer_ids=list(layout.layer_ids), seed=cfg.seed,
                        storage_dtype=layout.storage_dtype, device="cpu", max_steps=args.steps)

    unavailable = dict.fromkeys(BF16_ARMS, reason) if (reason := bf16_arm_unavailable(cfg.train.dtype)) else {}
    measured = [arm for arm in ARMS if arm not in unavailable]
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in measured}
    started = time.time()
    for repetition in range(args.repeats):
        for arm in interleaved_order(measured, repetition):
            out_dir = work / f"{arm}-{repetition}" / "04_train"
            dtype = "bfloat16" if arm in BF16_ARMS else cfg.train.dtype
            settings = cfg.train.model_copy(update={"packing": PACKING[arm], "dtype": dtype, "early_stop_patience": None})
            print(f"repetition {repetition + 1}/{args.repeats}: {arm} ({args.steps} steps)", flush=True)
            with contextlib.ExitStack() as undo:  # the CPU patches an arm trains without
                if arm == "shipped":  # speculators' padded batches
                    undo.enter_context(patch.object(speculators_packing, "trim_padding", lambda batch: batch))
                if arm in SDPA_ARMS:  # speculators' SDPA attention over the dense TTT mask
                    undo.enter_context(patch.object(speculators_ttt_attention, "uses_block_attention", lambda _: False))
                runner.train_drafter(settings, train_run(out_dir))
            rows = [row for row in read_metrics(out_dir / METRICS_CSV) if row["split"] == "train"]
            runs[arm].append({"tokens_per_s": statistics.median(row["tokens_per_s"] for row in rows),
                              "losses": [row["loss"] for row in rows]})
    # The run's training split, as the trainer reads it (validation topics last).
    split_run = train_run(work / "shipped-0" / "04_train")
    train_data_ratio = read_split(split_run.out_dir)["train_data_ratio"]
    results = {
        "config": args.config,
        "steps": args.steps,
        "repeats": args.repeats,
        "wall_s": time.time() - started,
        "total_seq_len": cfg.train.total_seq_len,
        **summarize(runs, unavailable),
        "packing": packing_figures(split_run.split_dir, train_data_ratio, cfg.train.total_seq_len, cfg.seed),
    }
    atomic.write_json(work / "train_ab.json", results)
    atomic.write_text(work / "train_ab.md", report(results))
    print(report(results))
    return 0


def summarize(runs: dict[str, list[dict[str, Any]]], unavailable: dict[str, str] | None = None) -> dict[str, Any]:
    """Per arm: tokens/s and its ratio to `shipped` pair by pair (an arm this CPU cannot run: its n/a reason);
    the attention patch's own ratio (unpadded_bf16 over unpadded_bf16_sdpa); how far the unpadded losses stray."""
    unavailable = unavailable or {}
    rates = {arm: [r["tokens_per_s"] for r in runs[arm]] for arm in ARMS if arm in runs}
    blocks, sdpa = "unpadded_bf16", "unpadded_bf16_sdpa"
    return {
        "tokens_per_s": {arm: spread(rates[arm]) if arm in rates else unavailable[arm] for arm in ARMS},
        "ratio_to_shipped": {arm: spread(paired_ratios(rates[arm], rates["shipped"])) if arm in rates else unavailable[arm]
                             for arm in ARMS},
        "ratio_block_attention_over_sdpa": spread(paired_ratios(rates[blocks], rates[sdpa]))
        if blocks in rates and sdpa in rates else unavailable.get(sdpa),
        "loss_max_relative_difference_unpadded_vs_shipped": max(
            abs(a - b) / abs(b) for shipped, unpadded in zip(runs["shipped"], runs["unpadded"], strict=True)
            for a, b in zip(unpadded["losses"], shipped["losses"], strict=True)),
    }


def report(results: dict[str, Any]) -> str:
    lines = [
        "| arm | training tokens/s | ratio to shipped |",
        "|---|---|---|",
    ]
    for arm in ARMS:
        t, r = results["tokens_per_s"][arm], results["ratio_to_shipped"][arm]
        if isinstance(t, str):  # n/a on this CPU, with the reason
            lines.append(f"| {arm} | {t} | - |")
        else:
            lines.append(f"| {arm} | {t['median']:,.0f} [{t['min']:,.0f}-{t['max']:,.0f}] | {r['median']:.2f}x |")
    lines += ["", f"| packing at {results['total_seq_len']} tokens | batches per epoch | real tokens per batch |", "|---|---|---|"]
    for name, figure in results["packing"].items():
        lines.append(f"| {name} | {figure['batches']} | {figure['fill']:.1%} |")
    attention = results["ratio_block_attention_over_sdpa"]
    if attention is not None:
        figure = attention if isinstance(attention, str) else f"{attention['median']:.2f}x"
        lines += ["", f"Attention by blocks against speculators' SDPA (unpadded_bf16 over unpadded_bf16_sdpa): {figure}."]
    lines += ["", f"Step losses, unpadded against shipped (same batches, same start): largest relative difference "
              f"{results['loss_max_relative_difference_unpadded_vs_shipped']:.1e}.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = arms.parser("python -m bench.train_ab", __doc__, "train-ab")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps per training run")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each arm, interleaved")
    args = parser.parse_args(argv)
    return arms.run_command(run, args, interrupted="rerun to measure again (the work folder is emptied)",
                            logs="the trainer's own output is above")


if __name__ == "__main__":
    sys.exit(main())
