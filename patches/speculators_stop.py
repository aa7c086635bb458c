"""A stop during training is answered by the pipeline (eagle_pipeline/train/stop.py), not by speculators. Targets
speculators 0.9.0.

speculators' `Trainer.run_training` is wrapped by `with_graceful_shutdown`: its `GracefulShutdownHandler`
takes SIGINT and SIGTERM for the run, raises `TrainingInterruptedError` at the first, saves the epoch in
progress as `checkpoints/interrupted/` (up to two minutes on a Kimi-sized drafter, for a save the pipeline
deletes) and returns as if training had ended. `apply(hooks)`:

- makes `GracefulShutdownHandler.install` do nothing, so the signal handlers of the rank (`GracefulStop`) stay
  in place; its `restore` then does nothing either (it acts only on what install did);
- wraps `Trainer.train_epoch` to tell `hooks` when an epoch starts and when its training steps end;
- gives the DataLoader workers an init function (defined here, so that a spawned worker unpickles it by this
  module's name) that ignores SIGINT and SIGTERM before speculators' own: a worker killed with its process
  group would fail the validation that completes an epoch's checkpoint.

The functions relied on are fingerprinted; `apply` refuses another speculators version or a changed source.
"""

from __future__ import annotations

import functools
import signal

from patches.speculators_cpu import check_version, require_unchanged_sources

UPSTREAM_SOURCE_SHA256: dict[str, str] = {
    # Made a no-op; the decorator's except branch is then never entered and its restore() does nothing.
    "speculators.train.graceful_shutdown:GracefulShutdownHandler.install":
        "373e351ec739c4a011b416ce04728033c2bf42f713bf64df6bbaf42cc3978ccf",
    "speculators.train.graceful_shutdown:with_graceful_shutdown":
        "eedfb16059a4216c31e4a7a07008fa370960f7fb822d4f100b13ef0e916d9d2b",
    # Calls train_epoch(epoch), then saves the epoch's checkpoint and validates it.
    "speculators.train.trainer:Trainer.run_training":
        "83e395bd403ee08f5d008fe6fa0695f21db4ba7cba7dc26d5d3fde312c74235c",
    "speculators.train.trainer:Trainer.train_epoch": "a84f3c8000da1b71a9a0eab955b0398ce23b717986df94b65b9f6c71c054ac8c",
    # Called in each worker; _setup_dataloader passes the module-level name, which apply() rebinds.
    "speculators.train.dataloader:_worker_init_fn": "53219f299df8cdde1324bc9de12bd28f9c766d12af758b0f5982b6a8bc30e741",
    "speculators.train.dataloader:_setup_dataloader":
        "f36f57dcd0db19aff63be92146f057d07030daded42b2a771a1af4a4e591f488",
}

from speculators.train import dataloader as _dataloader  # noqa: E402

_UPSTREAM_WORKER_INIT = _dataloader._worker_init_fn
_hooks = None


# functools.wraps keeps each replaced function's upstream source reachable (__wrapped__), so its fingerprint check
# holds in a process that has applied the patch already.
@functools.wraps(_UPSTREAM_WORKER_INIT)
def worker_init_ignoring_stops(worker_id: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _UPSTREAM_WORKER_INIT(worker_id)


def apply(hooks) -> None:
    """`hooks`: an object with `epoch_started(epoch)` and `epoch_trained(epoch)` (eagle_pipeline.train.stop.
    GracefulStop) for the run that follows; idempotent otherwise."""
    global _hooks
    check_version()
    _hooks = hooks
    from speculators.train.graceful_shutdown import GracefulShutdownHandler
    from speculators.train.trainer import Trainer

    if getattr(Trainer.train_epoch, "_reports_progress", False):
        return
    require_unchanged_sources(UPSTREAM_SOURCE_SHA256, "patches/speculators_stop.py")
    upstream_install = GracefulShutdownHandler.install

    @functools.wraps(upstream_install)
    def install(self) -> None:  # speculators' handler stays off: eagle_pipeline.train.stop answers the signals
        return None

    GracefulShutdownHandler.install = install
    upstream_train_epoch = Trainer.train_epoch

    @functools.wraps(upstream_train_epoch)
    def train_epoch(self, epoch: int, *args, **kwargs):
        if _hooks is not None:
            _hooks.epoch_started(epoch)
        result = upstream_train_epoch(self, epoch, *args, **kwargs)
        if _hooks is not None:
            _hooks.epoch_trained(epoch)
        return result

    train_epoch._reports_progress = True
    Trainer.train_epoch = train_epoch
    _dataloader._worker_init_fn = worker_init_ignoring_stops
