"""Stages 01-03 for real (vLLM CPU) on a few samples: outputs, reruns doing no work, kill and resume."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import REPO, SMALL, ok, run_stage, write_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def manifest(folder):
    return json.loads((folder / "manifest.json").read_text())


def test_outputs_are_complete_and_described(small_run):
    _, _, run_dir = small_run
    from datasets import load_from_disk

    conversations = load_from_disk(str(run_dir / "01_generate_data" / "conversations"))
    assert conversations["sample_id"] == [f"s{i:06d}" for i in range(6)]
    assert all(r in ("stop", "length") for r in conversations["finish_reason"])
    assert all(m[-1]["role"] == "assistant" and m[-1]["content"] for m in conversations["messages"])

    m2 = manifest(run_dir / "02_extract_hidden")
    assert m2["status"] == "complete" and m2["inputs"]["layer_ids"] == [2, 15, 27]
    for key in ("verifier", "tokenizer", "chat_template", "conversations"):
        assert key in m2["inputs"]
    assert m2["counts"]["samples"] == 6 and m2["counts"]["capture_tokens_per_s"] > 0

    m3 = manifest(run_dir / "03_build_vocab_map")
    import numpy as np

    d2t = np.load(run_dir / "03_build_vocab_map" / "d2t.npy")
    t2d = np.load(run_dir / "03_build_vocab_map" / "t2d.npy")
    assert d2t.dtype == np.int64 and d2t.shape == (512,)
    assert t2d.dtype == np.bool_ and t2d.shape == (49152,) and t2d.sum() == 512
    assert (np.arange(512) + d2t).tolist() == np.flatnonzero(t2d).tolist()
    assert m3["counts"]["coverage"] == pytest.approx(1.0)  # 6 short answers use fewer than 512 distinct tokens
    assert (run_dir / "03_build_vocab_map" / "coverage.png").stat().st_size > 1000


def test_speculators_data_loader_reads_stage_02_output_unchanged(small_run):
    _, _, run_dir = small_run
    from speculators.train.data import ArrowDataset

    data = ArrowDataset(max_len=2048, datapath=str(run_dir / "02_extract_hidden" / "data"), on_missing="raise")
    assert len(data) == 6
    for i in range(6):
        sample = data[i]
        seq = sample["input_ids"].shape[0]
        assert sample["hidden_states"].shape == (seq, 3 * 576)
        assert sample["verifier_last_hidden_states"].shape == (seq, 576)
        assert sample["loss_mask"].sum() > 0


def test_rerun_of_each_finished_stage_does_no_work(small_run):
    _, config, run_dir = small_run
    for script, folder in (("01_generate_data.py", "01_generate_data"), ("02_extract_hidden.py", "02_extract_hidden"),
                           ("03_build_vocab_map.py", "03_build_vocab_map")):
        before = manifest(run_dir / folder)
        t0 = time.monotonic()
        result = ok(run_stage(script, config))
        assert "already complete" in result.stdout
        assert manifest(run_dir / folder)["finished_at"] == before["finished_at"]
        assert time.monotonic() - t0 < 60, "a finished stage must not start an engine"


def test_changed_layer_ids_make_stage_02_refuse(small_run):
    _, config, _ = small_run
    result = run_stage("02_extract_hidden.py", config, "--set", "hidden_states.layer_ids=[3, 15, 27]")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error:") and "'layer_ids' changed" in result.stderr


def test_kill_stage_02_midway_then_rerun_gives_the_same_samples(small_run):
    root, _, reference = small_run
    config = write_config(root / "kill.yaml", data_root=str(root / "data"), run_name="k",
                          **{**SMALL, "hidden_states": {"batch_size": 1}})
    shutil.copytree(reference / "01_generate_data", root / "data" / "k" / "01_generate_data")
    hs_dir = root / "data" / "k" / "02_extract_hidden" / "data" / "hidden_states"
    proc = subprocess.Popen([sys.executable, str(REPO / "02_extract_hidden.py"), "--config", str(config)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and not (hs_dir.exists() and len(list(hs_dir.glob("hs_*.safetensors"))) >= 2):
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    killed_with = len(list(hs_dir.glob("hs_*.safetensors")))
    assert 2 <= killed_with < 6, "the kill must land midway"
    assert manifest(hs_dir.parent.parent)["status"] == "running"

    result = ok(run_stage("02_extract_hidden.py", config))
    assert f"{killed_with} of 6 samples already captured" in result.stdout

    from safetensors.torch import load_file

    ref_dir = reference / "02_extract_hidden" / "data" / "hidden_states"
    assert sorted(p.name for p in hs_dir.iterdir()) == sorted(p.name for p in ref_dir.iterdir())
    for name in sorted(p.name for p in ref_dir.iterdir()):
        a, b = load_file(str(hs_dir / name)), load_file(str(ref_dir / name))
        assert torch.equal(a["token_ids"], b["token_ids"])
        torch.testing.assert_close(a["hidden_states"].float(), b["hidden_states"].float(), rtol=0.05, atol=0.05)
    assert not list(hs_dir.parent.rglob(".tmp-*"))
