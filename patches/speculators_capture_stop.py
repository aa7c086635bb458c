"""Online training stops at the first sample whose hidden states could not be captured, not at speculators' next
recovery synchronisation. Targets speculators 0.9.0.

speculators' online dataset retries each sample's hidden-state round trip (`GenerationRecoveryGuard.run`).
When a sample's attempts are spent the guard returns a `SampleUnavailable`, marked fatal once
`--max-consecutive-generation-failures` samples in a row failed, and the sample is left out of its batch.
The trainer learns of a fatal one only in `BatchRecoveryCoordinator.synchronize`: after the whole batch is
collated, each of its samples having waited out its own retries, and, with more than one rank, only every 50
steps (`trainer._RECOVERY_SYNC_INTERVAL`, `_should_sync_recovery`), training meanwhile on what is left.
With a capture server gone for good that is up to (samples per batch x 50 steps) x the retry time of one
sample before training stops: a day and more at the default 300 s retry, training on emptied batches.

`apply()` makes the fatal exhausted sample raise at once, with the message the circuit breaker gives
("Hidden-state generation circuit breaker tripped ..."), in the rank that met it; torch.distributed.run then
stops the other ranks. It does so by having `ArrowDataset` build its guard as `StopAtOnceGuard`, a subclass
that lives here: DataLoader workers are spawned processes that unpickle the dataset, so its guard's class
comes with it by name (a patched method of the upstream class would not), and torch re-raises a worker's
error in its rank. The samples that failed before it, fewer than the limit, are still left out as upstream
does.

The functions relied on are fingerprinted; `apply` refuses another speculators version or a changed source,
and tests/test_online.py fails on the same condition.
"""

from __future__ import annotations

from speculators.train.recovery import GenerationRecoveryGuard, SampleUnavailable

from patches.speculators_cpu import check_version, require_unchanged_sources

UPSTREAM_SOURCE_SHA256: dict[str, str] = {
    # Subclassed: counts an exhausted sample and marks it fatal at the limit, returning it to the dataset.
    "speculators.train.recovery:GenerationRecoveryGuard._record_exhausted":
        "0e199301915195ee891320e1196bb5c36669249e39a9fc9232ff5a2c38465e2e",
    # Calls it from its last attempt's except block and returns what it returns.
    "speculators.train.recovery:GenerationRecoveryGuard.run":
        "3f27233b6397405853b8de8900dcf5b2155e301c3c0f76641f7d0859594b723c",
    # Builds its guard from the module-level name `GenerationRecoveryGuard`, which apply() rebinds.
    "speculators.train.data:ArrowDataset.__init__": "7066dd33ae9b5c71bf4571cfd6a6b4e7cd600bd16ffd5946c54962802d28ae62",
    # Spawned DataLoader workers (multiprocessing_context="spawn").
    "speculators.train.dataloader:_setup_dataloader":
        "f36f57dcd0db19aff63be92146f057d07030daded42b2a771a1af4a4e591f488",
    # Where upstream raises instead, and the words it raises with.
    "speculators.train.recovery:BatchRecoveryCoordinator.synchronize":
        "e4977d020ed0417e671c53593f0a569069580d7f9d919c09ddc3a563952ede8a",
    "speculators.train.trainer:_should_sync_recovery":
        "f63eb1268a6bef72519b274518ffaf793fb9e382144452286172a29ac2b70a5e",
}

# The start of upstream's circuit-breaker message, kept so that whoever reads it reads one message.
CIRCUIT_BREAKER = "Hidden-state generation circuit breaker tripped"


class StopAtOnceGuard(GenerationRecoveryGuard):
    """Upstream's guard, raising at the sample that reaches the limit instead of returning it as fatal."""

    def _record_exhausted(self, description, **kwargs) -> SampleUnavailable:
        unavailable = super()._record_exhausted(description, **kwargs)
        if unavailable.fatal:
            raise RuntimeError(f"{CIRCUIT_BREAKER} at the sample that reached the limit: {unavailable.reason}")
        return unavailable


def apply() -> None:
    """Idempotent; refuses another speculators or changed sources."""
    check_version()
    require_unchanged_sources(UPSTREAM_SOURCE_SHA256, "patches/speculators_capture_stop.py")
    from speculators.train import data

    data.GenerationRecoveryGuard = StopAtOnceGuard
