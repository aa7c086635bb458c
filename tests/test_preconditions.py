"""What every stage checks first (eagle_pipeline/plan/preconditions.py): tensor parallelism against the target's heads,
the GPUs the host has, the folders the config names, the disk budget. The refusals through the stage scripts,
with nothing written, are cases of tests/test_bad_input.py; these test each rule and how GPUs are counted."""

from __future__ import annotations

import json
import os
import sys
from unittest import mock

import pytest
from conftest import REPO, run_stage, run_stage_in_process, write_config

from eagle_pipeline.config import load_config
from eagle_pipeline.errors import BadInput
from eagle_pipeline.plan import disk as disk_plan
from eagle_pipeline.plan import preconditions
from eagle_pipeline.plan.preconditions import check_gpu_count, check_parallel_split, parallel_split_problem
from eagle_pipeline.stage import STAGES


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
        "text_config": {"num_attention_heads": 64, "num_key_value_heads": 64, "num_hidden_layers": 61,
                        "hidden_size": 7168, "vocab_size": 163840, "intermediate_size": 18432}}))
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
    config = write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "data"), run_name="r", disk_budget_gb=1e-5)
    cfg = load_config(config)
    with mock.patch.object(preconditions, "plan_for_config", return_value=None):  # what is held, not what is planned
        preconditions.check_disk_budget(cfg, 3)  # no run folder yet
        (cfg.run_dir / "02_extract_hidden").mkdir(parents=True)
        (cfg.run_dir / "02_extract_hidden" / "a.bin").write_bytes(b"x" * 9_000)
        preconditions.check_disk_budget(cfg, 3)
        (cfg.run_dir / "02_extract_hidden" / "b.bin").write_bytes(b"x" * 2_000)
        above = r"^disk_budget_gb: the run folder \S+ already holds 11.0 KB, above disk_budget_gb \(1e-05 GB\)"
        with pytest.raises(BadInput, match=above):
            preconditions.check_disk_budget(cfg, 3)
    preconditions.check_disk_budget(load_config(config, ["disk_budget_gb=null"]), 3)


def test_stage_02s_hidden_states_are_planned_into_the_budget_once(tmp_path):
    """Once stage 01 has run, its token counts say what the hidden states will take (4 states x 576 x 2 bytes a
    token for the embedded target), beside what stages 03-06 plan; samples an interrupted stage 02 already wrote
    are not counted twice. Stage 01 itself is held to it too: a rerun of it would lead to the same states."""
    config = write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "data"), run_name="r")
    later = sum(s.bytes for s in disk_plan.plan_for_config(load_config(config)).stages if s.number > 2)
    budget = (later + 10_000_000) / 1e9  # 10 MB for stage 02: about 2,170 tokens of samples
    cfg = load_config(config, [f"disk_budget_gb={budget}"])
    first = cfg.stage_dir("01_generate_data")
    first.mkdir(parents=True)

    def conversations(tokens: int) -> None:
        (first / "manifest.json").write_text(json.dumps({"status": "complete", "inputs": {}, "counts": {
            "samples": 10, "prompt_tokens": tokens // 2, "completion_tokens": tokens - tokens // 2}}))

    conversations(2_000)
    preconditions.check_disk_budget(cfg, 2)
    preconditions.check_disk_budget(cfg, 1)
    conversations(3_000)
    above = (r"^disk_budget_gb: stage 02's hidden states \(~13.8 MB for 3000 tokens\), stage 04's checkpoints .* "
             r"would take the run folder \S+ to ~0.\d\d GB, above disk_budget_gb")
    with pytest.raises(BadInput, match=above):
        preconditions.check_disk_budget(cfg, 2)
    with pytest.raises(BadInput, match=r"^disk_budget_gb: stage 02's hidden states \(~13.8 MB for 3000 tokens\)"):
        preconditions.check_disk_budget(cfg, 1)
    conversations(2_000)
    samples = cfg.stage_dir("02_extract_hidden") / "data" / "hidden_states"
    samples.mkdir(parents=True)
    (samples / "hs_0.safetensors").write_bytes(b"x" * 4_000_000)  # part of the 9.2 MB planned, not beside it
    preconditions.check_disk_budget(cfg, 2)


@pytest.mark.parametrize("lines,counted", [
    (["q"] * 3, 3),                     # fewer prompts than data.num_eval_prompts: what the file holds
    (["q"] * 30, 24),                   # more: the 24 stage 06 serves
    (["q", "", "  ", "q"], 2),          # blank lines hold no prompt
    (["q" * ((3 << 20) - 64)] * 2, 6),  # a line under 3 MiB counts 3 (read 1 MiB at a time; the loader refuses it)
    (None, 24),                         # a named pipe is not opened (it would block): counted as full
], ids=["fewer", "more", "blank-lines", "long-lines", "named-pipe"])
def test_the_plan_counts_the_eval_prompts_the_file_holds_up_to_data_num_eval_prompts(tmp_path, lines, counted):
    path = tmp_path / "eval.jsonl"
    if lines is None:
        os.mkfifo(path)
    else:
        path.write_text("".join((json.dumps({"prompt": f"{text} {i}"}) if text.strip() else text) + "\n"
                                for i, text in enumerate(lines)))

    def captured(eval_path) -> tuple[int, str]:
        cfg = load_config(write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "data"),
                                       data={"eval_prompts": str(eval_path), "num_eval_prompts": 24}))
        stage = disk_plan.plan_for_config(cfg).stage(6)
        return stage.bytes, stage.phrase()

    full, _ = captured(REPO / "data" / "prompts_eval.jsonl")  # 48 prompts
    planned, phrase = captured(path)
    assert planned == full * counted // 24 and f"of {counted} eval conversations" in phrase, (planned, full, phrase)


# -- the disk plan of the Kimi-K2.5 configs ----------------------------------------------------------------------

KIMI_CONFIGS = sorted((REPO / "configs").glob("kimi-k2.5*.yaml"))


@pytest.fixture
def kimi_target(tmp_path):
    """Kimi-K2.5's config.json, as far as the disk plan reads it (the weights are not read)."""
    model = tmp_path / "Kimi-K2.5"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": {"model_type": "kimi_k2", "num_hidden_layers": 61, "hidden_size": 7168, "vocab_size": 163840,
                        "num_attention_heads": 64, "num_key_value_heads": 64, "intermediate_size": 18432,
                        # Its MLA attention, which an MLA drafter keeps (train.draft_layer: mla).
                        "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
                        "v_head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 262144,
                        "rope_theta": 50000.0, "rope_scaling": {
                            "type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096,
                            "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}}}))
    return model


def kimi_config(path, target, tmp_path, *overrides):
    return load_config(path, [f"verifier.path={target}", f"data_root={tmp_path / 'data'}", *overrides])


@pytest.mark.parametrize("path", KIMI_CONFIGS, ids=lambda p: p.name)
def test_every_kimi_configs_disk_budget_is_its_plan_with_room(path, kimi_target, tmp_path):
    """disk_budget_gb of each Kimi config covers what eagle_pipeline/plan/disk.py plans for it, with at most 10%
    room: a change to the plan or the config that leaves the budget behind (or far above) fails here."""
    cfg = kimi_config(path, kimi_target, tmp_path)
    plan = disk_plan.plan_for_config(cfg)
    assert cfg.disk_budget_gb is not None, f"{path.name}: set disk_budget_gb (the plan: {plan.total / 1e9:.1f} GB)"
    assert plan.total <= cfg.disk_budget_gb * 1e9 <= 1.1 * plan.total + 1e9, (path.name, plan.total / 1e9)
    # Whatever the scale: 3 checkpoints of ~8.6 GB (bf16 weights of 2.37B parameters, AdamW's bf16 moments of the
    # 0.96B trained ones: not the target's embedding and lm_head rows) and stage 06's 10 captured layers.
    assert 8.5e9 < plan.stage(4).bytes / 3 < 8.7e9 or cfg.train.init_from or cfg.hidden_states.mode == "online"
    # The replay reads each aux layer and its neighbours where the target has them (the diagnosis's readings).
    readings = {(2, 30, 58): "10 states: layers [1, 2, 3, 29, 30, 31, 57, 58, 59] and the final one",
                (1, 29, 57): "7 states: layers [1, 2, 29, 30, 57, 58] and the final one",  # the MLA release's ids
                # z-lab's DFlash release's, and the default ids a DFlash folder without them would be read with
                (2, 13, 25, 36, 48, 59): "20 states: layers [1, 2, 3, 12, 13, 14, 24, 25, 26, 30, 35, 36, 37, 47, 48, "
                                         "49, 58, 59, 60] and the final one"}
    assert readings[tuple(cfg.hidden_states.layer_ids)] in plan.stage(6).detail


def test_the_mla_fine_tune_configs_stage_04_dry_run_prints_the_mla_drafter_its_parameters_and_memory(kimi_target,
                                                                                                    tmp_path, capsys):
    """configs/kimi-k2.5-10k-finetune-mla.yaml on Kimi-K2.5's config (its released drafter's folder is not here:
    init_from left out; the MLA layer is the target's either way): the MLA shape, the parameters and the memory a
    training rank needs per GPU, before the GPU check a host without GPUs fails."""
    config = REPO / "configs" / "kimi-k2.5-10k-finetune-mla.yaml"
    code, out, err = run_stage_in_process("04_train.py", config, capsys, "--dry-run", "--set",
                                          f"verifier.path={kimi_target}", "--set", f"data_root={tmp_path / 'data'}",
                                          "--set", "train.init_from=null")
    assert "aux layer ids [1, 29, 57]" in out, out + err
    assert ("drafter: MLA layer, hidden 7168, heads 64, q_lora_rank 1536, kv_lora_rank 512, qk_nope_head_dim 128 + "
            "qk_rope_head_dim 64, v_head_dim 128, intermediate 18432, draft vocab 163840, ~3015.6M parameters") in out
    assert "q_a_proj [1536, 14336], q_b_proj [12288, 1536], kv_a_proj_with_mqa [576, 14336], kv_b_proj [16384, 512]" \
        ", o_proj [7168, 8192]" in out, out
    memory = next(line for line in out.splitlines() if line.startswith("  memory per GPU"))
    assert "replicated on each rank, packs of 4096 tokens" in memory and memory.endswith(" GiB"), memory
    assert code == 0 or err.strip().splitlines()[-1].startswith("error: device: cuda, but this host has no GPU"), err
    assert not (tmp_path / "data").exists()


def test_the_budget_is_compared_with_the_plan_before_stage_01_and_in_its_dry_run(kimi_target, tmp_path, capsys):
    old = kimi_config(REPO / "configs" / "kimi-k2.5-10.yaml", kimi_target, tmp_path, "disk_budget_gb=26")
    above = (r"^disk_budget_gb: stage 02's hidden states \(~0.82 GB for 10 samples x ~1434 tokens expected\), "
             r"stage 04's checkpoints \(~25.73 GB, 3 on disk at once, ~8.58 GB each\), stage 05's .*, stage 06's "
             r"captured states \(~11.74 GB .* would take the run folder \S+ to ~40.68 GB, above disk_budget_gb "
             r"\(26 GB\); raise disk_budget_gb to at least 41")
    with pytest.raises(BadInput, match=above):
        preconditions.check_disk_budget(old, 1)
    config = write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "data"), run_name="r", disk_budget_gb=0.5)
    code, _, stderr = run_stage_in_process("01_generate_data.py", config, capsys, "--dry-run")
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, stderr
    assert lines[0].startswith("error: disk_budget_gb: stage 02's hidden states (~0.41 GB for 500 samples x ~180 "
                               "tokens expected), stage 04's checkpoints"), lines[0]
    assert not (tmp_path / "data").exists()


def test_a_stage_06_rerun_of_a_full_kimi_run_within_its_plan_is_not_refused(kimi_target, tmp_path):
    """Every stage folder holding what the plan says it writes (sparse files: no disk is used): a rerun of any
    stage fits kimi-k2.5-10.yaml's budget, as it did not at the former 26 GB (refused from stage 05 on)."""
    cfg = kimi_config(REPO / "configs" / "kimi-k2.5-10.yaml", kimi_target, tmp_path)
    plan = disk_plan.plan_for_config(cfg)
    for stage in plan.stages:
        folder = cfg.stage_dir(STAGES[stage.number])
        folder.mkdir(parents=True)
        with open(folder / "planned.bin", "wb") as f:
            f.truncate(stage.bytes)
        if stage.number == 1:  # as many tokens as the plan expected
            (folder / "manifest.json").write_text(json.dumps({"status": "complete", "inputs": {}, "counts": {
                "samples": 10, "prompt_tokens": 0, "completion_tokens": 10 * disk_plan.expected_sample_tokens(cfg)}}))
    for number in STAGES:
        preconditions.check_disk_budget(cfg, number)
    with pytest.raises(BadInput, match=r"^disk_budget_gb: the run folder \S+ already holds 40.68 GB, above "
                                       r"disk_budget_gb \(26 GB\)"):
        preconditions.check_disk_budget(kimi_config(REPO / "configs" / "kimi-k2.5-10.yaml", kimi_target, tmp_path,
                                                    "disk_budget_gb=26"), 6)


# -- how many checkpoints stage 04 keeps ------------------------------------------------------------------------


def simulate_checkpoints(out_dir, keep_last: int, patience: int | None, losses: list[float]) -> int:
    """Stage 04's checkpoint folder through training with these validation losses: each epoch's save, its
    validation, keep_checkpoints, the early-stopping rule (eagle_pipeline/train/checkpoints.py); the most
    checkpoints on disk at once."""
    from eagle_pipeline.train import checkpoints as kept
    from eagle_pipeline.train.settings import CHECKPOINTS

    folder, peak = out_dir / CHECKPOINTS, 0
    for epoch, loss in enumerate(losses):
        saved = folder / str(epoch)
        saved.mkdir(parents=True)
        for name in kept.CHECKPOINT_FILES:
            (saved / name).write_text("x")
        state = {"epoch": epoch, "global_step": epoch + 1, "local_step": 0}
        (saved / kept.TRAINING_STATE).write_text(json.dumps(state))
        peak = max(peak, sum(1 for p in folder.iterdir() if p.is_dir()))
        kept.mark_complete(folder, epoch, {"loss": loss})
        kept.keep_checkpoints(out_dir, keep_last, "val_loss")
        if kept.stopped_early(out_dir, patience, "val_loss"):
            break
    return peak


@pytest.mark.parametrize("keep_last", [1, 2])
@pytest.mark.parametrize("patience", [None, 1, 2, 3])
@pytest.mark.parametrize("epochs", [2, 8])
def test_the_plan_counts_the_checkpoints_stage_04_keeps(tmp_path, keep_last, patience, epochs):
    patterns = {"best first": [float(e) for e in range(epochs)], "improving": [float(-e) for e in range(epochs)],
                "mixed": [5, 3, 4, 2, 6, 7, 1, 8][:epochs]}
    peaks = {name: simulate_checkpoints(tmp_path / name, keep_last, patience, losses)
             for name, losses in patterns.items()}
    train = load_config(write_config(tmp_path / "c.yaml"), [f"train.keep_last={keep_last}", f"train.epochs={epochs}",
                                                            f"train.early_stop_patience={patience or 'null'}"]).train
    assert max(peaks.values()) == disk_plan.kept_checkpoints(train), peaks


def test_the_replay_captures_every_readings_layers():
    """disk_plan's count of stage 06's captured layers is what the replay captures (predict.diagnose)."""
    from eagle_pipeline.predict.diagnose import capture_ids, readings

    for ids, layers in [((2, 30, 58), 61), ((2, 15, 27), 30), ((1, 2, 3), 4), ((1,), 3), ((5, 9), 12), ((3,), 3)]:
        expected = capture_ids(readings(ids, layers, {"norm_before_fc": True}, has_d2t=True), layers)
        assert disk_plan.reading_layer_ids(ids, layers) == expected, (ids, layers)


def test_decode_context_parallelism_with_speculation_on_triton_mla_is_warned_about(tmp_path):
    def warnings(**verifier):
        return preconditions.speculation_warnings(load_config(write_config(
            tmp_path / "c.yaml", data_root=str(tmp_path / "d"), run_name="t", verifier=verifier)))

    assert warnings() == [] and warnings(engine_args={"decode_context_parallel_size": 1}) == []
    kimi = warnings(attention_backend="TRITON_MLA", engine_args={"decode_context_parallel_size": 2})
    assert kimi == ["verifier.engine_args.decode_context_parallel_size 2 with speculation on TRITON_MLA: TRITON_MLA "
                    "verifies drafts through the prefill path under decode context parallelism, slower; keep it at 1 on "
                    "stock vLLM"]
    assert "vLLM's choice (TRITON_MLA" in warnings(engine_args={"decode_context_parallel_size": 4})[0]
    assert warnings(attention_backend="FLASH_ATTN", engine_args={"decode_context_parallel_size": 2}) == []
