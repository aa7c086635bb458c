"""The suite's shared smoke run (tests/smoke_run.py) is what users get as their first try
(`configs/tiny-smoke.yaml`): all six stages complete, and stage 06 served all three modes."""

from __future__ import annotations

import json

import pytest

STAGES = ("01_generate_data", "02_extract_hidden", "03_build_vocab_map", "04_train", "05_convert", "06_serve_test")


@pytest.mark.vllm
@pytest.mark.slow
def test_the_first_try_config_runs_all_six_stages(finished_small_run):
    _, run_dir = finished_small_run
    for stage in STAGES:
        manifest = json.loads((run_dir / stage / "manifest.json").read_text())
        assert manifest["status"] == "complete", (stage, manifest["status"])
    report = json.loads((run_dir / "06_serve_test" / "report.json").read_text())
    assert set(report["tokens_per_s"]) == {"none", "ngram", "eagle3"}
    assert report["greedy_match"] is True
