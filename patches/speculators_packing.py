"""Best-fit packing for speculators 0.9.0's batch sampler. Targets speculators 0.9.0.

speculators packs samples into batches of `--total-seq-len` tokens in the epoch's shuffled order: a batch
takes the next samples that fit and closes at the first that does not (`_assign_to_packed_batches`, a
binary search over a running sum). Every batch is padded to the full length and the step's cost follows
that length, so whatever a batch leaves empty is paid for and wasted. With samples of a few hundred tokens
in 512-token batches about a third of each batch is padding (patches/README.md, "speculators_packing.py").

`apply("best_fit")` replaces that function with online best fit in the same shuffled order: each sample
goes into the open batch with the least room left that still holds it, or opens a new one. The batches
keep the per-epoch shuffle (the seed and epoch decide them as before), samples are never split or dropped
where upstream would keep them, and each data-parallel rank gets every `replicas`-th batch, so all ranks
take the same number of steps. `apply("sequential")` leaves speculators as shipped.

The replaced function is fingerprinted; `apply` refuses another speculators version or a changed source,
and tests/test_patches.py fails on the same condition.
"""

from __future__ import annotations

import bisect
import hashlib
import inspect

import numpy as np

from patches.speculators_cpu import TARGET_VERSION, check_version, source_sha256

# The function replaced, and its caller whose use of it (shuffled lengths in, per-rank index arrays
# relative to that shuffle out) the replacement keeps.
REPLACED = "speculators.train.distributed_batch_sampler:_assign_to_packed_batches"
UPSTREAM_SOURCE_SHA256: dict[str, str] = {
    REPLACED: "9eac5298597016c38ad23f771ef60a50beeab79421a48e0853959c8f76a8ddd2",
    "speculators.train.distributed_batch_sampler:MultipackDistributedBatchSamplerV2._generate_batches":
        "6bd10672b274df6ce3e6a91697dcb915195450ba83720cf94b7a18e1ba624741",
}

PACKINGS = ("sequential", "best_fit")

_upstream = None


def best_fit_batches(lengths: np.ndarray, max_len: int, rank: int, replicas: int) -> list[np.ndarray]:
    """Pack `lengths` (already shuffled) into batches of at most `max_len` tokens by online best fit and
    return `rank`'s share: batches rank, rank + replicas, ...; trailing batches that not every rank would
    get are dropped, as upstream drops what is left at the end of an epoch."""
    room_and_batch: list[tuple[int, int]] = []  # (room left, batch number) of the open batches, sorted
    batches: list[list[int]] = []
    for index, length in enumerate(int(length) for length in lengths):
        position = bisect.bisect_left(room_and_batch, (length, -1))
        if position < len(room_and_batch):
            room, number = room_and_batch.pop(position)
        else:
            room, number = max_len, len(batches)
            batches.append([])
        batches[number].append(index)
        room -= length
        if room > 0:
            bisect.insort(room_and_batch, (room, number))
    steps = len(batches) // replicas
    return [np.asarray(batches[step * replicas + rank], dtype=np.int64) for step in range(steps)]


def upstream_sha256(qualified: str) -> str:
    """Fingerprint of the shipped function, also once `apply` has replaced it in its module."""
    if qualified == REPLACED and _upstream is not None:
        return hashlib.sha256(inspect.getsource(_upstream).encode()).hexdigest()
    return source_sha256(qualified)


def changed_upstream_sources() -> list[str]:
    return [name for name, digest in UPSTREAM_SOURCE_SHA256.items() if upstream_sha256(name) != digest]


def apply(packing: str) -> None:
    """Pack speculators' training and validation batches the `packing` way ("sequential": as shipped)."""
    global _upstream
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
    check_version()
    changed = changed_upstream_sources()
    if changed:
        raise RuntimeError(
            f"patches/speculators_packing.py targets speculators {TARGET_VERSION}, but these functions differ "
            f"from that release: {', '.join(changed)}; re-check the patch against them"
        )
    from speculators.train import distributed_batch_sampler as sampler

    if _upstream is None:
        _upstream = sampler._assign_to_packed_batches
    # _generate_batches looks the function up in its module at every call.
    sampler._assign_to_packed_batches = best_fit_batches if packing == "best_fit" else _upstream
