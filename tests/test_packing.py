"""patches/speculators_packing.py: best-fit batches keep every sample, respect the token budget, fill
batches better than speculators' sequential packing, and are what speculators' sampler yields once applied;
on the CPU a collated batch ends at its last sample. (That training without the padding takes the same
steps: tests/test_training.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from patches import speculators_packing

MAX_LEN = 512


def shuffled_lengths(count: int = 500, seed: int = 0) -> np.ndarray:
    # Like the embedded default's conversations: a few hundred tokens, some at the budget.
    rng = np.random.default_rng(seed)
    return np.clip(rng.gamma(3.0, 72.0, size=count).astype(np.int64) + 20, 1, MAX_LEN)


def fill(lengths: np.ndarray, batches: list[np.ndarray]) -> float:
    return sum(int(lengths[batch].sum()) for batch in batches) / (len(batches) * MAX_LEN)


@pytest.mark.parametrize("qualified_name", sorted(speculators_packing.UPSTREAM_SOURCE_SHA256))
def test_upstream_source_is_the_one_the_patch_was_written_for(qualified_name):
    assert (speculators_packing.upstream_sha256(qualified_name)
            == speculators_packing.UPSTREAM_SOURCE_SHA256[qualified_name])


def test_best_fit_keeps_every_sample_once_within_the_budget():
    lengths = shuffled_lengths()
    batches = speculators_packing.best_fit_batches(lengths, MAX_LEN, rank=0, replicas=1)
    indices = np.concatenate(batches)
    assert sorted(indices.tolist()) == list(range(len(lengths)))
    assert max(int(lengths[batch].sum()) for batch in batches) <= MAX_LEN


def test_best_fit_fills_batches_better_than_sequential_packing():
    from speculators.train.distributed_batch_sampler import _assign_to_packed_batches

    lengths = shuffled_lengths()
    sequential = _assign_to_packed_batches(lengths, MAX_LEN, 0, 1)
    best_fit = speculators_packing.best_fit_batches(lengths, MAX_LEN, rank=0, replicas=1)
    assert fill(lengths, best_fit) > 0.9 > fill(lengths, sequential)
    assert len(best_fit) < len(sequential)


def test_ranks_get_disjoint_batches_and_the_same_number_of_steps():
    lengths = shuffled_lengths(501)
    per_rank = [speculators_packing.best_fit_batches(lengths, MAX_LEN, rank=rank, replicas=3) for rank in range(3)]
    assert len({len(batches) for batches in per_rank}) == 1
    taken = np.concatenate([np.concatenate(batches) for batches in per_rank])
    assert len(set(taken.tolist())) == len(taken)
    everything = speculators_packing.best_fit_batches(lengths, MAX_LEN, rank=0, replicas=1)
    assert 0 <= len(everything) - 3 * len(per_rank[0]) < 3  # only the batches not every rank would get


def test_applied_the_sampler_yields_best_fit_batches_and_sequential_restores_it():
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = shuffled_lengths()
    try:
        speculators_packing.apply("best_fit")
        sampler = MultipackDistributedBatchSamplerV2(MAX_LEN, lengths, num_replicas=1, rank=0, seed=3)
        packed = list(sampler)
        assert fill(lengths, packed) > 0.9
        assert sorted(np.concatenate(packed).tolist()) == list(range(len(lengths)))
        sampler.set_epoch(1)  # a new shuffle each epoch, as upstream
        assert [batch.tolist() for batch in sampler] != [batch.tolist() for batch in packed]
    finally:
        speculators_packing.apply("sequential")
    sampler = MultipackDistributedBatchSamplerV2(MAX_LEN, lengths, num_replicas=1, rank=0, seed=3)
    assert fill(lengths, list(sampler)) < 0.9


def test_refuses_an_unknown_packing_and_another_speculators_version(monkeypatch):
    with pytest.raises(ValueError, match="packing must be one of"):
        speculators_packing.apply("first_fit")
    monkeypatch.setattr("patches.speculators_cpu.installed_version", lambda: "0.9.1")
    with pytest.raises(RuntimeError, match=r"targets speculators 0\.9\.0 but 0\.9\.1 is installed"):
        speculators_packing.apply("best_fit")


def test_on_the_cpu_a_collated_batch_ends_at_its_last_sample(monkeypatch):
    import torch
    from speculators.train.data import CollateFn

    speculators_packing.apply("sequential")

    def sample(length: int) -> dict:
        return {"hidden_states": torch.ones(length, 3 * 8), "input_ids": torch.arange(length),
                "verifier_last_hidden_states": torch.ones(length, 8), "loss_mask": torch.ones(length, dtype=torch.bool),
                "lengths": torch.tensor([length]), "position_ids": torch.arange(length)}

    collate = CollateFn(64, 8, num_target_layers=3, dtype=torch.float32)
    batch = collate([sample(20), sample(15)])
    assert batch["document_ids"].tolist() == [[0] * 20 + [1] * 15]
    assert {key: tuple(value.shape) for key, value in batch.items() if isinstance(value, torch.Tensor)} == {
        "hidden_states": (1, 35, 24), "input_ids": (1, 35), "verifier_last_hidden_states": (1, 35, 8),
        "loss_mask": (1, 35), "position_ids": (1, 35), "document_ids": (1, 35)}
    # With an accelerator the batch keeps its fixed length (the compiled forward wants one shape).
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert collate([sample(20), sample(15)])["input_ids"].shape == (1, 64)
