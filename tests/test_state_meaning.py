"""Captured states checked for meaning (eagle_pipeline/state_meaning.py): stage 02's files, on disk, without an engine.

A small stand-in target (a final norm and an lm_head in safetensors) and samples whose answers are the greedy
(or sampled) tokens of their own final slot: the intact files pass, and a zeroed, shifted or stale final
slot, or a flat row in any slot, is refused with one line naming the slot and the file.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from eagle_pipeline.errors import BadInput
from eagle_pipeline.samples import sample_path, write_sample
from eagle_pipeline.state_meaning import (
    MAX_SAMPLES,
    check_replay_states,
    check_stage02_samples,
    load_target_head,
    spread,
)

LAYERS, HIDDEN, VOCAB, IDS = 30, 32, 256, [2, 15, 27]


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A target folder holding only what the check reads: config, final norm, tied embedding as lm_head."""
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    save_file({"model.norm.weight": 1 + 0.1 * torch.randn(HIDDEN), "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN),
               "model.layers.0.mlp.down_proj.weight": torch.randn(HIDDEN, HIDDEN)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"rms_norm_eps": 1e-5, "num_hidden_layers": LAYERS}))
    return folder


def _samples(target: Path, count: int, sampled: bool = False, prompt_len: int = 6, answer_len: int = 20):
    """(rows, states): answers generated from each sample's own final slot, greedily or by sampling."""
    head = load_target_head(target, 1e-5)
    generator = torch.Generator().manual_seed(1)
    rows, states = [], []
    for _ in range(count):
        n = prompt_len + answer_len
        hidden = torch.randn(n, len(IDS) + 1, HIDDEN, generator=generator) * 3
        logits = head.logits(hidden[:, -1])
        tokens = torch.randint(0, VOCAB, (n,), generator=generator)
        for t in range(prompt_len - 1, n - 1):  # row t's state chose token t + 1
            tokens[t + 1] = (torch.multinomial(torch.softmax(logits[t], -1), 1, generator=generator)[0] if sampled
                             else logits[t].argmax())
        rows.append({"input_ids": tokens.tolist(), "loss_mask": [0] * prompt_len + [1] * answer_len})
        states.append(hidden)
    return rows, states


def _write(folder: Path, rows, states) -> Path:
    for i, (row, hidden) in enumerate(zip(rows, states)):
        write_sample(folder, i, {"hidden_states": hidden, "token_ids": torch.tensor(row["input_ids"])}, row["input_ids"],
                     num_states=len(IDS) + 1, hidden_size=HIDDEN, storage_dtype="bfloat16")
    return folder


def _check(target: Path, folder: Path, rows, greedy: bool = True) -> dict:
    return check_stage02_samples(folder, rows, load_target_head(target, 1e-5), IDS, LAYERS, greedy=greedy)


def test_intact_greedy_and_sampled_samples_pass(target, tmp_path):
    rows, states = _samples(target, 3)
    result = _check(target, _write(tmp_path / "greedy", rows, states), rows)
    assert result["samples"] == 3 and result["rows"] == 60 and result["agreement"] >= 0.9
    rows, states = _samples(target, 3, sampled=True)
    result = _check(target, _write(tmp_path / "sampled", rows, states), rows, greedy=False)
    assert result["mean_nll"] < 0.5 * result["uniform_nll"]


@pytest.mark.parametrize("fault, says", [
    ("final_zeroed", "slot 3 (layer 30, the final layer) is all zero at token 0"),
    ("final_shifted", "slot 3 (layer 30, the final layer) put through the target's final norm and lm_head predicts"),
    ("final_holds_aux", "slot 3 (layer 30, the final layer) put through the target's final norm and lm_head predicts"),
    ("aux_constant_row", "slot 1 (layer 15) is constant at token 4"),
])
def test_a_capture_that_lost_its_meaning_is_refused_naming_the_slot_and_sample(target, tmp_path, fault, says):
    rows, states = _samples(target, 5)
    broken = states[3].clone()
    if fault == "final_zeroed":
        broken[:, 3] = 0
    elif fault == "final_shifted":  # each row holds the next position's state
        broken[:-1, 3] = states[3][1:, 3]
    elif fault == "final_holds_aux":
        broken[:, 3] = broken[:, 2]
    else:
        broken[4, 1] = 0.5
    states[3] = broken
    folder = _write(tmp_path / fault, rows, states)
    with pytest.raises(BadInput) as refused:
        _check(target, folder, rows)
    line = str(refused.value)
    assert "\n" not in line and line.startswith(str(sample_path(folder, 3))), line
    assert says in line and "rerun stage 02" in line, line


def test_sampled_answers_are_held_to_a_likelihood_floor(target, tmp_path):
    """A final slot holding another request's states (a wrong slot mapping) on sampled data."""
    rows, states = _samples(target, 2, sampled=True)
    states[1] = states[1].clone()
    states[1][:, 3] = states[0][:, 3]
    folder = _write(tmp_path / "s", rows, states)
    with pytest.raises(BadInput, match=r"hs_1.safetensors: slot 3 .* mean negative log-likelihood of [0-9.]+ nats"):
        _check(target, folder, rows, greedy=False)


def test_the_check_reads_a_fixed_spread_of_samples():
    assert spread(5, 8) == [0, 1, 2, 3, 4]
    picked = spread(100, MAX_SAMPLES)
    assert len(picked) == MAX_SAMPLES and picked[0] == 0 and picked[-1] == 99


def test_stage06_states_are_checked_per_answer(target):
    rows, states = _samples(target, 2)
    pairs = [(row["input_ids"][:6], row["input_ids"][6:]) for row in rows]
    loaded = []

    def head():
        loaded.append(1)
        return load_target_head(target, 1e-5)

    assert check_replay_states(states, pairs, head, IDS, LAYERS, greedy=True, where="capture")["rows"] == 40
    assert loaded == [1]
    states[1] = states[1].clone()
    states[1][:, 3] = 0
    with pytest.raises(BadInput, match=r"^capture, answer 1: slot 3 \(layer 30, the final layer\) is all zero"):
        check_replay_states(states, pairs, head, IDS, LAYERS, greedy=True, where="capture")


def test_every_sample_training_reads_is_checked_for_flat_rows(target, tmp_path):
    """Three samples whose final slot was zeroed after stage 02 checked its spread: the spread misses them, the
    check of the training data (all values, small data) and the dataset speculators trains from each stop at one,
    naming its file and the recapture."""
    from datasets import Dataset
    from torch._utils import ExceptionWrapper

    from eagle_pipeline.datacheck import check_training_data
    from eagle_pipeline.samples import SAMPLES_DIR
    from patches import speculators_sample_check
    from patches.speculators_sample_check import CheckedArrowDataset, FlatSampleStates

    rows, states = _samples(target, 12)
    data = tmp_path / "data"
    table = Dataset.from_list([{**row, "seq_len": len(row["input_ids"])} for row in rows])
    table.with_format("torch").save_to_disk(str(data))
    zeroed = [i for i in range(12) if i not in spread(12, MAX_SAMPLES)][:3]
    assert len(zeroed) == 3
    for i in zeroed:
        states[i] = states[i].clone()
        states[i][:, 3] = 0
    folder = _write(data / SAMPLES_DIR, rows, states)
    assert _check(target, folder, rows)["samples"] == MAX_SAMPLES  # stage 02's spread passes

    first = str(sample_path(folder, zeroed[0]))
    with pytest.raises(BadInput, match=rf"^{first}: slot 3 \(the final layer\) of its 4 is all zero at token 0: .*"
                                       rf"delete that file and rerun stage 02 \(it captures only the samples it lacks"):
        check_training_data(data, len(IDS) + 1, HIDDEN)

    speculators_sample_check.apply()
    dataset = CheckedArrowDataset(max_len=64, datapath=str(data), on_missing="raise", hidden_states_dtype=torch.float32)
    for i in range(12):
        if i in zeroed:
            with pytest.raises(FlatSampleStates) as refused:
                dataset[i]
            line = str(refused.value)
            assert line.startswith(f"{sample_path(folder, i)}: slot 3 (the final layer) of its 4 is all zero"), line
            assert "stage 04 stopped at this sample" in line and "rerun stage 02" in line and "\n" not in line
        else:
            assert dataset[i]["verifier_last_hidden_states"].shape == (len(rows[i]["input_ids"]), HIDDEN)
    # Raised in a DataLoader worker, it reaches the rank as torch re-raises it: the same one line.
    try:
        dataset[zeroed[1]]
    except FlatSampleStates:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(FlatSampleStates) as reraised:
        wrapped.reraise()
    line = str(reraised.value)
    assert line.startswith(f"{sample_path(folder, zeroed[1])}: slot 3") and "\n" not in line
    # Online samples (states from capture servers, checked as they arrive) are left to speculators.
    online = CheckedArrowDataset(max_len=64, datapath=str(data), on_missing="skip", hidden_states_dtype=torch.float32)
    assert online[zeroed[0]]["verifier_last_hidden_states"].abs().sum() == 0


def test_the_sample_check_patch_relies_on_the_speculators_it_was_written_for():
    from patches import speculators_sample_check
    from patches.upstream import changed_sources

    assert changed_sources(speculators_sample_check.UPSTREAM_SOURCE_SHA256) == []
