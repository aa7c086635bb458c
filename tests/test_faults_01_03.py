"""Fault injection into stages 01-03 (tests/fault_injection.py): each killed at seeded points and rerun to
what the session's uninterrupted `small_run` made, and a disk that fills midway through stage 02."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ok, run_stage
from fault_injection import (
    SEED,
    assert_complete_and_whole,
    assert_same_hidden_states,
    dataset_rows,
    fresh_run,
    kill_at,
    link_stages,
    pages,
    read_manifest,
    safetensors_is_whole,
    status,
    tmpfs,
    write_smoke_config,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture
def run(tmp_path):
    return fresh_run(tmp_path)


def test_stage_01_killed_three_times_gives_the_reference_conversations(small_run, run, tmp_path):
    _, _, reference = small_run
    config, run_dir = run
    stage = run_dir / "01_generate_data"
    parts = lambda: sorted((stage / "parts").glob("part-*.jsonl"))  # noqa: E731
    rng = random.Random(SEED + 1)

    # While the engine loads: nothing generated yet.
    kill_at("01_generate_data.py", config, stage_dir=stage, when=lambda: status(stage) == "running",
            delay=rng.uniform(0.5, 4.0), log_path=tmp_path / "kill-1.log")
    assert parts() == []
    # Right after the first batch of 4 (tiny-smoke.yaml) is written, while the second is generated.
    kill_at("01_generate_data.py", config, stage_dir=stage, when=lambda: len(parts()) >= 1,
            delay=rng.uniform(0.0, 0.05), log_path=tmp_path / "kill-2.log")
    assert len(parts()) == 1
    # Once both batches are written, while the dataset and the plot are: the rerun generates nothing.
    output = kill_at("01_generate_data.py", config, stage_dir=stage, when=lambda: len(parts()) >= 2,
                     delay=rng.uniform(0.0, 0.2), log_path=tmp_path / "kill-3.log")
    assert "4 of 6 conversations already done, 2 to generate" in output

    result = ok(run_stage("01_generate_data.py", config))
    assert "6 of 6 conversations already done, 0 to generate" in result.stdout
    manifest = assert_complete_and_whole(stage)
    expected = read_manifest(reference / "01_generate_data")

    rows = dataset_rows(stage / "conversations")
    assert [r["sample_id"] for r in rows] == [f"s{i:06d}" for i in range(6)]
    in_parts = [json.loads(line)["sample_id"] for part in parts() for line in part.read_text().splitlines()]
    assert sorted(in_parts) == [r["sample_id"] for r in rows], "each sample in exactly one part file"
    # Greedy decoding: the same texts, token counts and finish reasons as the uninterrupted run.
    assert rows == dataset_rows(reference / "01_generate_data" / "conversations")
    assert manifest["output_fingerprint"] == expected["output_fingerprint"]
    assert manifest["counts"]["samples"] == 6


def test_stage_02_killed_between_files_gives_the_reference_hidden_states(small_run, tmp_path):
    _, _, reference = small_run
    run_dir = tmp_path / "data" / "f"
    # One sample per engine call: a file every fraction of a second, so kills land between files.
    config = write_smoke_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="f",
                                hidden_states={"batch_size": 1})
    link_stages(reference, run_dir, "01_generate_data")
    stage = run_dir / "02_extract_hidden"
    hs_dir = stage / "data" / "hidden_states"
    files = lambda: len(list(hs_dir.glob("hs_*.safetensors"))) if hs_dir.exists() else 0  # noqa: E731
    rng = random.Random(SEED + 2)

    # Resumed after a full disk, and after a lost file: the disk-full test below and tests/test_corruption.py.
    first = rng.choice([1, 2, 3])
    kill_at("02_extract_hidden.py", config, stage_dir=stage, when=lambda: files() >= first,
            delay=rng.uniform(0.0, 0.03), log_path=tmp_path / "kill-1.log")
    kept = files()
    assert first <= kept < 6

    result = ok(run_stage("02_extract_hidden.py", config))
    assert f"{kept} of 6 samples already captured, {6 - kept} to capture" in result.stdout
    manifest = assert_complete_and_whole(stage)
    want = reference / "02_extract_hidden"
    want_names = sorted(p.name for p in (want / "data" / "hidden_states").iterdir())
    assert sorted(p.name for p in hs_dir.iterdir()) == want_names
    assert_same_hidden_states(hs_dir, want / "data" / "hidden_states")
    assert dataset_rows(stage / "data") == dataset_rows(want / "data")
    assert manifest["output_fingerprint"] == read_manifest(want)["output_fingerprint"]
    assert not (stage / "connector_scratch").exists()


def test_stage_03_killed_twice_gives_the_reference_vocabulary_bytes(small_run, run, tmp_path):
    _, _, reference = small_run
    config, run_dir = run
    link_stages(reference, run_dir, "01_generate_data", "02_extract_hidden")
    stage = run_dir / "03_build_vocab_map"
    rng = random.Random(SEED + 3)

    # While it reads the dataset and counts tokens.
    kill_at("03_build_vocab_map.py", config, stage_dir=stage, when=lambda: status(stage) == "running",
            delay=rng.uniform(0.0, 0.3), log_path=tmp_path / "kill-1.log")
    # Between its first file and the manifest (the other maps, the plot).
    kill_at("03_build_vocab_map.py", config, stage_dir=stage, when=lambda: (stage / "d2t.npy").exists(),
            delay=rng.uniform(0.0, 0.05), log_path=tmp_path / "kill-2.log")

    ok(run_stage("03_build_vocab_map.py", config))
    manifest = assert_complete_and_whole(stage)
    want = reference / "03_build_vocab_map"
    for name in ("d2t.npy", "t2d.npy", "token_counts.npy"):
        assert (stage / name).read_bytes() == (want / name).read_bytes(), name
    assert manifest["counts"] == read_manifest(want)["counts"]
    assert manifest["output_fingerprint"] == read_manifest(want)["output_fingerprint"]


def test_disk_full_midway_through_stage_02_keeps_finished_samples_and_a_rerun_completes(small_run, run, tmp_path):
    _, _, reference = small_run
    config, run_dir = run
    link_stages(reference, run_dir, "01_generate_data")
    want = reference / "02_extract_hidden"
    want_files = sorted((want / "data" / "hidden_states").glob("hs_*.safetensors"))
    counts = read_manifest(want)["counts"]
    # The stage's own estimate (bf16 states). Each file also holds its token ids and a header, and tmpfs
    # gives out whole pages: a disk of exactly the estimate passes the up-front check, then fills midway.
    estimate = counts["tokens"] * counts["num_hidden_states"] * counts["hidden_size"] * 2
    size = pages(estimate)
    assert sum(pages(p.stat().st_size) for p in want_files) > size, "this disk would hold every file"
    stage = run_dir / "02_extract_hidden"
    hs_dir = stage / "data" / "hidden_states"

    with tmpfs(hs_dir, size):
        assert shutil.disk_usage(hs_dir).free >= estimate
        result = run_stage("02_extract_hidden.py", config)
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
        # vLLM's resource tracker may still print warnings after the stage's own line.
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, result.stderr[-3000:]
        assert errors[0].startswith("error: disk full while writing") and str(hs_dir) in errors[0], errors[0]
        kept = sorted(p.name for p in hs_dir.glob("hs_*.safetensors"))
        assert 1 <= len(kept) < 6
        assert not list(hs_dir.glob(".tmp-*")), "the failed write must not leave its temporary file"
        assert all(safetensors_is_whole(hs_dir / name) for name in kept)
        assert_same_hidden_states(hs_dir, want / "data" / "hidden_states", kept)
        assert status(stage) == "running"

        # Space freed: the same disk, grown.
        subprocess.run(["mount", "-o", f"remount,size={2 * size}", str(hs_dir)], check=True)
        result = ok(run_stage("02_extract_hidden.py", config))
        assert f"{len(kept)} of 6 samples already captured, {6 - len(kept)} to capture" in result.stdout
        manifest = assert_complete_and_whole(stage)
        assert sorted(p.name for p in hs_dir.iterdir()) == [p.name for p in want_files]
        assert_same_hidden_states(hs_dir, want / "data" / "hidden_states")
        assert manifest["output_fingerprint"] == read_manifest(want)["output_fingerprint"]


def test_stage_02_reserves_the_disk_that_stages_04_and_06_write_to_next(small_run, run, tmp_path):
    """A disk with room for the hidden states alone is refused up front when the later stages share it: it would
    fill hours later, in training. Nothing is written."""
    _, _, reference = small_run
    config, run_dir = run
    counts = read_manifest(reference / "02_extract_hidden")["counts"]
    estimate = counts["tokens"] * counts["num_hidden_states"] * counts["hidden_size"] * 2
    with tmpfs(run_dir, pages(4 * estimate) + 2**20):
        link = run_dir / "01_generate_data"
        shutil.copytree(reference / "01_generate_data", link)
        result = run_stage("02_extract_hidden.py", config)
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "stage 04's checkpoints (~" in errors[0] and "is free" in errors[0], errors
        assert not (run_dir / "02_extract_hidden" / "data").exists()


def test_disk_full_in_stage_03_is_one_disk_full_line_even_when_its_log_cannot_be_written(small_run, run):
    """numpy wraps the ENOSPC of a full disk in an error of its own, and the stage's log lives on the same disk:
    still exit 2 and one `error:` line naming the file, and the rerun on a disk with room completes."""
    _, _, reference = small_run
    config, run_dir = run
    link_stages(reference, run_dir, "01_generate_data", "02_extract_hidden")
    stage = run_dir / "03_build_vocab_map"
    with tmpfs(stage, 128 * 1024):  # d2t and t2d fit, the token counts do not
        result = run_stage("03_build_vocab_map.py", config)
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and errors[0].startswith(f"error: disk full while writing {stage}"), result.stderr[-3000:]
        assert "Traceback" not in result.stderr, result.stderr[-3000:]
        subprocess.run(["mount", "-o", "remount,size=16m", str(stage)], check=True)
        ok(run_stage("03_build_vocab_map.py", config))
        assert_complete_and_whole(stage)
        for name in ("d2t.npy", "t2d.npy", "token_counts.npy"):
            assert (stage / name).read_bytes() == (reference / "03_build_vocab_map" / name).read_bytes(), name


class ReferenceCapture:
    """Stage 02's engine (eagle_pipeline.capture.HiddenStateCapture) with its model load and capture replaced:
    each sequence gets the reference run's states, with `fault` applied. What a systematic fault of vLLM's
    capture path looks like to the stage, without an engine start."""

    def __init__(self, reference: Path, monkeypatch, fault=None):
        from eagle_pipeline.capture import HiddenStateCapture
        from eagle_pipeline.samples import read_sample

        hs = reference / "02_extract_hidden" / "data" / "hidden_states"
        self.by_ids = {tuple(row["input_ids"]): read_sample(hs / f"hs_{i}.safetensors")
                       for i, row in enumerate(dataset_rows(reference / "02_extract_hidden" / "data"))}
        self.fault, self.batches = fault, []
        monkeypatch.setattr(HiddenStateCapture, "__enter__", lambda engine: engine)
        monkeypatch.setattr(HiddenStateCapture, "__exit__", lambda engine, *exc_info: None)
        monkeypatch.setattr(HiddenStateCapture, "capture", lambda engine, batch: self.capture(batch))

    def capture(self, batch):
        self.batches.append(len(batch))
        samples = []
        for ids in batch:
            sample = {key: value.clone() for key, value in self.by_ids[tuple(int(t) for t in ids)].items()}
            if self.fault:
                self.fault(sample["hidden_states"])
            samples.append(sample)
        return samples


def test_a_capture_fault_is_named_after_the_first_batch_and_the_rerun_captures_it_again(small_run, run, monkeypatch, capsys):
    """The final layer's slot lost on every sample (as vLLM #48124 did to DeepSeek-family targets): stage 02 stops
    after its first batch, naming the V1 model runner as the alternative, and removes that batch's files; the
    rerun with a sound capture ends with the reference states."""
    from conftest import run_stage_in_process, without_log_records

    _, _, reference = small_run
    config, run_dir = run
    shutil.copytree(reference / "01_generate_data", run_dir / "01_generate_data")
    batch_size = read_manifest(reference / "02_extract_hidden")["config"]["hidden_states"]["batch_size"]
    lost_final_slot = ReferenceCapture(reference, monkeypatch, fault=lambda states: states[:, -1].zero_())
    code, _, err = run_stage_in_process("02_extract_hidden.py", config, capsys)
    errors = [line for line in without_log_records(err) if line.startswith(("error:", "failed:"))]
    assert code == 2 and len(errors) == 1, err
    assert errors[0].startswith("error: ") and "the final layer) is all zero" in errors[0]
    assert (f"stage 02 stopped after its first batch ({batch_size} samples, their files removed)" in errors[0]
            and "verifier.model_runner: v1" in errors[0])
    assert lost_final_slot.batches == [batch_size]  # the rest never captured
    assert not list((run_dir / "02_extract_hidden" / "data" / "hidden_states").glob("hs_*.safetensors"))

    sound = ReferenceCapture(reference, monkeypatch)
    code, _, err = run_stage_in_process("02_extract_hidden.py", config, capsys)
    assert code == 0, err
    assert sum(sound.batches) == len(dataset_rows(reference / "02_extract_hidden" / "data"))
    assert_same_hidden_states(run_dir / "02_extract_hidden" / "data" / "hidden_states",
                              reference / "02_extract_hidden" / "data" / "hidden_states")

