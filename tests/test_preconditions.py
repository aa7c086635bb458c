"""What every stage checks first (eagle_pipeline/preconditions.py): tensor parallelism against the target's heads,
the GPUs the host has, the folders the config names, the disk budget. The refusals through the stage scripts,
with nothing written, are cases of tests/test_bad_input.py; these test each rule and how GPUs are counted."""

from __future__ import annotations

import json
import os
import sys
from unittest import mock

import pytest
from conftest import run_stage, write_config

from eagle_pipeline import preconditions
from eagle_pipeline.config import load_config
from eagle_pipeline.errors import BadInput
from eagle_pipeline.preconditions import check_gpu_count, check_parallel_split, parallel_split_problem


@pytest.mark.parametrize("heads,kv_heads,tp,problem", [
    (64, 64, 8, None),             # Kimi-K2.5
    (32, 8, 8, None),
    (32, 8, 16, None),             # more ranks than key/value heads: each is replicated
    (32, 8, 4, None),
    (32, 8, 3, "does not divide the 32 attention heads"),
    (48, 8, 12, "12 and the 8 key/value heads"),  # 48 heads split 12 ways, but 8 kv heads neither 12's divisor nor multiple
    (40, 40, 16, "does not divide the 40 attention heads"),
    (9, None, 3, None),            # no num_key_value_heads: as many as attention heads
])
def test_parallel_split_follows_vllms_rules(heads, kv_heads, tp, problem):
    config = {"num_attention_heads": heads, **({"num_key_value_heads": kv_heads} if kv_heads else {})}
    found = parallel_split_problem(config, tp)
    assert (found is None) if problem is None else (problem in found), found


def test_the_heads_are_read_from_text_config_where_the_model_nests_them(tmp_path):
    model = tmp_path / "kimi"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "num_attention_heads": 2,  # the vision tower's, not used
        "text_config": {"num_attention_heads": 64, "num_key_value_heads": 64, "num_hidden_layers": 61}}))
    config = write_config(tmp_path / "c.yaml", verifier={"path": str(model), "tensor_parallel_size": 8})
    check_parallel_split(load_config(config))
    with pytest.raises(BadInput, match=r"^verifier.tensor_parallel_size: 6 does not divide the 64 attention heads of the "
                                       r"target \(\S+/kimi/config.json\); choose a divisor of 64 \(the largest up to 6 is 4\)"):
        check_parallel_split(load_config(config, ["verifier.tensor_parallel_size=6"]))


def fake_nvidia_smi(folder, gpus: int):
    """An nvidia-smi on PATH that lists `gpus` GPUs to `-L`."""
    folder.mkdir(exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + "".join(f"echo 'GPU {i}: NVIDIA H100 (UUID: GPU-{i})'\n" for i in range(gpus)))
    script.chmod(0o755)
    return {"PATH": f"{folder}{os.pathsep}{os.environ['PATH']}"}


def without_cuda_visible_devices():
    return {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}


@pytest.fixture
def no_torch():
    """GPUs counted as a dry run counts them: torch not imported."""
    with mock.patch.dict(sys.modules, {"torch": None}):
        yield


def test_gpus_are_counted_by_nvidia_smi_or_cuda_visible_devices(tmp_path, no_torch):
    cfg = load_config(write_config(tmp_path / "c.yaml"), ["device=cuda", "verifier.tensor_parallel_size=3", "train.num_gpus=2"])
    with mock.patch.dict(os.environ, {**without_cuda_visible_devices(), **fake_nvidia_smi(tmp_path / "bin", 2)}, clear=True):
        assert preconditions.count_host_gpus() == (2, "nvidia-smi -L lists 2")
        with pytest.raises(BadInput, match=r"^verifier.tensor_parallel_size: 3, but this host has 2 GPU\(s\) \(nvidia-smi -L lists 2\)"):
            check_gpu_count(cfg)
        check_gpu_count(load_config(write_config(tmp_path / "c.yaml"), ["device=cuda", "train.num_gpus=2"]))
        with mock.patch.dict(os.environ, {"CUDA_VISIBLE_DEVICES": "1"}):
            with pytest.raises(BadInput, match=r"^train.num_gpus: 2, but this host has 1 GPU\(s\) \(CUDA_VISIBLE_DEVICES names 1\)"):
                check_gpu_count(load_config(write_config(tmp_path / "c.yaml"), ["device=cuda", "train.num_gpus=2"]))


def test_a_cpu_run_counts_no_gpus(tmp_path, no_torch):
    cfg = load_config(write_config(tmp_path / "c.yaml"), ["verifier.tensor_parallel_size=3"])
    with mock.patch.object(preconditions, "count_host_gpus", side_effect=AssertionError("counted")):
        check_gpu_count(cfg)  # device cpu, train.num_gpus 0: nothing asked of the host


def test_a_dry_run_refuses_more_gpus_than_the_host_lists(tmp_path):
    config = write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "data"), run_name="r", device="cuda",
                          train={"num_gpus": 4})
    result = run_stage("01_generate_data.py", config, "--dry-run",
                       env={**fake_nvidia_smi(tmp_path / "bin", 2)} | {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "error: train.num_gpus: 4, but this host has 2 GPU(s) (CUDA_VISIBLE_DEVICES names 2); lower it to at most 2 "
        "(0 trains on the CPU), or run on a host with 4 GPUs")
    ok = run_stage("01_generate_data.py", config, "--dry-run", "--set", "train.num_gpus=2",
                   env={**fake_nvidia_smi(tmp_path / "bin", 2)} | {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert ok.returncode == 0, ok.stderr
    assert not (tmp_path / "data").exists()


def test_every_referenced_folder_is_checked_and_present_ones_pass(tmp_path):
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    baseline = tmp_path / "06_serve_test"
    baseline.mkdir()
    keys = ["vocab.from_drafter", "train.init_from", "convert.reference_dir", "serve.drafter"]
    cfg = load_config(write_config(tmp_path / "c.yaml"), [f"{k}={drafter}" for k in keys] + [f"serve.baseline={baseline}"])
    preconditions.check_referenced_folders(cfg)
    for key in keys:
        with pytest.raises(BadInput, match=rf"^{key}: \S+/afile is not a folder"):
            (tmp_path / "afile").write_text("x")
            preconditions.check_referenced_folders(load_config(write_config(tmp_path / "c.yaml"), [f"{key}={tmp_path / 'afile'}"]))


def test_the_budget_counts_what_the_run_folder_holds(tmp_path):
    cfg = load_config(write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "data"), run_name="r", disk_budget_gb=1e-5))
    preconditions.check_disk_budget(cfg, 3)  # no run folder yet
    (cfg.run_dir / "02_extract_hidden").mkdir(parents=True)
    (cfg.run_dir / "02_extract_hidden" / "a.bin").write_bytes(b"x" * 9_000)
    preconditions.check_disk_budget(cfg, 3)
    (cfg.run_dir / "02_extract_hidden" / "b.bin").write_bytes(b"x" * 2_000)
    with pytest.raises(BadInput, match=r"^disk_budget_gb: the run folder \S+ already holds 11.0 KB, above disk_budget_gb \(1e-05 GB\)"):
        preconditions.check_disk_budget(cfg, 3)
    preconditions.check_disk_budget(load_config(write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "data"), run_name="r")), 3)


def test_stage_02s_hidden_states_are_planned_into_the_budget_once(tmp_path):
    """From stage 02 on, stage 01's token counts say what the hidden states will take (4 states x 576 x 2 bytes a
    token for the embedded target); samples an interrupted stage 02 already wrote are not counted twice."""
    budget = 0.01  # GB: 10 MB, about 2,170 tokens of samples
    cfg = load_config(write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "data"), run_name="r", disk_budget_gb=budget))
    first = cfg.stage_dir("01_generate_data")
    first.mkdir(parents=True)

    def conversations(tokens: int) -> None:
        (first / "manifest.json").write_text(json.dumps({"status": "complete", "inputs": {}, "counts": {
            "samples": 10, "prompt_tokens": tokens // 2, "completion_tokens": tokens - tokens // 2}}))

    conversations(2_000)
    preconditions.check_disk_budget(cfg, 2)
    preconditions.check_disk_budget(cfg, 1)
    conversations(3_000)
    with pytest.raises(BadInput, match=r"^disk_budget_gb: stage 02's hidden states \(~13.8 MB for 3000 tokens\) would take"):
        preconditions.check_disk_budget(cfg, 4)
    preconditions.check_disk_budget(cfg, 1)  # stage 01 itself is not held to what stage 02 will write
    conversations(2_000)
    samples = cfg.stage_dir("02_extract_hidden") / "data" / "hidden_states"
    samples.mkdir(parents=True)
    (samples / "hs_0.safetensors").write_bytes(b"x" * 4_000_000)  # part of the 9.2 MB planned, not beside it
    preconditions.check_disk_budget(cfg, 2)
