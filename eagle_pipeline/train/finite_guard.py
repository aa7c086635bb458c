"""Training that has stopped learning anything (a non-finite loss) ends at once with an error, instead of
running on for hours at `loss nan` (a released drafter with NaN weights, a learning rate far too high).

Like early stopping, a logging handler watches speculators' metric records: after `limit` consecutive
training steps whose loss is not finite, or one validation whose loss is not finite, it raises
NonFiniteLoss out of the trainer. Every rank sees the same all-reduced losses, so all ranks stop at the same
step. The handler runs before the record that would mark an epoch's checkpoint complete, so a checkpoint
saved from non-finite weights stays incomplete and the next run removes it; the last good one is kept.
Rank 0 leaves the reason in `stopped.json`, which stage 04 reads when the launcher's ranks exit.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping
from pathlib import Path

from eagle_pipeline import atomic
from eagle_pipeline.errors import BadInput

STOPPED_FILE = "stopped.json"
NON_FINITE_STEPS = 3


class NonFiniteLoss(BadInput):
    """Raised out of speculators' trainer when the loss is no longer a number."""


def advice(init_from: str | None) -> str:
    where = (f"check the drafter in train.init_from ({init_from}) for non-finite weights, or lower train.lr"
             if init_from else "lower train.lr, or check stage 02's hidden states")
    return f"{where}; the last complete checkpoint is kept"


class NonFiniteLossGuard(logging.Handler):
    def __init__(self, out_dir: Path, init_from: str | None, write_reason: bool, limit: int = NON_FINITE_STEPS):
        super().__init__(level=logging.INFO)
        self.out_dir, self.init_from, self.write_reason, self.limit = Path(out_dir), init_from, write_reason, limit
        self.bad_steps = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.msg
        if (record.name != "speculators.metrics" or not isinstance(message, Mapping)
                or getattr(record, "hparams", False)):
            return
        if "train" in message:
            loss = message["train"].get("loss")
            self.bad_steps = self.bad_steps + 1 if loss is not None and not math.isfinite(loss) else 0
            if self.bad_steps >= self.limit:
                self.stop(f"train.loss: not finite ({loss}) for {self.bad_steps} steps in a row, up to step "
                          f"{int(message.get('global_step', 0)) + 1} of epoch {message.get('epoch')}")
        elif "val" in message:
            loss = message["val"].get("loss_epoch")
            if loss is not None and not math.isfinite(loss):
                self.stop(f"train.loss: validation loss of epoch {message.get('epoch')} is not finite ({loss})")

    def stop(self, what: str) -> None:
        reason = f"{what}: training stopped; {advice(self.init_from)}"
        if self.write_reason:
            atomic.write_json(self.out_dir / STOPPED_FILE, {"reason": reason})
        raise NonFiniteLoss(reason)


def stopped_reason(out_dir: Path) -> str | None:
    """Why the last run's ranks stopped themselves, if they did (rank 0's STOPPED_FILE)."""
    try:
        return json.loads((Path(out_dir) / STOPPED_FILE).read_text())["reason"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
