"""The generation A/B: its arms, the summary and document, and its refusals (no engine started)."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO, write_config

from bench import generation_ab
from eagle_pipeline.errors import BadInput


def test_an_arm_is_a_set_of_overrides():
    assert generation_ab.parse_arm("generation.batch_size=200 verifier.cpu_kvcache_gib=4") == [
        "generation.batch_size=200", "verifier.cpu_kvcache_gib=4"]


@pytest.mark.parametrize("text", ["", "generation.batch_size", "=200"])
def test_a_bad_arm_names_the_option(text):
    with pytest.raises(BadInput, match="--arm"):
        generation_ab.parse_arm(text)


def _run(rate, answers="same"):
    return {"output_tokens_per_s": rate, "generation_seconds": 10.0, "completion_tokens": 1000, "answers": answers}


def test_ratios_are_paired_within_a_repetition_and_differing_answers_are_reported():
    # The machine slowed down in the second repetition; the pairs cancel it (2x both times).
    runs = {"a": [_run(100.0), _run(50.0)], "b": [_run(200.0), _run(100.0, answers="other")]}
    summary = generation_ab.summarize(["a", "b"], runs)
    assert summary["b"]["ratio_to_first"]["median"] == pytest.approx(2.0)
    assert summary["b"]["output_tokens_per_s"]["median"] == pytest.approx(150.0)
    assert summary["a"]["same_answers_as_first"] and not summary["b"]["same_answers_as_first"]
    meta = {"command": "python -m bench.generation_ab", "config": "configs/tiny.yaml", "samples": 10, "repeats": 2,
            "date": "2026-12-03 00:00 UTC", "total_s": 60.0}
    text = generation_ab.render_markdown({"meta": meta, "summary": summary})
    assert "| b | 150 [100-200] | 2.00x | NO |" in text and "| a | 75 [50-100] | 1.00x | yes |" in text


def test_a_foreign_work_folder_is_refused(tmp_path):
    (tmp_path / "mine.txt").write_text("keep")
    with pytest.raises(BadInput, match="--work-dir: .* is not a generation A/B folder"):
        generation_ab.prepare_work_dir(tmp_path)
    assert (tmp_path / "mine.txt").read_text() == "keep"


def test_an_unknown_key_in_an_arm_exits_2_with_one_error_line_before_any_run(tmp_path):
    config = write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "data"), run_name="r")
    result = subprocess.run([sys.executable, "-m", "bench.generation_ab", "--config", str(config),
                             "--arm", "generation.batch_size=4", "--arm", "generation.batch_sise=8"],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and "batch_sise" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "data" / "r-generation-ab").exists()
