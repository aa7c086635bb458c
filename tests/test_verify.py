"""Drafter verification: shapes (config, reference), config, vLLM's real loader, acceptance parity."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import process_alive
from test_convert import (  # shared checkpoint builders
    TINY,
    TINY_DRAFT_VOCAB,
    TINY_LAYER_IDS,
    edit_config,
    edit_weights,
    make_speculators_drafter,
    make_verifier,
)

from eagle_pipeline.convert import convert_for_sglang, convert_for_vllm  # noqa: E402
from eagle_pipeline.drafter.tensors import expected_tensor_specs  # noqa: E402
from eagle_pipeline.drafter_checks import format_table, verify_drafter  # noqa: E402
from eagle_pipeline.drafter_checks.config_checks import check_config, vllm_config_problems  # noqa: E402
from eagle_pipeline.drafter_checks.parity import acceptance_parity, compare_acceptance  # noqa: E402
from eagle_pipeline.drafter_checks.shapes import check_shapes, compare_with_reference, reference_specs  # noqa: E402
from eagle_pipeline.drafter_checks.vllm_load import check_vllm  # noqa: E402

KIMI_LAYER_IDS = [2, 30, 58]


def kimi_flat_config(head_dim: int = 128) -> dict:
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 7168,
        "num_attention_heads": 64, "num_key_value_heads": 64, "head_dim": head_dim, "intermediate_size": 18432,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 262144, "rope_theta": 1e6, "num_hidden_layers": 1,
        "vocab_size": 163840, "draft_vocab_size": 32000, "target_hidden_size": 7168, "num_aux_hidden_states": 3,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": KIMI_LAYER_IDS, "use_aux_hidden_state": True},
        "eagle_aux_hidden_state_layer_ids": KIMI_LAYER_IDS, "norm_before_residual": True, "norm_before_fc": False,
        "fc_norm": False, "norm_output": False, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }


def kimi_speculators_config() -> dict:
    flat = kimi_flat_config()
    layer = {k: flat[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                  "intermediate_size", "rms_norm_eps", "vocab_size", "num_hidden_layers")}
    return {"speculators_model_type": "eagle3", "speculators_config": {"algorithm": "eagle3"},
            "transformer_layer_config": layer | {"model_type": "llama"}, "draft_vocab_size": 32000,
            "eagle_aux_hidden_state_layer_ids": KIMI_LAYER_IDS, "norm_before_residual": True,
            "target_hidden_size": None, "dtype": "bfloat16"}


# docs/formats.md, "Kimi-K2.5 drafter shapes".
KIMI_TABLE = {
    "fc.weight": ((7168, 21504), "BF16"),
    "midlayer.self_attn.q_proj.weight": ((8192, 14336), "BF16"),
    "midlayer.self_attn.k_proj.weight": ((8192, 14336), "BF16"),
    "midlayer.self_attn.v_proj.weight": ((8192, 14336), "BF16"),
    "midlayer.self_attn.o_proj.weight": ((7168, 8192), "BF16"),
    "midlayer.mlp.gate_proj.weight": ((18432, 7168), "BF16"),
    "midlayer.mlp.up_proj.weight": ((18432, 7168), "BF16"),
    "midlayer.mlp.down_proj.weight": ((7168, 18432), "BF16"),
    "midlayer.hidden_norm.weight": ((7168,), "BF16"),
    "midlayer.input_layernorm.weight": ((7168,), "BF16"),
    "midlayer.post_attention_layernorm.weight": ((7168,), "BF16"),
    "norm.weight": ((7168,), "BF16"),
    "lm_head.weight": ((32000, 7168), "BF16"),
    "d2t": ((32000,), "I64"),
    "t2d": ((163840,), "BOOL"),
}


def test_kimi_shapes_implied_by_config_match_the_reference_table():
    specs = expected_tensor_specs(kimi_flat_config())
    assert {name: (spec.shape, spec.dtype) for name, spec in specs.items()} == KIMI_TABLE


def test_kimi_speculators_config_implies_the_same_tensors():
    specs = expected_tensor_specs(kimi_speculators_config())
    assert "layers.0.self_attn.q_proj.weight" in specs
    assert compare_with_reference(specs, expected_tensor_specs(kimi_flat_config())) == []


def test_kimi_head_dim_112_is_reported_tensor_by_tensor_against_a_config_only_reference(tmp_path):
    reference = tmp_path / "released-drafter"
    reference.mkdir()
    (reference / "config.json").write_text(json.dumps(kimi_flat_config(128)))
    ref_specs, source = reference_specs(reference)
    assert source == "config.json only"

    problems = compare_with_reference(expected_tensor_specs(kimi_flat_config(112)), ref_specs)
    assert problems == [
        "midlayer.self_attn.k_proj.weight: shape [7168, 14336] but the reference has [8192, 14336]",
        "midlayer.self_attn.o_proj.weight: shape [7168, 7168] but the reference has [7168, 8192]",
        "midlayer.self_attn.q_proj.weight: shape [7168, 14336] but the reference has [8192, 14336]",
        "midlayer.self_attn.v_proj.weight: shape [7168, 14336] but the reference has [8192, 14336]",
    ]


# ----------------------------------------------------------------------------------------------
# Shape checks on real (tiny) conversions


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return make_verifier(tmp_path_factory.mktemp("target") / "tiny-llama")


@pytest.fixture(scope="module")
def speculators_dir(target, tmp_path_factory) -> Path:
    return make_speculators_drafter(target, tmp_path_factory.mktemp("spec") / "drafter", norm_before_residual=True)


@pytest.fixture(scope="module")
def converted(speculators_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("flat") / "drafter"
    convert_for_vllm(speculators_dir, out)
    return out


def problems_of(result: dict) -> list[str]:
    assert result["ok"] is False
    return result["detail"]["problems"]


def test_good_conversion_passes_shapes_against_config_and_speculators_reference(converted, speculators_dir):
    result = check_shapes(converted, reference_dir=speculators_dir)
    assert result["ok"], result["detail"]["problems"]
    assert result["detail"]["reference"]["source"] == "weights"
    assert check_shapes(speculators_dir)["ok"]


def test_wrong_head_dim_is_reported_per_tensor_against_reference(target, converted, tmp_path):
    wrong = make_speculators_drafter(target, tmp_path / "hd8", head_dim=8)
    convert_for_vllm(wrong, tmp_path / "flat-hd8")
    assert check_shapes(tmp_path / "flat-hd8")["ok"]  # consistent with its own config ...
    problems = problems_of(check_shapes(tmp_path / "flat-hd8", reference_dir=converted))  # ... not with the reference
    assert problems == [
        "vs reference: midlayer.self_attn.k_proj.weight: shape [16, 128] but the reference has [32, 128]",
        "vs reference: midlayer.self_attn.o_proj.weight: shape [64, 32] but the reference has [64, 64]",
        "vs reference: midlayer.self_attn.q_proj.weight: shape [32, 128] but the reference has [64, 128]",
        "vs reference: midlayer.self_attn.v_proj.weight: shape [16, 128] but the reference has [32, 128]",
    ]
    config_only = tmp_path / "reference-config-only"
    config_only.mkdir()
    shutil.copy(converted / "config.json", config_only / "config.json")
    assert problems_of(check_shapes(tmp_path / "flat-hd8", reference_dir=config_only)) == problems


def test_config_and_weights_disagreeing_on_head_dim_fails_without_reference(converted, tmp_path):
    broken = edit_config(converted, tmp_path / "hd", lambda c: c.update(head_dim=32))
    problems = problems_of(check_shapes(broken))
    assert "midlayer.self_attn.q_proj.weight: shape [64, 128] but the config implies [128, 128]" in problems


def test_missing_d2t_fails(converted, tmp_path):
    broken = edit_weights(converted, tmp_path / "b", lambda t: {k: v for k, v in t.items() if k != "d2t"})
    assert problems_of(check_shapes(broken)) == [
        f"d2t: missing; with draft_vocab_size {TINY_DRAFT_VOCAB} < vocab_size {TINY['vocab_size']} "
        "vLLM would map draft id k to target id k"]


def test_float_d2t_fails(converted, tmp_path):
    broken = edit_weights(converted, tmp_path / "b", lambda t: t | {"d2t": t["d2t"].float()})
    assert problems_of(check_shapes(broken)) == ["d2t: dtype F32, expected I64; a float d2t corrupts target ids"]


def test_prefixed_keys_fail_naming_the_bare_name(converted, tmp_path):
    broken = edit_weights(converted, tmp_path / "b",
                          lambda t: {("model." + k if k.startswith("midlayer.") else k): v for k, v in t.items()})
    problems = problems_of(check_shapes(broken))
    assert len(problems) == 10
    assert ("model.midlayer.self_attn.q_proj.weight: prefixed key; the engines expect unprefixed names "
            "(midlayer.self_attn.q_proj.weight)") in problems


def test_stray_embed_tokens_fails(converted, tmp_path):
    embed = torch.zeros(TINY["vocab_size"], TINY["hidden_size"], dtype=torch.bfloat16)
    broken = edit_weights(converted, tmp_path / "b", lambda t: t | {"embed_tokens.weight": embed})
    [problem] = problems_of(check_shapes(broken))
    assert problem.startswith("embed_tokens.weight: stray verifier tensor")


def test_t2d_disagreeing_with_d2t_fails(converted, tmp_path):
    broken = edit_weights(converted, tmp_path / "b", lambda t: t | {"t2d": torch.roll(t["t2d"], 1)})
    [problem] = problems_of(check_shapes(broken))
    assert "t2d does not mark exactly the target ids that d2t maps to" in problem


# ----------------------------------------------------------------------------------------------
# Config checks (transformers side; vLLM's side is in the vllm-marked tests)


def test_config_check_passes_and_reports_each_broken_field(converted, target, tmp_path):
    assert check_config(converted, target, {"draft_vocab_size": TINY_DRAFT_VOCAB,
                                            "eagle_config.eagle_aux_hidden_state_layer_ids": TINY_LAYER_IDS},
                        None)["ok"]
    broken = edit_config(converted, tmp_path / "b", lambda c: (c.pop("norm_before_residual"),
                                                               c.update(architectures=["LlamaForCausalLM"])))
    problems = problems_of(check_config(broken, target, {"eagle_config.eagle_aux_hidden_state_layer_ids": [2, 3, 4]},
                                        None))
    assert problems == [
        "architectures is ['LlamaForCausalLM'], expected ['LlamaForCausalLMEagle3']",
        "norm_before_residual is not written; vLLM's default for a missing flag depends on the format",
        "eagle_config.eagle_aux_hidden_state_layer_ids is [1, 3, 5], expected [2, 3, 4]",
    ]
    other_target = make_verifier(tmp_path / "other-target", vocab_size=2048, num_hidden_layers=4)
    problems = problems_of(check_config(converted, other_target, None, None))
    assert problems == [f"vocab_size {TINY['vocab_size']} != the target's 2048",
                        "aux layer ids [1, 3, 5] fall outside the target's 0..4"]


def test_config_check_knows_each_engines_conventions(target, converted, tmp_path):
    plain = make_speculators_drafter(target, tmp_path / "plain")
    convert_for_sglang(plain, tmp_path / "sglang")
    assert check_config(tmp_path / "sglang", target, None, None, engine="sglang")["ok"]
    assert problems_of(check_config(tmp_path / "sglang", target, None, None, engine="vllm")) == [
        "top-level eagle_aux_hidden_state_layer_ids differs from eagle_config's; vLLM's Model Runner V2 reads "
        "only the top-level one"]
    assert problems_of(check_config(converted, target, None, None, engine="sglang")) == [
        "norm_before_residual is true; SGLang's llama_eagle3 has no such norm variant",
        "top-level eagle_aux_hidden_state_layer_ids in an SGLang folder: vLLM would read these SGLang-convention "
        "(id - 1) ids",
    ]


def test_vllm_view_disagreeing_with_the_file_is_a_problem(converted):
    config = json.loads((converted / "config.json").read_text())
    view = {"model_class": "Eagle3LlamaForCausalLM", "draft_vocab_size": TINY_DRAFT_VOCAB,
            "aux_layer_ids": {"model_runner_v1": TINY_LAYER_IDS, "model_runner_v2": None},
            "norm_flags": {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False,
                           "norm_output": False}}
    assert vllm_config_problems(config, view) == [
        "vLLM's model_runner_v2 would capture aux layers default, the file says [1, 3, 5]; "
        "write eagle_aux_hidden_state_layer_ids at the top level",
        "vLLM reads norm_before_residual=False, the file means True",
    ]


# ----------------------------------------------------------------------------------------------
# Parity comparison and the table


def run(per_position, drafts=10, outputs=((1, 2, 3),)):
    return {"drafter": "d", "num_drafts": drafts, "num_draft_tokens": drafts * len(per_position),
            "num_accepted_tokens": sum(per_position), "accepted_per_position": list(per_position),
            "output_token_ids": [list(o) for o in outputs]}


def test_compare_acceptance_uses_tolerance_per_position():
    assert compare_acceptance(run([5, 3, 1]), run([5, 3, 1]), 0.0)["ok"]
    assert compare_acceptance(run([5, 3, 1]), run([5, 2, 1]), 0.1)["ok"]
    result = compare_acceptance(run([5, 3, 1]), run([5, 1, 1]), 0.1)
    assert result["detail"]["problems"] == ["position 1: acceptance 0.3 vs 0.1 differs by 0.2000 > tolerance 0.1"]
    assert result["detail"]["a"]["accepted_per_position"] == [5, 3, 1] and result["detail"]["tolerance"] == 0.1
    assert not compare_acceptance(run([0, 0, 0], drafts=0), run([0, 0, 0], drafts=0), 0.1)["ok"]
    # Two engines need not decode the same greedy text: reported, not failed.
    different_text = compare_acceptance(run([5, 3, 1]), run([5, 3, 1], outputs=((1, 2, 4),)), 0.1)
    assert different_text["ok"] and different_text["detail"]["same_greedy_outputs"] is False


def test_replay_parity_finds_a_conversion_that_drafts_differently(target, tmp_path):
    from safetensors.torch import load_file, save_file

    from eagle_pipeline.drafter_checks.parity import replay_parity

    # A drafter whose lm_head is zero always proposes draft id 0, mapped by d2t to target id 32; on answers made of
    # that token every draft is accepted.
    speculators = make_speculators_drafter(target, tmp_path / "speculators", zero_lm_head=True, first_draft_target_id=32)
    flat = tmp_path / "flat"
    convert_for_vllm(speculators, flat)
    config = json.loads((flat / "config.json").read_text())
    hidden, slots = config["hidden_size"], len(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) + 1
    generator = torch.Generator().manual_seed(0)
    conversations = [(torch.cat([torch.randint(0, 100, (6,), generator=generator), torch.full((18,), 32)]),
                      torch.randn(24, slots, hidden, generator=generator), 6) for _ in range(3)]
    same = replay_parity(speculators, flat, target, conversations, 3, tolerance=0.0)
    assert same["ok"], same["detail"]["problems"]
    detail = same["detail"]
    assert detail["method"] == "replay" and detail["a"]["num_drafts"] == detail["b"]["num_drafts"] > 0
    assert detail["a"]["accepted_per_position"] == detail["b"]["accepted_per_position"] and detail["a"]["accepted_per_position"][0] > 0
    # A conversion that maps draft id 0 elsewhere drafts other tokens, which the target never accepts.
    tensors = load_file(str(flat / "model.safetensors"))
    tensors["d2t"][0] += 1
    save_file(tensors, str(flat / "model.safetensors"))
    broken = replay_parity(speculators, flat, target, conversations, 3, tolerance=0.05)
    assert not broken["ok"] and broken["detail"]["b"]["accepted_per_position"] == [0, 0, 0]
    assert broken["detail"]["problems"][0].startswith("position 0: acceptance")


def test_table_lists_every_check_with_its_result():
    result = {"ok": False, "checks": {
        "shapes": {"ok": False, "detail": {"problems": ["d2t: missing", "t2d: missing"]}},
        "config": {"ok": True, "detail": {"problems": []}},
        "vllm_load": {"ok": True, "detail": {"ok": True, "model_class": "Eagle3LlamaForCausalLM",
                                             "unloaded_parameters": []}},
        "vllm_logits": {"ok": True, "detail": {
            "model_class": "Eagle3DeepseekV2ForCausalLM", "tolerance": 1e-4, "problems": [],
            "context": {"relative_difference": 3e-7}, "step": {"relative_difference": 2e-6}}},
        "parity": {"ok": False, "skipped": True, "detail": "not run"},
    }}
    lines = format_table(result).splitlines()
    assert lines[2].split()[:2] == ["shapes", "FAIL"] and "d2t: missing (+1 more)" in lines[2]
    assert lines[3].split()[:2] == ["config", "PASS"]
    assert lines[4].split()[:2] == ["vllm_load", "PASS"]
    assert lines[5].split()[:2] == ["vllm_logits", "PASS"] and "differs by 2e-06 of the largest" in lines[5]
    assert lines[6].split()[:2] == ["parity", "SKIP"]


# ----------------------------------------------------------------------------------------------
# vLLM's own config path and load_weights


@pytest.mark.vllm
def test_vllm_loads_the_converted_drafter(converted, target, speculators_dir):
    result = verify_drafter(converted, target_dir=target, reference_dir=speculators_dir,
                            expected={"draft_vocab_size": TINY_DRAFT_VOCAB})
    checks = result["checks"]
    assert checks["shapes"]["ok"] and checks["config"]["ok"], (checks["shapes"], checks["config"])
    assert checks["vllm_load"]["ok"], checks["vllm_load"]
    vllm_view = checks["config"]["detail"]["vllm"]
    assert vllm_view["model_class"] == "Eagle3LlamaForCausalLM" and vllm_view["hf_config_class"] == "EAGLEConfig"
    assert vllm_view["aux_layer_ids"] == {"model_runner_v1": TINY_LAYER_IDS, "model_runner_v2": TINY_LAYER_IDS}
    assert checks["vllm_load"]["detail"]["unloaded_parameters"] == []
    assert checks["vllm_load"]["detail"]["has_own_lm_head"] is True
    assert checks["parity"]["skipped"] and result["ok"] is True


@pytest.mark.vllm
def test_vllm_refuses_prefixed_keys_and_v2_runner_misses_nested_ids(converted, target, tmp_path):
    broken = edit_weights(converted, tmp_path / "b",
                          lambda t: {("model." + k if k.startswith("midlayer.") else k): v for k, v in t.items()})
    broken_config = json.loads((broken / "config.json").read_text())
    del broken_config["eagle_aux_hidden_state_layer_ids"]
    (broken / "config.json").write_text(json.dumps(broken_config))

    vllm = check_vllm(broken, target)
    assert vllm["load"]["ok"] is False
    assert "There is no module or parameter named 'model'" in vllm["load"]["error"]
    # Only the nested ids are left: the V1 runner finds them, Model Runner V2 falls back to its defaults.
    assert vllm["config"]["aux_layer_ids"] == {"model_runner_v1": TINY_LAYER_IDS, "model_runner_v2": None}
    assert any("model_runner_v2" in p for p in vllm_config_problems(broken_config, vllm["config"]))


@pytest.mark.vllm
def test_vllm_silently_keeps_a_missing_d2t_and_the_load_check_catches_it(converted, target, tmp_path):
    broken = edit_weights(converted, tmp_path / "b", lambda t: {k: v for k, v in t.items() if k != "d2t"})
    load = check_vllm(broken, target)["load"]
    assert load["ok"] is False and load["unloaded_parameters"] == ["draft_id_to_target_id"]


# convert.parity: vllm, the opt-in way; the default (replay) is shown in the suite by the shared smoke run's stage 05.
@pytest.mark.heavy
@pytest.mark.vllm
@pytest.mark.slow
def test_acceptance_parity_between_speculators_and_converted_formats(tmp_path):
    """Embedded verifier, random drafter with a zeroed lm_head: it always proposes target token 32 ('0'),
    which the verifier repeats after a run of dots, so acceptance is high and depends on d2t surviving."""
    from eagle_pipeline.embedded import materialize

    target = materialize("smollm2-135m-instruct")
    speculators = make_speculators_drafter(target, tmp_path / "speculators", draft_vocab_size=1024,
                                           layer_ids=[2, 15, 27], norm_before_residual=True, zero_lm_head=True,
                                           first_draft_target_id=32)
    convert_for_vllm(speculators, tmp_path / "flat")
    prompts = ["................................", "0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0", "The capital of France is"]
    result = acceptance_parity(target, speculators, tmp_path / "flat", prompts, num_speculative_tokens=3,
                               max_tokens=24, tolerance=0.0)
    detail = result["detail"]
    assert result["ok"], detail["problems"]
    assert detail["a"]["accepted_per_position"] == detail["b"]["accepted_per_position"]
    assert detail["a"]["num_drafts"] == detail["b"]["num_drafts"] > 0
    assert detail["b"]["accepted_per_position"][0] > 0 and detail["same_greedy_outputs"]


def test_a_failed_vllm_job_keeps_its_whole_log_and_names_it(tmp_path):
    # A job that fails before any engine starts (a missing argument): the log is kept where the caller asked,
    # headed by the command, and the failure carries its tail and its path.
    from eagle_pipeline.drafter_checks.subprocess_json import run_json_subprocess

    log = tmp_path / "logs" / "vllm-load.log"
    with pytest.raises(RuntimeError) as failure:
        run_json_subprocess(["inspect", "--target", str(tmp_path)], log_path=log)
    text = log.read_text()
    assert text.startswith("$ ") and " inspect --target " in text.splitlines()[0]
    assert "the following arguments are required: --drafter" in text
    assert f"whole log: {log}" in str(failure.value) and "--drafter" in str(failure.value)


def test_a_job_past_its_timeout_is_killed_and_its_log_kept(tmp_path):
    import os
    import sys

    from eagle_pipeline.child_process import run_logged

    log, pids = tmp_path / "job.log", tmp_path / "pids"
    # The job starts a child that sleeps on, as vLLM's engine core would.
    program = ("import os, subprocess, sys, time; print('started', flush=True); "
               "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
               f"open({str(pids)!r}, 'w').write(f'{{os.getpid()}} {{child.pid}}'); time.sleep(600)")
    assert run_logged([sys.executable, "-c", program], log, dict(os.environ), timeout=5) is None
    assert log.read_text().startswith(f"$ {sys.executable} -c ")
    started = [int(pid) for pid in pids.read_text().split()]
    assert len(started) == 2 and [pid for pid in started if process_alive(pid)] == []


def test_killing_a_job_kills_everything_it_started(tmp_path):
    # As vLLM's engine core and workers do, the job's child and grandchild would run on after it is killed.
    import subprocess
    import sys
    import time

    from eagle_pipeline.process_tree import kill_pid_tree

    pids, job = tmp_path / "pids", tmp_path / "job.py"
    job.write_text(
        "import os, subprocess, sys, time\n"
        f"open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n')\n"
        "if int(sys.argv[1]) < 2:\n"
        "    subprocess.Popen([sys.executable, __file__, str(int(sys.argv[1]) + 1)])\n"
        "time.sleep(600)\n")
    process = subprocess.Popen([sys.executable, str(job), "0"])
    deadline = time.monotonic() + 60
    while not (pids.exists() and len(pids.read_text().split()) == 3) and time.monotonic() < deadline:
        time.sleep(0.05)
    started = [int(line) for line in pids.read_text().split()]
    assert len(started) == 3
    kill_pid_tree(process.pid, reap=process.wait)
    assert [pid for pid in started if process_alive(pid)] == []
