"""The suite's shared smoke run (tests/smoke_run.py), built as this file's one test.

A test of its own, ordered first (tests/conftest.py), so that one worker spends its core on the build
alone while the other runs the tests that do not need the run; the tests that do need it wait for its
markers. Run alone or deselected, nothing changes for them: the first test that needs the run starts it.
It is also the proof that `configs/tiny-smoke.yaml`, the users' first try, runs all six stages."""

from __future__ import annotations

import json

import pytest
import smoke_run
from conftest import smoke_folder

STAGES = ("01_generate_data", "02_extract_hidden", "03_build_vocab_map", "04_train", "05_convert", "06_serve_test")


@pytest.mark.vllm
@pytest.mark.slow
def test_the_first_try_config_runs_all_six_stages(request):
    folder = smoke_folder(request.config)
    smoke_run.wait_for(folder, smoke_run.LAST_STAGES)
    run_dir = smoke_run.run_dir(folder)
    for stage in STAGES:
        manifest = json.loads((run_dir / stage / "manifest.json").read_text())
        assert manifest["status"] == "complete", (stage, manifest["status"])
    report = json.loads((run_dir / "06_serve_test" / "report.json").read_text())
    assert set(report["tokens_per_s"]) == {"none", "ngram", "eagle3"}
    assert report["greedy_match"] is True
