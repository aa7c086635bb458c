"""The training A/B: its summary and document, and its refusals (no training started)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, write_config

from bench import train_ab
from eagle_pipeline.errors import BadInput


def test_ratios_are_paired_and_the_unpadded_losses_are_compared_step_by_step():
    # The machine slowed down in the second repetition; the pairs cancel it.
    runs = {"shipped": [{"tokens_per_s": 100.0, "losses": [10.0, 9.0]}, {"tokens_per_s": 50.0, "losses": [10.0, 9.0]}],
            "unpadded": [{"tokens_per_s": 140.0, "losses": [10.0, 9.0009]}, {"tokens_per_s": 70.0, "losses": [10.0, 9.0]}],
            "best_fit": [{"tokens_per_s": 160.0, "losses": [11.0]}, {"tokens_per_s": 80.0, "losses": [11.0]}],
            "unpadded_bf16": [{"tokens_per_s": 200.0, "losses": [10.5]}, {"tokens_per_s": 110.0, "losses": [10.5]}],
            "best_fit_bf16": [{"tokens_per_s": 220.0, "losses": [11.5]}, {"tokens_per_s": 120.0, "losses": [11.5]}],
            "unpadded_bf16_sdpa": [{"tokens_per_s": 160.0, "losses": [10.5]}, {"tokens_per_s": 100.0, "losses": [10.5]}]}
    summary = train_ab.summarize(runs)
    assert summary["ratio_to_shipped"]["unpadded"]["median"] == pytest.approx(1.4)
    assert summary["ratio_to_shipped"]["best_fit"]["median"] == pytest.approx(1.6)
    assert summary["ratio_to_shipped"]["unpadded_bf16"]["median"] == pytest.approx(2.1)
    assert summary["loss_max_relative_difference_unpadded_vs_shipped"] == pytest.approx(1e-4)
    results = {**summary, "total_seq_len": 512,
               "packing": {"sequential": {"batches": 273, "fill": 0.708}, "best_fit": {"batches": 235, "fill": 0.822}}}
    text = train_ab.report(results)
    assert "| unpadded | 105 [70-140] | 1.40x |" in text and "| best_fit | 235 | 82.2% |" in text
    assert "largest relative difference 1.0e-04" in text
    assert "| unpadded_bf16 | 155 [110-200] | 2.10x |" in text
    assert "| best_fit_bf16 | 170 [120-220] | 2.30x |" in text
    # The attention patch against speculators' own attention, pair by pair: 200/160 and 110/100.
    assert summary["ratio_block_attention_over_sdpa"]["median"] == pytest.approx(1.175)
    assert "(unpadded_bf16 over unpadded_bf16_sdpa): 1.18x." in text


def test_an_arm_this_cpu_cannot_run_is_na_with_its_reason():
    runs = {arm: [{"tokens_per_s": 100.0, "losses": [1.0]}] for arm in ("shipped", "unpadded", "best_fit")}
    reason = "n/a (no bf16 matmul kernel on this CPU: could not create a primitive descriptor)"
    summary = train_ab.summarize(runs, dict.fromkeys(train_ab.BF16_ARMS, reason))
    text = train_ab.report({**summary, "total_seq_len": 512, "packing": {}})
    assert summary["ratio_block_attention_over_sdpa"] == reason
    for arm in ("unpadded_bf16", "best_fit_bf16", "unpadded_bf16_sdpa"):
        assert summary["tokens_per_s"][arm] == summary["ratio_to_shipped"][arm] == reason
        assert f"| {arm} | {reason} | - |" in text
    assert train_ab.bf16_arm_unavailable("bfloat16") == "n/a (the run already trains in bfloat16)"


def test_a_foreign_work_folder_is_refused(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(BadInput, match="--work-dir: .* is not a training A/B folder"):
        train_ab.arms.prepare_work_dir(tmp_path, train_ab.WORK_MARKER, "bench.train_ab", "training A/B folder")
    assert (tmp_path / "mine.txt").read_text() == "keep"


def test_without_a_finished_run_it_exits_2_with_one_error_line(tmp_path):
    config = write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "data"), run_name="r")
    result = subprocess.run([sys.executable, "-m", "bench.train_ab", "--config", str(config)],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and "02_extract_hidden" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "data" / "r-train-ab").exists()
