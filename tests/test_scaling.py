"""The data-scaling study: its plan, the fitted trend, the document, and its refusals (no engine started)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
from conftest import REPO, write_config

from bench import scaling, scaling_report
from eagle_pipeline.errors import BadInput


def test_points_are_the_sizes_then_each_change_at_one_size():
    plan = scaling.plan_points([16, 64], [("train.epochs", "2"), ("train.epochs", "8")], None, 500)
    assert [p.name for p in plan] == ["n16", "n64", "n64-train.epochs-2", "n64-train.epochs-8"]
    assert plan[2].overrides == ["train.epochs=2"] and plan[0].overrides == []
    assert scaling.plan_points([16], [("vocab.draft_vocab_size", "1024")], 32, 500)[1].name == "n32-vocab.draft_vocab_size-1024"


def test_more_samples_than_the_run_has_is_refused_with_the_fix():
    with pytest.raises(BadInput, match=r"--sizes: 800 samples asked for, but the pipeline run has 500.*data.num_samples"):
        scaling.plan_points([16, 800], [], None, 500)
    with pytest.raises(BadInput, match="--sizes"):
        scaling.plan_points([16], [], 501, 500)


@pytest.mark.parametrize("text", ["", "a,b", "0,4", ","])
def test_bad_sizes_name_the_option(text):
    with pytest.raises(BadInput, match="^--sizes: "):
        scaling.parse_sizes(text)


def test_sizes_are_sorted_and_deduplicated():
    assert scaling.parse_sizes("64,16, 64,32") == [16, 32, 64]


@pytest.mark.parametrize("text", ["train.epochs", "=2", "train.epochs="])
def test_bad_vary_names_the_option(text):
    with pytest.raises(BadInput, match="^--vary: "):
        scaling.parse_vary(text)


def test_changes_are_checked_against_the_schema_and_must_leave_the_shared_data_alone(tmp_path):
    config = str(write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "data"), run_name="r"))
    scaling.check_changes(config, [], [("train.epochs", "2"), ("vocab.draft_vocab_size", "1024")])
    with pytest.raises(BadInput, match="train.epochs"):
        scaling.check_changes(config, [], [("train.epochs", "0")])
    with pytest.raises(BadInput, match="train.no_such_key"):
        scaling.check_changes(config, [], [("train.no_such_key", "1")])
    with pytest.raises(BadInput, match=r"--vary: hidden_states.storage_dtype shapes the pipeline run's"):
        scaling.check_changes(config, [], [("hidden_states.storage_dtype", "fp8")])


def test_the_trend_recovers_a_log_linear_law_and_inverts_it():
    tokens = [1_000, 4_000, 16_000, 64_000]
    fit = scaling_report.fit_log_trend(tokens, [1.2 + 0.1 * math.log(t) for t in tokens])
    assert fit["a"] == pytest.approx(1.2) and fit["b"] == pytest.approx(0.1) and fit["r2"] == pytest.approx(1.0)
    assert scaling_report.trend_at(fit, 1e6) == pytest.approx(1.2 + 0.1 * math.log(1e6))
    assert scaling_report.tokens_for(fit, scaling_report.trend_at(fit, 2e5)) == pytest.approx(2e5)
    assert scaling_report.tokens_for({"a": 2.0, "b": -0.1}, 2.5) is None
    assert scaling_report.fit_log_trend([1_000, 1_000], [1.3, 1.4]) is None
    # A point without a figure (a served run that measured nothing) is left out, not read as zero.
    assert scaling_report.fit_log_trend([1_000, 4_000, 9_000], [1.3, None, 1.5])["points"] == 2


def _point(samples, tokens, served, predicted):
    return {"run_dir": f"runs/n{samples}", "samples": samples, "training_tokens": tokens,
            "served_mean_acceptance_length": served, "served_per_position": [served - 1, 0.0, 0.0],
            "predicted_mean_acceptance_length": predicted, "predicted_per_position": [predicted - 1, 0.0, 0.0],
            "num_drafts": 100, "diagnosis": "agrees", "draft_vocab_coverage_train": 0.99, "draft_vocab_coverage_eval": 0.95,
            "epochs_completed": 4, "best_checkpoint": "checkpoints/3", "train_tokens_per_s": 700.0, "train_wall_s": 120.0,
            "wall_s": 60.0}


def _results(tmp_path):
    plan = scaling.plan_points([10, 100], [("train.epochs", "8")], None, 100)
    points = {"n10": _point(10, 1_000, 1.2, 1.25), "n100": _point(100, 10_000, 1.5, 1.55),
              "n100-train.epochs-8": _point(100, 10_000, 1.6, 1.62)}
    report = {"modes": {"ngram": {"mean_acceptance_length": 2.48}}}
    summary = scaling_report.summarize(points, plan, report, pipeline_samples=100, pipeline_tokens=10_000)
    meta = {"command": "scripts/run_scaling.sh configs/tiny.yaml --sizes 10,100", "config": "configs/tiny.yaml",
            "date": "2026-12-02 00:00 UTC", "total_s": 600.0, "num_prompts": 24, "num_speculative_tokens": 3}
    plan_rows = [{"name": p.name, "samples": p.samples, "change": list(p.change) if p.change else None} for p in plan]
    return {"meta": meta, "plan": plan_rows, "points": points, "summary": summary}


def test_the_summary_fits_only_the_data_scaling_points_and_predicts_ten_thousand_samples(tmp_path):
    summary = _results(tmp_path)["summary"]
    fit = summary["served_fit"]
    # Two sizes, ten times the tokens: 0.3 per factor of ten, and the varied point left out of the fit.
    assert fit["b"] == pytest.approx(0.3 / math.log(10)) and fit["points"] == 2
    assert summary["token_span"] == pytest.approx(10.0) and summary["tokens_per_sample"] == 100
    assert fit["at_target_samples"] == pytest.approx(1.5 + 0.3 * 2)  # 10k samples = 1e6 tokens, two decades on
    assert scaling_report.trend_at(fit, fit["tokens_to_ngram"]) == pytest.approx(2.48)


def test_the_document_and_the_plot(tmp_path):
    results = _results(tmp_path)
    text = scaling_report.render_markdown(results)
    assert "| n100-train.epochs-8 | 100 | 10,000 | 1.600 | 0.60 / 0.00 / 0.00 | 1.620 |" in text
    assert "at 10,000 samples (~1,000,000 tokens at this run's 100 per sample) it predicts 2.10" in text
    assert "n-gram on the same prompts: 2.48" in text and "None" not in text
    # The single change sits under the unchanged point of its size, with the difference it made.
    assert "| 100 | - | 1.500 | - | 1.550 | 95.0% | 4 (3) | 700 | 120 |" in text
    assert "| 100 | train.epochs=8 | 1.600 | +0.100 | 1.620 |" in text
    scaling_report.plot(results, tmp_path / "scaling.png")
    assert (tmp_path / "scaling.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_eval_coverage_counts_the_answer_tokens_the_draft_vocabulary_holds(tmp_path):
    import numpy as np

    in_draft = np.zeros(10, dtype=bool)
    in_draft[[1, 2, 3]] = True
    np.save(tmp_path / "t2d.npy", in_draft)
    # Five answer tokens, repeats counted: 1, 2, 2 are drafted, 7 and 9 never can be.
    assert scaling.eval_answer_coverage(tmp_path / "t2d.npy", [[1, 2, 7], [2, 9]]) == pytest.approx(0.6)
    assert scaling.eval_answer_coverage(tmp_path / "missing.npy", [[1]]) is None


def test_a_work_folder_cut_from_another_run_is_refused(tmp_path):
    manifests = {name: {"output_fingerprint": name} for name in ("01_generate_data", "02_extract_hidden", "06_serve_test")}
    scaling.check_source(tmp_path / "work", manifests)
    scaling.check_source(tmp_path / "work", manifests)  # the same run: resumed
    manifests["02_extract_hidden"]["output_fingerprint"] = "recaptured"
    with pytest.raises(BadInput, match="--work-dir: .* holds points cut from another pipeline run"):
        scaling.check_source(tmp_path / "work", manifests)


def test_the_script_exits_2_with_one_error_line_when_the_run_is_missing(tmp_path):
    config = write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "data"), run_name="r")
    result = subprocess.run([sys.executable, "-m", "bench.scaling", "--config", str(config), "--sizes", "4,8"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and "scripts/run_pipeline.sh" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "data" / "r-scaling").exists()
