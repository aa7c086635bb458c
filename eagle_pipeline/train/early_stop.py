"""Early stopping: end training once `train.early_stop_patience` epochs in a row brought no lower
validation loss than the best one (the checkpoint best.json names, which is kept and converted).

speculators' trainer has no stopping hook, so a logging handler watches its per-epoch validation records
and raises StopTraining out of the trainer once the rule fires. The record comes after the epoch's
checkpoint is saved and after the validation metrics are all-reduced, so every rank sees the same losses
and stops at the same epoch (every rank has this handler; no rank waits at a barrier for another).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any


class StopTraining(Exception):
    """Raised out of speculators' trainer when the early-stopping rule fires."""


def stop_due(epoch: int, best_epoch: int, patience: int | None) -> bool:
    """True when `patience` epochs after the best one (`epoch` - `best_epoch`) brought no improvement."""
    return patience is not None and epoch - best_epoch >= patience


class EarlyStopping(logging.Handler):
    """Tracks the best validation loss from speculators' metric records and raises StopTraining."""

    def __init__(self, patience: int, best: Mapping[str, Any] | None = None):
        super().__init__(level=logging.INFO)
        self.patience = patience
        # A resumed run continues from the best of the epochs before it (best.json).
        self.best_epoch = None if best is None else int(best["epoch"])
        self.best_loss = None if best is None else float(best["val_loss"])

    def emit(self, record: logging.LogRecord) -> None:
        message = record.msg
        if record.name != "speculators.metrics" or not isinstance(message, Mapping) or "val" not in message:
            return
        loss = message["val"].get("loss_epoch")
        if loss is None:
            return
        epoch = int(message["epoch"])
        # Strictly lower: on ties the earlier checkpoint stays the best, as in best.json.
        if self.best_loss is None or loss < self.best_loss:
            self.best_epoch, self.best_loss = epoch, float(loss)
        if stop_due(epoch, self.best_epoch, self.patience):
            raise StopTraining(f"no lower validation loss in the {epoch - self.best_epoch} epochs after epoch "
                               f"{self.best_epoch} (train.early_stop_patience {self.patience})")
