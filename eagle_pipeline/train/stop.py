"""A stop during training (SIGTERM from `scripts/remote.sh stop` or a scheduler, Ctrl-C) keeps every epoch whose
training had ended, and stage 04 exits 130 with the `interrupted:` line of every stage.

speculators answers a stop by saving the epoch in progress as `checkpoints/interrupted/` and returning as if
training had ended. The pipeline never resumes from that save (it holds no step to resume at; a rerun deletes
it), and an epoch whose checkpoint was saved but not yet validated and replayed is torn and trained again. So
while speculators trains, `GracefulStop` answers the signal instead (patches/speculators_stop.py turns
speculators' handler off):

- during an epoch's training steps, at once: that epoch is lost, every complete one is kept;
- from the end of an epoch's training until its checkpoint is complete (saved, validated, replayed, marked by
  the metrics recorder), after that: the log says so, and a second signal stops at once. `scripts/jobs.sh stop`
  gives stage 04 three minutes, and torch.distributed.run its ranks `STOP_GRACE_S`, before SIGKILL.

Any error that ends training after a stop was asked for (a DataLoader worker killed with its process group)
is reported as the stop. DataLoader workers ignore the signals: their rank decides.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Mapping
from typing import Any

from eagle_pipeline.errors import Terminated

logger = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
# How long torch.distributed.run waits for its ranks to finish the epoch they complete, after a stop: under the
# three minutes scripts/jobs.sh gives stage 04 before its SIGKILL.
STOP_GRACE_S = 170


def stop_exception(signum: int) -> BaseException:
    """What a stop raises: the stage's own exceptions, which it turns into exit 130 and the `interrupted:` line."""
    return Terminated() if signum == signal.SIGTERM else KeyboardInterrupt()


class GracefulStop(logging.Handler):
    """The signal handlers of a training rank while speculators trains, and the logging handler (placed after
    the metrics recorder) that sees an epoch's validation record: its checkpoint is then complete."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.finishing: int | None = None  # the epoch whose checkpoint is being completed
        self.requested: int | None = None  # the signal of a stop asked for
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "GracefulStop":
        for signum in SIGNALS:
            self._previous[signum] = signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
        self._previous.clear()
        if self.requested is not None and not isinstance(exc, KeyboardInterrupt):
            # Training went on to its end after a deferred stop, or failed because of the stop.
            raise stop_exception(self.requested) from exc

    def _on_signal(self, signum: int, frame) -> None:
        if self.requested is None and self.finishing is not None:
            self.requested = signum
            logger.warning("%s: completing the checkpoint of epoch %d (validation and replay) before stopping; send it "
                           "again to stop at once, losing that epoch", signal.Signals(signum).name, self.finishing)
            return
        self.requested = signum
        raise stop_exception(signum)

    # -- speculators' progress ----------------------------------------------------------------------------
    def epoch_started(self, epoch: int) -> None:
        self._checkpoint_complete()

    def epoch_trained(self, epoch: int) -> None:
        """The epoch's training steps are done: its checkpoint is saved and validated next."""
        self.finishing = epoch

    def emit(self, record: logging.LogRecord) -> None:
        message = record.msg
        if record.name == "speculators.metrics" and isinstance(message, Mapping) and "val" in message:
            self._checkpoint_complete()

    def _checkpoint_complete(self) -> None:
        self.finishing = None
        if self.requested is not None:
            raise stop_exception(self.requested)
