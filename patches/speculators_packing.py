"""How speculators 0.9.0 fills and pads its training batches: best-fit packing, and no padding on the
CPU. Targets speculators 0.9.0.

speculators packs samples into batches of `--total-seq-len` tokens in the epoch's shuffled order: a batch
takes the next samples that fit and closes at the first that does not (`_assign_to_packed_batches`, a
binary search over a running sum). Every batch is padded to the full length and the step's cost follows
that length, so whatever a batch leaves empty is paid for and wasted. With samples of a few hundred tokens
in 512-token batches about a third of each batch is padding (patches/README.md, "speculators_packing.py").

`apply("best_fit")` replaces that function with online best fit in the same shuffled order: each sample
goes into the open batch with the least room left that still holds it, or opens a new one. The batches
keep the per-epoch shuffle (the seed and epoch decide them as before), samples are never split or dropped
where upstream would keep them, and each data-parallel rank gets every `replicas`-th batch, so all ranks
take the same number of steps. `apply("sequential")` leaves speculators' packing as shipped.

Without an accelerator, `apply` also cuts each collated batch after its last sample (`CollateFn` pads it
to `--total-seq-len`). The drafter reads the sequence length from its inputs' shape and the padding is
masked out of attention and loss, so the loss and gradients are the same and the padded positions are
simply not computed. On a GPU the padding stays: there the drafter's forward is compiled, and one fixed
length spares a recompilation per batch shape.

The patched functions and what the patch relies on are fingerprinted; `apply` refuses another speculators
version or a changed source, and tests/test_packing.py fails on the same condition.
"""

from __future__ import annotations

import bisect
import functools

import numpy as np
import torch

from patches.speculators_cpu import check_version, require_unchanged_sources
from patches.upstream import object_source_sha256, source_sha256

# The function replaced, and its caller whose use of it (shuffled lengths in, per-rank index arrays
# relative to that shuffle out) the replacement keeps.
REPLACED = "speculators.train.distributed_batch_sampler:_assign_to_packed_batches"
UPSTREAM_SOURCE_SHA256: dict[str, str] = {
    REPLACED: "9eac5298597016c38ad23f771ef60a50beeab79421a48e0853959c8f76a8ddd2",
    "speculators.train.distributed_batch_sampler:MultipackDistributedBatchSamplerV2._generate_batches":
        "6bd10672b274df6ce3e6a91697dcb915195450ba83720cf94b7a18e1ba624741",
    # Wrapped on the CPU: the padded batch it returns is cut after the last sample.
    "speculators.train.data:CollateFn.__call__": "2fc63f7bca5be80c766a00e7fb678d1a6dfa6d2215e3881db8d59c36cdbc9bdf",
    # Masks attention by document id, padding (-1) included. (The forward, which takes the sequence length
    # from its inputs' shape, is not fingerprinted: on a GPU host it is wrapped by torch.compile.)
    "speculators.models.eagle3.core:Eagle3DraftModel._build_attn_mask":
        "957d66f79323f41e00a2f96ca020a20b943f41c732ef3fef085361c43f9234d3",
}

PACKINGS = ("sequential", "best_fit")

_upstream = None
_trimming_installed = False


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


def trim_padding(batch: dict) -> dict:
    """The collated batch without the padding after its last sample (sequence dimension 1)."""
    document_ids = batch["document_ids"]
    length = int((document_ids != -1).sum())
    if length == 0 or length == document_ids.shape[1]:
        return batch  # an empty placeholder batch, or a full one
    padded = document_ids.shape[1]
    return {key: value[:, :length] if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == padded
            else value for key, value in batch.items()}


def _install_trimming() -> None:
    global _trimming_installed
    if _trimming_installed:
        return
    from speculators.train.data import CollateFn

    upstream_call = CollateFn.__call__

    @functools.wraps(upstream_call)
    def call(self, batch):
        collated = upstream_call(self, batch)
        # Decided per batch, as the other CPU patches decide per call (patches/speculators_cpu.py).
        return trim_padding(collated) if not torch.accelerator.is_available() else collated

    CollateFn.__call__ = call
    _trimming_installed = True


def shipped_packing():
    """speculators' own `_assign_to_packed_batches`, also once `apply` has replaced it."""
    if _upstream is not None:
        return _upstream
    from speculators.train import distributed_batch_sampler

    return distributed_batch_sampler._assign_to_packed_batches


def upstream_sha256(qualified: str) -> str:
    """Fingerprint of the shipped function, also once `apply` has replaced it in its module."""
    if qualified == REPLACED and _upstream is not None:
        return object_source_sha256(_upstream)
    return source_sha256(qualified)


def apply(packing: str) -> None:
    """Pack speculators' training and validation batches the `packing` way ("sequential": as shipped) and,
    without an accelerator, leave out their padding. Safe to call before every run."""
    global _upstream
    if packing not in PACKINGS:
        raise ValueError(f"packing must be one of {PACKINGS}, got {packing!r}")
    check_version()
    require_unchanged_sources(UPSTREAM_SOURCE_SHA256, "patches/speculators_packing.py", upstream_sha256)
    from speculators.train import distributed_batch_sampler as sampler

    if _upstream is None:
        _upstream = sampler._assign_to_packed_batches
    # _generate_batches looks the function up in its module at every call.
    sampler._assign_to_packed_batches = best_fit_batches if packing == "best_fit" else _upstream
    _install_trimming()
