"""Fault injection into stages 04-06 (tests/fault_injection.py): each killed at seeded points and rerun to
what the session's uninterrupted `finished_small_run` made, and stage 04 refusing a disk without room for its
checkpoints."""

from __future__ import annotations

import json
import random
import re
import shutil

import numpy as np
import pytest
from conftest import ok, run_stage
from fault_injection import (
    SEED,
    assert_complete_and_whole,
    fresh_run,
    kill_at,
    link_stages,
    port_in_use,
    read_manifest,
    server_ports,
    status,
    tmpfs,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture
def run(tmp_path):
    return fresh_run(tmp_path)


# The resume rules it proves through real servers are also shown with stand-in servers, in the suite:
# tests/test_serve_records.py (a failed start keeps what was served; a rerun past serving only predicts).
@pytest.mark.heavy
def test_stage_06_killed_before_and_after_serving_reruns_to_the_reference_report(finished_small_run, run, tmp_path):
    """Killed while its server loads and while it serves, stage 06 serves again on its rerun; killed once the
    served measurements are written, its rerun only predicts. A finished stage 06 whose report.json is lost
    rebuilds it the same way, without a server."""
    _, reference = finished_small_run
    config, run_dir = run
    link_stages(reference, run_dir, "01_generate_data", "02_extract_hidden", "03_build_vocab_map", "04_train",
                "05_convert")
    stage = run_dir / "06_serve_test"
    first_log = stage / "logs" / "server-eagle3.log"
    # One server instead of four: what a kill leaves behind does not depend on the mode, the answers without
    # speculation come from the uninterrupted run's kept baseline (the same settings shaped them), and the smoke
    # config's schedule is not served again to confirm it.
    settings = ["--set", f"serve.baseline={reference / '06_serve_test'}", "--set", "serve.ngram_baseline=false",
                "--set", "serve.confirm_schedule=false"]
    rng = random.Random(SEED + 6)

    # While the server's engine loads the weights: API server, engine core and worker all running.
    loading = "Loading safetensors checkpoint"
    kill_at("06_serve_test.py", config, *settings, stage_dir=stage,
            when=lambda: first_log.exists() and loading in first_log.read_text(errors="replace"),
            delay=rng.uniform(0.0, 2.0), log_path=tmp_path / "kill-1.log")
    # Once it serves: during the warm-up request or the measured prompts.
    kill_at("06_serve_test.py", config, *settings, stage_dir=stage,
            when=lambda: "[eagle3] server healthy" in (tmp_path / "kill-2.log").read_text(errors="replace"),
            delay=rng.uniform(0.0, 1.0), log_path=tmp_path / "kill-2.log")
    assert not (stage / "report.json").exists()
    # Past serving, while it predicts: the report without the prediction is written first.
    kill_at("06_serve_test.py", config, *settings, stage_dir=stage, when=(stage / "report.json").exists, delay=0.0,
            log_path=tmp_path / "kill-3.log")
    assert "predicted_mean_acceptance_length" not in json.loads((stage / "report.json").read_text())

    rerun = ok(run_stage("06_serve_test.py", config, *settings, timeout=1800))
    assert "predicting without serving again" in rerun.stdout and "starting vLLM server" not in rerun.stdout
    manifest = assert_complete_and_whole(stage)
    assert manifest["engine_starts"]["target_starts"] == 0  # no server; the kept baseline holds the replay's states
    report = json.loads((stage / "report.json").read_text())
    expected = json.loads((reference / "06_serve_test" / "report.json").read_text())
    for field in ("num_prompts", "num_speculative_tokens", "mean_acceptance_length", "acceptance_rate",
                  "per_position_acceptance", "tokens_per_s", "speedup", "greedy_match"):
        assert field in report
    assert report["tokens_per_s"]["none"] > 0 and report["tokens_per_s"]["eagle3"] > 0
    assert report["num_prompts"] == expected["num_prompts"] == 3
    assert report["prompt_ids"] == expected["prompt_ids"]
    assert report["greedy_match"] is True and manifest["counts"]["passed"] is True
    assert report["diagnosis"]["status"] == "agrees" and report["predicted_mean_acceptance_length"] is not None
    responses = [json.loads(line) for line in (stage / "responses.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (reference / "06_serve_test" / "responses.jsonl").read_text().splitlines()]
    assert [r["index"] for r in responses] == [0, 1, 2]
    # Greedy decoding in float32: the drafter's answers are the uninterrupted run's, beside the kept answers
    # without it.
    for mode in ("none", "eagle3"):
        assert [r["responses"][mode] for r in responses] == [r["responses"][mode] for r in want], mode
    assert not [port for port in server_ports(stage) if port_in_use(port)]

    # The report lost from a finished stage: rebuilt from what the stage kept, no engine started.
    (stage / "report.json").unlink()
    again = ok(run_stage("06_serve_test.py", config, *settings, timeout=900))
    assert "starting vLLM server" not in again.stdout
    rebuilt = json.loads((stage / "report.json").read_text())
    assert rebuilt["predicted_mean_acceptance_length"] == report["predicted_mean_acceptance_length"]
    assert read_manifest(stage)["engine_starts"]["target_starts"] == 0


def test_stage_05_killed_twice_converts_the_same_bytes_and_passes(finished_small_run, run, tmp_path):
    _, reference = finished_small_run
    config, run_dir = run
    link_stages(reference, run_dir, "01_generate_data", "02_extract_hidden", "03_build_vocab_map", "04_train")
    stage = run_dir / "05_convert"
    rng = random.Random(SEED + 5)

    # While it converts.
    kill_at("05_convert.py", config, stage_dir=stage, when=lambda: status(stage) == "running",
            delay=rng.uniform(0.0, 0.5), log_path=tmp_path / "kill-1.log")
    # While vLLM verifies the converted folder.
    kill_at("05_convert.py", config, stage_dir=stage,
            when=lambda: (stage / "vllm" / "model.safetensors").exists(),
            delay=rng.uniform(2.0, 10.0), log_path=tmp_path / "kill-2.log")
    assert not (stage / "verify.json").exists()

    ok(run_stage("05_convert.py", config, timeout=1800))
    manifest = assert_complete_and_whole(stage)
    want = reference / "05_convert"
    for name in ("config.json", "model.safetensors"):
        assert (stage / "vllm" / name).read_bytes() == (want / "vllm" / name).read_bytes(), name
    checks = json.loads((stage / "verify.json").read_text())["checks"]
    assert {name: check["ok"] or check.get("skipped") for name, check in checks.items()} == {
        "shapes": True, "config": True, "vllm_load": True, "vllm_logits": True, "parity": True}
    assert manifest["output_fingerprint"] == read_manifest(want)["output_fingerprint"]


def test_stage_04_killed_while_saving_and_while_training_resumes_to_the_reference_steps(finished_small_run, run,
                                                                                      tmp_path):
    from eagle_pipeline.train import checkpoints as train_checkpoints
    from eagle_pipeline.train import metrics

    _, reference = finished_small_run
    config, run_dir = run
    link_stages(reference, run_dir, "01_generate_data", "02_extract_hidden", "03_build_vocab_map")
    stage = run_dir / "04_train"
    checkpoints = stage / "checkpoints"
    rng = random.Random(SEED + 4)

    # While speculators writes or validates the first checkpoint: a torn folder the rerun must delete.
    kill_at("04_train.py", config, stage_dir=stage, when=lambda: (checkpoints / "0").is_dir(),
            delay=rng.uniform(0.0, 0.3), log_path=tmp_path / "kill-1.log")
    assert train_checkpoints.complete_checkpoints(checkpoints) == {}
    # In the second epoch, once the first checkpoint is complete: the rerun resumes from it.
    output = kill_at("04_train.py", config, stage_dir=stage,
                     when=lambda: (checkpoints / "0" / train_checkpoints.COMPLETE_MARKER).exists(),
                     delay=rng.uniform(0.0, 0.5), log_path=tmp_path / "kill-2.log")
    assert "Removed incomplete checkpoint 0" in output
    assert list(train_checkpoints.complete_checkpoints(checkpoints)) == [0]

    ok(run_stage("04_train.py", config, timeout=1800))
    manifest = assert_complete_and_whole(stage)
    want = reference / "04_train"
    expected = read_manifest(want)
    assert manifest["counts"]["epochs_completed"] == expected["counts"]["epochs_completed"] == 2
    complete = train_checkpoints.complete_checkpoints(checkpoints)
    assert {e: s["global_step"] for e, s in complete.items()} == {
        e: s["global_step"] for e, s in train_checkpoints.complete_checkpoints(want / "checkpoints").items()}
    assert json.loads((stage / "best.json").read_text())["checkpoint"] in {f"checkpoints/{e}" for e in complete}
    for epoch in complete:
        validation = json.loads((checkpoints / str(epoch) / train_checkpoints.COMPLETE_MARKER).read_text())
        assert np.isfinite(validation["loss"])
    rows = metrics.read_metrics(stage / "metrics.csv")
    want_rows = metrics.read_metrics(want / "metrics.csv")
    # Every step logged exactly once: rows the killed runs logged past their checkpoint were dropped.
    assert [r["step"] for r in rows if r["split"] == "train"] == [r["step"] for r in want_rows if r["split"] == "train"]
    assert [r["epoch"] for r in rows if r["split"] == "val"] == [0, 1]
    # Epoch 0 was trained from scratch after the first kill: the same bytes as the uninterrupted run.
    first = "checkpoints/0/model.safetensors"
    assert (stage / first).read_bytes() == (want / first).read_bytes()
    # speculators checkpoints weights and AdamW moments in bf16 while it trains in fp32, so an epoch resumed
    # from a checkpoint is close to the uninterrupted one, not identical; resumed from the wrong checkpoint
    # (or from scratch) its validation loss would be far off.
    last = max(complete)
    want_loss = train_checkpoints.complete_checkpoints(want / "checkpoints")[last]["val_loss"]
    assert complete[last]["val_loss"] == pytest.approx(want_loss, rel=0.02)


def test_stage_04_stopped_by_sigterm_keeps_its_complete_epochs_and_resumes_after_them(small_run, run, tmp_path):
    """SIGTERM to the stage's process group (scripts/remote.sh stop) once the first epoch has trained: the epoch's
    checkpoint is completed (validated, replayed) before the stage exits 130 with the `interrupted:` line, and
    the rerun trains the second epoch only."""
    import contextlib
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import REPO

    from eagle_pipeline.train import checkpoints as train_checkpoints
    from eagle_pipeline.train import metrics

    _, _, reference = small_run
    config, run_dir = run
    link_stages(reference, run_dir, "01_generate_data", "02_extract_hidden", "03_build_vocab_map")
    stage = run_dir / "04_train"
    checkpoints = stage / "checkpoints"
    log_path = tmp_path / "stopped.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, str(REPO / "04_train.py"), "--config", str(config)], cwd=REPO,
                                   env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + 900
        while not (checkpoints / "0").is_dir():  # epoch 0 trained: its checkpoint is being saved and validated
            assert process.poll() is None, log_path.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 900 s"
            time.sleep(0.02)
        validated_at_stop = (checkpoints / "0" / train_checkpoints.COMPLETE_MARKER).exists()
        os.killpg(process.pid, signal.SIGTERM)
        code = process.wait(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    output = log_path.read_text(errors="replace")
    assert code == 130, output[-3000:]
    assert output.strip().splitlines()[-1].startswith(
        "interrupted: stage 04_train stopped by SIGTERM; finished work is kept; rerun the same command"), output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    # Stopped before epoch 0's checkpoint was validated, which it then was before the stage stopped.
    assert not validated_at_stop and "SIGTERM: completing the checkpoint of epoch 0" in output, output[-3000:]
    assert list(train_checkpoints.complete_checkpoints(checkpoints)) == [0]
    assert not (checkpoints / train_checkpoints.INTERRUPTED_DIR).exists()  # no mid-epoch save to throw away
    assert status(stage) == "running"

    rerun = ok(run_stage("04_train.py", config, timeout=1800))
    assert "Removed incomplete checkpoint" not in rerun.stdout + rerun.stderr
    manifest = assert_complete_and_whole(stage)
    assert manifest["counts"]["epochs_completed"] == 2
    assert json.loads((stage / "run_stats.json").read_text())["resumed_from"]["epoch"] == 0
    rows = metrics.read_metrics(stage / "metrics.csv")
    steps = [r["step"] for r in rows if r["split"] == "train"]
    assert steps == list(range(1, len(steps) + 1))  # every step once: epoch 0's were not trained again
    assert [r["epoch"] for r in rows if r["split"] == "val"] == [0, 1]


def test_stage_04_refuses_a_disk_without_room_for_its_checkpoints(small_run, run):
    _, _, reference = small_run
    config, run_dir = run
    link_stages(reference, run_dir, "01_generate_data", "02_extract_hidden", "03_build_vocab_map")
    dry = ok(run_stage("04_train.py", config, "--dry-run"))
    need = re.search(r"checkpoints ~([\d.]+) GB", dry.stdout).group(1)
    stage = run_dir / "04_train"

    with tmpfs(stage, 16 * 2**20):
        result = run_stage("04_train.py", config)
        free = f"{shutil.disk_usage(stage).free / 1e9:.2f}"
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error:"), result.stderr[-3000:]
        assert f"drafter checkpoints needs about {need} GB but only {free} GB is free" in last, last
        assert float(need) > float(free)
        # Refused before anything but its log was written.
        assert sorted(p.name for p in stage.iterdir()) == ["logs"]
