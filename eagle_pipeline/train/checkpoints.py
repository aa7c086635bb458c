"""The checkpoint folder: which epoch checkpoints are complete, removing torn ones, pruning, best.json.

speculators saves a checkpoint at the end of each epoch (`training_state.json` is its last file) and
then validates it; the metrics recorder writes that validation as `validation.json` into the folder. A
checkpoint is complete once both exist. A rerun after a kill deletes incomplete (torn) folders first, so
speculators resumes from the newest complete one, optimizer, scheduler and step included, and no epoch
goes unvalidated. After each validation only the newest `keep_last` complete checkpoints and the best one
(best.json) are kept; which is the best, and when early stopping ends a run:
docs/formats.md, "speculators checkpoint".
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from eagle_pipeline import atomic
from eagle_pipeline.train.early_stop import stop_due
from eagle_pipeline.train.predicted_acceptance import PREDICTED_LENGTH, selection_key, selection_rule
from eagle_pipeline.train.settings import CHECKPOINTS

BEST_FILE = "best.json"
# speculators writes this last into a checkpoint folder (Trainer._save_training_state).
TRAINING_STATE = "training_state.json"
# Written here once speculators has validated the checkpoint: the checkpoint is complete.
COMPLETE_MARKER = "validation.json"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "optimizer_state_dict.pt", "scheduler_state_dict.pt")


def _epoch_dirs(checkpoint_dir: Path) -> list[Path]:
    if not checkpoint_dir.is_dir():
        return []
    return sorted(
        (p for p in checkpoint_dir.iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit()),
        key=lambda p: int(p.name),
    )


def read_training_state(epoch_dir: Path) -> dict[str, Any] | None:
    """speculators' training_state.json plus the validation loss if the checkpoint is complete, else None."""
    files = (*CHECKPOINT_FILES, TRAINING_STATE, COMPLETE_MARKER)
    if not all((epoch_dir / name).is_file() for name in files):
        return None
    try:
        state = json.loads((epoch_dir / TRAINING_STATE).read_text())
        validation = json.loads((epoch_dir / COMPLETE_MARKER).read_text())
    except (json.JSONDecodeError, OSError):
        return None
    if state.get("epoch") != int(epoch_dir.name) or "global_step" not in state or "loss" not in validation:
        return None
    return {**state, "val_loss": validation["loss"], PREDICTED_LENGTH: validation.get(PREDICTED_LENGTH)}


def complete_checkpoints(checkpoint_dir: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """epoch -> training state of every complete checkpoint."""
    found = {}
    for epoch_dir in _epoch_dirs(Path(checkpoint_dir)):
        state = read_training_state(epoch_dir)
        if state is not None:
            found[int(epoch_dir.name)] = state
    return found


def newest_checkpoint(checkpoint_dir: str | os.PathLike) -> dict[str, Any] | None:
    complete = complete_checkpoints(checkpoint_dir)
    return complete[max(complete)] if complete else None


def mark_complete(checkpoint_dir: Path, epoch: int, validation: dict[str, Any]) -> None:
    atomic.write_json(checkpoint_dir / str(epoch) / COMPLETE_MARKER, validation)


def _delete_dir(path: Path) -> None:
    # Rename first, so a kill during the delete leaves a .tmp- name that the next run sweeps.
    trash = path.with_name(f"{atomic.TMP_PREFIX}deleted-{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_dangling_links(checkpoint_dir: Path) -> None:
    for link in checkpoint_dir.iterdir():
        if link.is_symlink() and not link.exists():
            link.unlink()


# speculators' save of the epoch in progress when it is stopped (SIGTERM, Ctrl-C), left by runs before the
# pipeline answered stops itself (train/stop.py). It never resumes from it by itself, and it may be torn by a
# SIGKILL after the stop's grace; the pipeline resumes from complete epochs.
INTERRUPTED_DIR = "interrupted"


def remove_torn_checkpoints(checkpoint_dir: str | os.PathLike) -> list[str]:
    """Delete checkpoint folders that a kill left incomplete (speculators would resume from them), and the
    mid-epoch save of a stopped run."""
    checkpoint_dir = Path(checkpoint_dir)
    removed = []
    if (checkpoint_dir / INTERRUPTED_DIR).is_dir():
        _delete_dir(checkpoint_dir / INTERRUPTED_DIR)
        removed.append(INTERRUPTED_DIR)
    for epoch_dir in _epoch_dirs(checkpoint_dir):
        if read_training_state(epoch_dir) is None:
            _delete_dir(epoch_dir)
            removed.append(epoch_dir.name)
    if checkpoint_dir.is_dir():
        _remove_dangling_links(checkpoint_dir)
    return removed


def best_checkpoint(out_dir: Path, select_by: str) -> dict[str, Any] | None:
    """The complete checkpoint `select_by` ranks first (earliest on ties)."""
    complete = complete_checkpoints(out_dir / CHECKPOINTS)
    if not complete:
        return None
    rule = selection_rule(complete, select_by)
    epoch = min(complete,
                key=lambda e: (*selection_key(complete[e]["val_loss"], complete[e][PREDICTED_LENGTH], rule), e))
    state = complete[epoch]
    return {
        "epoch": epoch,
        "step": state["global_step"],
        "val_loss": state["val_loss"],
        PREDICTED_LENGTH: state[PREDICTED_LENGTH],
        "selected_by": rule,
        "checkpoint": f"{CHECKPOINTS}/{epoch}",
    }


def keep_checkpoints(out_dir: Path, keep_last: int, select_by: str) -> None:
    """Write best.json, then delete complete checkpoints other than the newest keep_last and the best."""
    best = best_checkpoint(out_dir, select_by)
    if best is not None:
        atomic.write_json(out_dir / BEST_FILE, best)
    complete = sorted(complete_checkpoints(out_dir / CHECKPOINTS))
    keep = set(complete[-keep_last:])
    if best is not None:
        keep.add(best["epoch"])
    for epoch in complete:
        if epoch not in keep:
            _delete_dir(out_dir / CHECKPOINTS / str(epoch))
    if (out_dir / CHECKPOINTS).is_dir():
        _remove_dangling_links(out_dir / CHECKPOINTS)


def stopped_early(out_dir: Path, patience: int | None, select_by: str) -> dict[str, Any] | None:
    """How training stopped early (newest epoch, best epoch, patience), or None if it did not."""
    newest, best = newest_checkpoint(out_dir / CHECKPOINTS), best_checkpoint(out_dir, select_by)
    if newest is None or best is None or not stop_due(newest["epoch"], best["epoch"], patience):
        return None
    return {"epoch": newest["epoch"], "best_epoch": best["epoch"], "patience": patience}


def training_finished(checkpoint_dir: Path, epochs: int, max_steps: int | None, patience: int | None,
                      select_by: str) -> bool:
    """True when the newest complete checkpoint ends the last epoch, reaches max_steps, or comes
    `patience` epochs after the best one."""
    newest = newest_checkpoint(checkpoint_dir)
    if newest is None:
        return False
    if max_steps is not None and newest["global_step"] >= max_steps:
        return True
    if stopped_early(Path(checkpoint_dir).parent, patience, select_by):
        return True
    return newest["epoch"] >= epochs - 1 and newest.get("local_step", 0) == 0
