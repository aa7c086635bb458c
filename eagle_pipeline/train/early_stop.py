"""Early stopping: end training once `train.early_stop_patience` epochs in a row brought no better
checkpoint than the best one (the checkpoint best.json names, which is kept and converted), by the rule
best.json uses (`train.select_by`, eagle_pipeline/train/checkpoints.py).

speculators' trainer has no stopping hook, so a logging handler watches its per-epoch validation records
and raises StopTraining out of the trainer once the rule fires. The record comes after the epoch's
checkpoint is saved and after the validation metrics are all-reduced, so every rank sees the same losses
and stops at the same epoch (every rank has this handler; no rank waits at a barrier for another).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from eagle_pipeline.train.predicted_acceptance import PREDICTED_LENGTH, selection_key


class StopTraining(Exception):
    """Raised out of speculators' trainer when the early-stopping rule fires."""


def stop_due(epoch: int, best_epoch: int, patience: int | None) -> bool:
    """True when `patience` epochs after the best one (`epoch` - `best_epoch`) brought no improvement."""
    return patience is not None and epoch - best_epoch >= patience


def shared_prediction(predictor, epoch: int) -> float | None:
    """The checkpoint's predicted acceptance length, replayed by rank 0 alone and sent to the other ranks (each
    rank replaying would load a float32 drafter and the target's embedding and head once per rank: on an
    8-GPU host, the host's memory eight times over)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return predictor.predict(epoch)[PREDICTED_LENGTH]
    value = [predictor.predict(epoch)[PREDICTED_LENGTH] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(value, src=0)
    return value[0]


class EarlyStopping(logging.Handler):
    """Tracks the best checkpoint from speculators' metric records and raises StopTraining.

    With `predictor` (a CheckpointPredictor), checkpoints are ranked by predicted acceptance length, as
    best.json ranks them; rank 0 predicts and every rank gets its figure, so all stop together.
    """

    def __init__(self, patience: int, best: Mapping[str, Any] | None = None, predictor=None):
        super().__init__(level=logging.INFO)
        self.patience = patience
        self.predictor = predictor
        self.rule = "predicted_acceptance" if predictor is not None else "val_loss"
        # A resumed run continues from the best of the epochs before it (best.json), if chosen by this rule.
        same_rule = best is not None and best.get("selected_by", "val_loss") == self.rule
        self.best_epoch = int(best["epoch"]) if same_rule else None
        self.best_key = (selection_key(float(best["val_loss"]), best.get(PREDICTED_LENGTH), self.rule)
                         if same_rule else None)

    def emit(self, record: logging.LogRecord) -> None:
        message = record.msg
        if record.name != "speculators.metrics" or not isinstance(message, Mapping) or "val" not in message:
            return
        loss = message["val"].get("loss_epoch")
        if loss is None:
            return
        epoch = int(message["epoch"])
        predicted = shared_prediction(self.predictor, epoch) if self.predictor is not None else None
        rule = self.rule if predicted is not None else "val_loss"
        key = selection_key(float(loss), predicted, rule)
        # Strictly better: on ties the earlier checkpoint stays the best, as in best.json.
        if self.best_key is None or len(key) != len(self.best_key) or key < self.best_key:
            self.best_epoch, self.best_key = epoch, key
        if stop_due(epoch, self.best_epoch, self.patience):
            what = "higher predicted acceptance length" if rule == "predicted_acceptance" else "lower validation loss"
            raise StopTraining(f"no {what} in the {epoch - self.best_epoch} epochs after epoch "
                               f"{self.best_epoch} (train.early_stop_patience {self.patience})")
