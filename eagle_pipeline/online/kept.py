"""The validation rows whose states an online run captures once and keeps for the replays (docs/online.md, "How to
run it", step 4), in `04_train/kept_states/hs_<row>.safetensors` (stage 02's row numbers and format)."""

from __future__ import annotations

import os
from pathlib import Path

from eagle_pipeline.samples import SAMPLES_DIR, StorageDtype, sample_files, sample_matches, sample_path, write_sample

KEPT_DIR = "kept_states"


def keep_count(cfg) -> int:
    """How many validation rows the replays read: the checkpoint replay's, or stage 05's if it reads more."""
    parity = cfg.convert.parity_prompts if cfg.convert.parity == "replay" else 0
    return max(cfg.train.predict_conversations, parity)


def kept_storage(transfer: str) -> StorageDtype:
    """Kept rows in the precision the trainer gets the others in: fp8 for the fp8 transfer, else bf16 (how stage 02
    stores states; speculators' file backend reads them as they are)."""
    return StorageDtype.FP8 if transfer == "fp8" else StorageDtype.BFLOAT16


def stored_sample_path(data_dir: Path, out_dir: Path, row: int) -> Path:
    """Where the states of stage 02's row `row` are stored: stage 02's file (offline), else the one stage 04
    keeps (online)."""
    offline = sample_path(Path(data_dir) / SAMPLES_DIR, row)
    return offline if offline.exists() else sample_path(Path(out_dir) / KEPT_DIR, row)


def capture_kept(client, rows: dict[int, list[int]], kept_dir: Path, *, num_states: int, hidden_size: int,
                 storage_dtype: StorageDtype) -> int:
    """Capture and store the rows (stage 02 row -> token ids) not already kept whole; return how many were
    captured now. Rows no longer asked for are removed."""
    kept_dir = Path(kept_dir)
    kept_dir.mkdir(parents=True, exist_ok=True)
    for row, stale in sample_files(kept_dir).items():
        if row not in rows:
            stale.unlink()
    captured = 0
    for row, input_ids in rows.items():
        if sample_matches(sample_path(kept_dir, row), input_ids, num_states, hidden_size):
            continue
        sample, _ = client.capture(input_ids)
        write_sample(kept_dir, row, sample, input_ids, num_states=num_states, hidden_size=hidden_size,
                     storage_dtype=storage_dtype)
        captured += 1
    return captured


def link_kept_states(view_dir: Path, order: list[int], kept_dir: Path) -> int:
    """In the training view (`split_data/`, row i = stage 02's row order[i]), link each kept row's states and
    drop the links to stage 02's states, which an online run never stored; return how many are linked."""
    samples = Path(view_dir) / SAMPLES_DIR
    linked = 0
    for new_row, old_row in enumerate(order):
        link = sample_path(samples, new_row)
        link.unlink(missing_ok=True)
        kept = sample_path(kept_dir, old_row)
        if kept.is_file():
            os.symlink(os.path.relpath(kept, samples), link)
            linked += 1
    return linked
