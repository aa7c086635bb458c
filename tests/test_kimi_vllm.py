"""vLLM's CPU build on a tiny DeepSeek-V3 (MLA + MoE) verifier wrapped as Kimi-K2.5 ships it.

What runs: stages 01 and 02 through the real stage scripts, with Kimi-K2.5's tokenizer and template traps
(tests/kimi_standin.py, checked without vLLM in test_kimi_standin.py): the tokenizer is remote code
(`tokenization_kimi.py`, a transformers Python-backend `TikTokenTokenizer` over `tiktoken.model`, loaded
through `auto_map` with `verifier.trust_remote_code`) and has no character offsets, and the chat template
switches thinking with `thinking`, not `enable_thinking`, and thinks unless it is false. Stage 01 with
`generation.reasoning: false` must end every prompt in `<think></think>` after the assistant header
(and record `{"thinking": False}`), with `reasoning: true` in `<think>`; stage 02 must train on stage 01's
prompt + completion ids as they are, loss on the completion only.

vLLM 0.32's CPU platform executes MLA with its reference CPU_MLA backend
(vllm/v1/attention/backends/mla/cpu_mla.py: SDPA prefill and the `mla_decode_kvcache` kernel), and stage
02's captured states equal HF transformers' for the same model. That kernel is compiled for one latent size
only, kv_lora_rank + qk_rope_head_dim = 512 + 64 = 576 (DeepSeek-V3's and Kimi-K2's own), so the tiny
verifier keeps those two dimensions and shrinks everything else; with another latent size the engine fails
at its first forward pass ("Head dimension 24 is not supported by MLA" for 16 + 8).

The user's fine-tune route then continues through the stage scripts on the same run: stage 03 adopts the
vocabulary of a released drafter stand-in in AQ-MedAI's flat layout (tests/released_drafter_standin.py:
SGLang-convention ids, no norm flags, no embed_tokens), stage 04 fine-tunes from it, and stage 05 converts
the result, compares every tensor with the released drafter and loads it into vLLM's Eagle3LlamaForCausalLM.

What does not run with CPU_MLA: EAGLE-3 speculative decoding on an MLA target, i.e. stage 05's parity check
and stage 06's eagle3 server (on a CPU with AMX tiles, AMX_MLA runs them: the last test). With CPU_MLA (named
in ENGINE_KEYS, so also on CPUs with AMX) the CPU platform forces the KV cache block size to 16 for MLA models
(CPU_MLA supports only 16) while the drafter's attention backend, CPU_ATTN, supports only multiples of 32, so
the engine stops while allocating its KV cache. The fine-tune route's stage 05 starts that engine for its parity
check and pins the failure: the test fails, with a message saying why, the day the pinned vLLM can do it.

The wrapper is Kimi-K2.5's layout: `KimiK25ForConditionalGeneration` with the DeepSeek-V3 text model under
`text_config` and its weights under `language_model.`, a vision tower and a preprocessor config. The
stand-in has no real vision tower; the pipeline is text-only, and `language_model_only` makes vLLM skip
the vision tower, its weights and the profiling run with a dummy image (with SmolLM2's tokenizer, before
the stand-in had Kimi's media tokens, that run failed: "Failed to apply prompt replacement for
mm_items['vision_chunk'][0]").
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SMOKE, ok, run_stage, write_smoke_config
from kimi_standin import SPECIAL_TOKENS, VOCAB, kimi_k25_config, write_preprocessor_config, write_tokenizer
from released_drafter_standin import (
    KIMI_MLA_STANDIN,
    KIMI_STANDIN,
    mla_standin_config,
    mla_standin_tensors,
    sglang_ids,
    write_mla_standin,
    write_released_standin,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LAYER_IDS = [1, 2, 3]
NUM_LAYERS = 4
HIDDEN = 64
# CPU_MLA named, not left to vLLM: on a CPU with AMX tiles vLLM 0.32 picks AMX_MLA instead, whose weight
# packing refuses the stand-in's small qk_nope_head_dim ("invalid weight input features 16") and which has
# another block size; naming it runs the same MLA kernel on every CPU (docs/engines.md, "The CPU MLA limit").
ENGINE_ARGS = {"language_model_only": True}
# vLLM's CPU MLA kernel, named: a CPU with AMX tiles would otherwise get AMX_MLA (docs/engines.md).
ENGINE_KEYS = {"attention_backend": "CPU_MLA", "enforce_eager": True}
ASSISTANT_HEADER = "<|im_assistant|>assistant<|im_middle|>"
# The released Kimi-K2.5 drafter's flags (SpecForge's, all off) and shape, as train settings.
KIMI_DRAFTER_TRAIN = {
    "norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False,
    "draft_shape": {"num_attention_heads": KIMI_STANDIN.num_attention_heads, "num_key_value_heads": KIMI_STANDIN.num_key_value_heads,
                    "head_dim": KIMI_STANDIN.head_dim, "intermediate_size": KIMI_STANDIN.intermediate_size,
                    "rope_theta": KIMI_STANDIN.rope_theta},
}


def make_kimi_k25(folder: Path, head_dim: int = 16):
    """A tiny random Kimi-K2.5 folder (config, weights, Kimi's tokenizer files); returns the HF text model it holds.

    `head_dim` is qk_nope_head_dim and v_head_dim: 16 keeps the model small; AMX_MLA needs Kimi's own 128."""
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    text = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=NUM_LAYERS, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, n_group=1, topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
        # vLLM's CPU MLA decode kernel exists for a 576-wide latent only (CPUMLABackend.get_supported_head_sizes).
        kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=head_dim, v_head_dim=head_dim,
        max_position_embeddings=2048, rope_theta=50000.0, tie_word_embeddings=False,
        bos_token_id=SPECIAL_TOKENS["[BOS]"], eos_token_id=SPECIAL_TOKENS["<|im_end|>"],
    )
    model = DeepseekV3ForCausalLM(text).eval()
    # save_pretrained writes the checkpoint layout (one tensor per expert, as DeepSeek-V3 and Kimi ship
    # it, which vLLM's loader expects), not transformers' fused in-memory experts.
    model.save_pretrained(folder)
    (folder / "generation_config.json").unlink()
    weights = {f"language_model.{name}": tensor for name, tensor in load_file(str(folder / "model.safetensors")).items()}
    weights["vision_tower.encoder.final_layernorm.weight"] = torch.full((32,), 7.0)
    weights["mm_projector.pre_norm.weight"] = torch.full((32,), 7.0)
    save_file(weights, str(folder / "model.safetensors"))
    text_config = {
        **text.to_dict(), "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"],
        # Kimi-K2's config names its router (sigmoid scores plus a correction bias, what transformers
        # computes); vLLM creates the router's e_score_correction_bias only for topk_method noaux_tc.
        "topk_method": "noaux_tc", "scoring_func": "sigmoid",
    }
    (folder / "config.json").write_text(json.dumps(kimi_k25_config(text_config)))
    write_preprocessor_config(folder)
    write_tokenizer(folder)
    return model


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    root = tmp_path_factory.mktemp("kimi_vllm")
    return root, make_kimi_k25(root / "kimi")


def kimi_config(root: Path, run_name: str, **overrides) -> Path:
    return write_smoke_config(
        root / f"{run_name}.yaml", data_root=str(root / "data"), run_name=run_name,
        # Kimi-K2.5's tokenizer is remote code (tokenization_kimi.py, named by auto_map).
        verifier={"path": str(root / "kimi"), "cpu_kvcache_gib": 1, "engine_args": ENGINE_ARGS, **ENGINE_KEYS, "trust_remote_code": True},
        **overrides,
    )


@pytest.fixture(scope="module")
def kimi_run(kimi) -> Path:
    """Stages 01 and 02 for real on the tiny Kimi-K2.5 verifier, reasoning off; returns the run folder."""
    root, _ = kimi
    config = kimi_config(root, "k", generation={"reasoning": False}, hidden_states={"layer_ids": LAYER_IDS, "batch_size": 3})
    ok(run_stage("01_generate_data.py", config))
    ok(run_stage("02_extract_hidden.py", config))
    return root / "data" / "k"


@pytest.fixture(scope="module")
def kimi_thinking_run(kimi) -> Path:
    """Stage 01 only, reasoning on, as small as it gets (one more engine start); returns the run folder."""
    root, _ = kimi
    ok(run_stage("01_generate_data.py", kimi_config(root, "k-think", data={"num_samples": 2}, generation={"reasoning": True, "max_tokens": 4})))
    return root / "data" / "k-think"


@pytest.fixture(scope="module")
def tokenizer(kimi):
    from transformers import AutoTokenizer

    root, _ = kimi
    return AutoTokenizer.from_pretrained(root / "kimi", trust_remote_code=True)


def test_vllm_loads_the_remote_code_tokenizer_not_a_converted_fast_one(kimi):
    # Without trust_remote_code, vLLM (through transformers) would build a fast tokenizer from tiktoken.model.
    from transformers import PythonBackend, TokenizersBackend
    from vllm.tokenizers import get_tokenizer

    root, _ = kimi
    tokenizer = get_tokenizer(str(root / "kimi"), trust_remote_code=True)
    assert isinstance(tokenizer, PythonBackend) and not isinstance(tokenizer, TokenizersBackend)
    assert "TikTokenTokenizer" in [cls.__name__ for cls in type(tokenizer).__mro__]


def stage_01(run: Path) -> tuple[dict, list[dict]]:
    from datasets import load_from_disk

    stage = run / "01_generate_data"
    return json.loads((stage / "manifest.json").read_text()), list(load_from_disk(str(stage / "conversations")))


def test_stage_01_switches_kimis_thinking_off_with_its_own_variable(kimi_run, tokenizer):
    manifest, rows = stage_01(kimi_run)
    assert manifest["status"] == "complete"
    assert manifest["inputs"]["chat_template_kwargs"] == {"thinking": False}
    ending = [*tokenizer.encode(ASSISTANT_HEADER), SPECIAL_TOKENS["<think>"], SPECIAL_TOKENS["</think>"]]
    for row in rows:
        prompt = row["prompt_token_ids"]
        assert prompt[-len(ending):] == ending, tokenizer.decode(prompt[-12:])
        # vLLM rendered and tokenized the prompt as transformers does with the remote-code tokenizer.
        text = tokenizer.apply_chat_template(row["messages"][:-1], tokenize=False, add_generation_prompt=True, thinking=False)
        assert prompt == tokenizer.encode(text, add_special_tokens=False)
        assert row["completion_token_ids"] and max(row["completion_token_ids"]) < VOCAB


def test_stage_01_lets_kimi_think_when_reasoning_is_on(kimi_thinking_run, tokenizer):
    manifest, rows = stage_01(kimi_thinking_run)
    assert manifest["inputs"]["chat_template_kwargs"] == {"thinking": True}
    ending = [*tokenizer.encode(ASSISTANT_HEADER), SPECIAL_TOKENS["<think>"]]
    assert len(rows) == 2
    for row in rows:
        assert row["prompt_token_ids"][-len(ending):] == ending, tokenizer.decode(row["prompt_token_ids"][-12:])


def test_stage_02_trains_on_exactly_the_ids_stage_01_recorded(kimi_run):
    from datasets import load_from_disk

    _, conversations = stage_01(kimi_run)
    recorded = {row["sample_id"]: row for row in conversations}
    rows = load_from_disk(str(kimi_run / "02_extract_hidden" / "data"))
    assert sorted(rows["sample_id"]) == sorted(recorded)
    for row in rows:
        prompt, completion = recorded[row["sample_id"]]["prompt_token_ids"], recorded[row["sample_id"]]["completion_token_ids"]
        # No re-rendering, no re-tokenization (the Python-backend tokenizer has no offsets to map a mask with).
        assert [int(t) for t in row["input_ids"]] == prompt + completion
        assert [int(m) for m in row["loss_mask"]] == [0] * len(prompt) + [1] * len(completion)


def hf_states(model, token_ids: torch.Tensor) -> torch.Tensor:
    """HF hidden_states[LAYER_IDS] and the final layer before its norm, [seq, 4, H], as stage 02 stores them."""
    captured = {}
    hook = model.model.norm.register_forward_pre_hook(lambda module, args: captured.update(pre_norm=args[0]))
    try:
        with torch.no_grad():
            out = model(token_ids[None], output_hidden_states=True)
    finally:
        hook.remove()
    return torch.stack([out.hidden_states[k][0] for k in LAYER_IDS] + [captured["pre_norm"][0]], dim=1)


def test_stage_02_captures_the_states_hf_computes_for_the_mla_verifier(kimi, kimi_run):
    from datasets import load_from_disk
    from safetensors.torch import load_file

    _, model = kimi
    stage = kimi_run / "02_extract_hidden"
    manifest = json.loads((stage / "manifest.json").read_text())
    assert manifest["status"] == "complete" and manifest["counts"]["layer_ids"] == LAYER_IDS
    rows = load_from_disk(str(stage / "data"))
    assert len(rows) == SMOKE["data"]["num_samples"]
    for index, row in enumerate(rows):
        sample = load_file(str(stage / "data" / "hidden_states" / f"hs_{index}.safetensors"))
        token_ids = row["input_ids"].long()
        assert torch.equal(sample["token_ids"], token_ids)
        states = sample["hidden_states"].float()
        assert states.shape == (len(token_ids), len(LAYER_IDS) + 1, HIDDEN)
        expected = hf_states(model, token_ids)
        # vLLM computes what HF does to float32 noise, and bf16 storage moves no value by more than 2**-8 of itself:
        # a layer off by one, a norm applied or not, a wrong MLA kernel, or the CPU kernel's rope of an MLA query
        # (1 to 2% here; patches/vllm_cpu_rope.py) is off by more.
        for slot, layer in enumerate([*LAYER_IDS, NUM_LAYERS]):
            error = float((states[:, slot] - expected[:, slot]).norm() / expected[:, slot].norm())
            assert error < 2**-8, f"hs_{index}, layer {layer}: relative error {error:.4f} against HF transformers"


def test_the_fine_tune_route_runs_on_kimi_through_stages_03_to_05(kimi, kimi_run, tmp_path):
    """01 -> 02 (above) -> 03 with the released drafter's vocabulary -> 04 fine-tuned from it -> 05 converted,
    shape-checked against it, loaded by vLLM and replayed against its checkpoint (parity, no engine); only
    `convert.parity: vllm` needs EAGLE-3 on the MLA target.

    That parity's engine cannot start on vLLM 0.32's CPU build with CPU_MLA, and this test pins why (stage 06's
    eagle3 server needs the same engine). vllm/platforms/cpu.py sets block_size = 16 for MLA models (the
    CPU_MLA decode kernel's only size, overriding any block_size given); the EAGLE-3 drafter is a Llama layer
    on CPU_ATTN, which takes multiples of 32 only (cpu_attn.py get_supported_kernel_block_sizes), and both
    share one KV cache group, so vllm/v1/worker/utils.py select_common_block_size raises once target and
    drafter are loaded; the engine rehearsal finds that with vLLM's own configuration code before the engine
    starts. When the parity assertions below fail, vLLM can run EAGLE-3 on an MLA target with
    CPU_MLA: run stages 03-06 on this verifier here and drop the README's GPU-only note. With AMX_MLA it runs
    (the last test).
    """
    from safetensors.torch import load_file

    root, _ = kimi
    assert tuple(LAYER_IDS) == KIMI_STANDIN.hf_layer_ids and HIDDEN == KIMI_STANDIN.hidden_size
    run_dir = tmp_path / "data" / "k"
    for stage in ("01_generate_data", "02_extract_hidden"):
        shutil.copytree(kimi_run / stage, run_dir / stage)
    released = write_released_standin(tmp_path / "Kimi-K2.5-eagle3", KIMI_STANDIN, seed=5)
    shape = KIMI_STANDIN
    config = write_smoke_config(
        tmp_path / "k.yaml", data_root=str(tmp_path / "data"), run_name="k",
        verifier={"path": str(root / "kimi"), "cpu_kvcache_gib": 1, "engine_args": ENGINE_ARGS, **ENGINE_KEYS, "trust_remote_code": True},
        generation={"reasoning": False}, hidden_states={"layer_ids": LAYER_IDS, "batch_size": 3},
        vocab={"draft_vocab_size": shape.draft_vocab_size, "from_drafter": str(released)},
        # As configs/kimi-k2.5-10k-finetune.yaml: SpecForge's flags (all off), its convention, its shape.
        train={"epochs": 1, "init_from": str(released), "init_from_convention": "sglang", **KIMI_DRAFTER_TRAIN},
        convert={"reference_dir": str(released), "parity_prompts": 1, "parity_max_tokens": 4},
    )
    ok(run_stage("03_build_vocab_map.py", config))
    source = load_file(str(released / "model.safetensors"))
    assert np.load(run_dir / "03_build_vocab_map" / "d2t.npy").tobytes() == source["d2t"].numpy().tobytes()

    ok(run_stage("04_train.py", config))
    manifest = json.loads((run_dir / "04_train" / "manifest.json").read_text())
    assert manifest["inputs"]["init_from_layer_ids"] == {"convention": "sglang", "written": sglang_ids(LAYER_IDS), "hf": LAYER_IDS}

    ok(run_stage("05_convert.py", config))
    verify = json.loads((run_dir / "05_convert" / "verify.json").read_text())
    checks = verify["checks"]
    assert checks["parity"]["ok"] and checks["parity"]["detail"]["method"] == "replay", checks["parity"]
    # Every tensor has the released drafter's shape, and vLLM's own model class takes every key.
    assert checks["shapes"]["ok"] and checks["shapes"]["detail"]["reference"]["source"] == "weights", checks["shapes"]
    assert checks["config"]["ok"] and checks["vllm_load"]["ok"], (checks["config"], checks["vllm_load"])
    flat = load_file(str(run_dir / "05_convert" / "vllm" / "model.safetensors"))
    assert {k: v.shape for k, v in flat.items()} == {k: v.shape for k, v in source.items()}
    # vLLM's parity serves EAGLE-3 on the MLA target, which vLLM's CPU build cannot start (the docstring above):
    # the engine rehearsal configures the parity engine with vLLM's own code and refuses it before it starts,
    # for the block size the two attention backends cannot share. The block size in the message is 16 on a CPU
    # without AMX tiles and 128 on one with them (measured, with CPU_MLA named and the drafter loaded); either
    # way CPU_MLA's kernel takes 16 only.
    result = run_stage("05_convert.py", config, "--force", "--set", "convert.parity=vllm")
    assert result.returncode == 2 and "engine 05 parity engine" in result.stdout, (
        "vLLM's CPU build now starts EAGLE-3 on an MLA target: extend this module to stages 03-06\n"
        + result.stdout[-2000:] + result.stderr[-2000:])
    assert re.search(r"error: engine rehearsal: stage 05 parity engine: .*No common block size for (16|128) "
                     r"\(CPU_MLA: \[16\]; CPU_ATTN: \[MultipleOf\(32\)\]\)", result.stderr), result.stderr[-3000:]
    assert not (run_dir / "05_convert" / "logs" / "parity-a.log").exists(), "no parity engine was started"


def test_the_recipes_mla_drafter_fine_tunes_through_stages_03_to_06_on_kimi_and_serves_as_predicted(kimi, kimi_run,
                                                                                                    tmp_path):
    """01 -> 02 (the shared run) -> 03 -> 04 fine-tuned from a stand-in of the Kimi recipe's
    MLA drafter (vLLM's Eagle3DeepseekV2ForCausalLM, its projections stored fused under `layers.0.`, as
    configs/kimi-k2.5-10k-finetune-mla.yaml does with the real one) -> 05 converted, loaded by vLLM, its
    logits computed by vLLM's own class held to the checkpoint's, replay parity -> 06 served with target and
    drafter both on CPU_MLA, whose KV blocks of 16 they share (the Llama drafter's CPU_ATTN cannot: the fine-tune
    route test above), and its served acceptance agrees with the replay's prediction on the served answers: the
    trained drafter (speculators' layer) and vLLM's class agree on the same inputs. A drafter vLLM computes
    otherwise (RoPE interleave, softmax scale) is named by the diagnosis (tests/test_mla_readings.py); training from scratch: tests/test_mla_drafter.py."""
    root, target = kimi
    run_dir = tmp_path / "data" / "m"
    for stage in ("01_generate_data", "02_extract_hidden"):
        shutil.copytree(kimi_run / stage, run_dir / stage)
    # The stand-in target's shape and rope (no YaRN), Kimi's latent; ids as vLLM reads them, the run's layers.
    shape = KIMI_MLA_STANDIN.but(intermediate_size=128, max_position_embeddings=2048, hf_layer_ids=tuple(LAYER_IDS))
    release_config = {k: v for k, v in mla_standin_config(shape).items() if k != "rope_scaling"}
    # speculators keeps a drafter's lm_head frozen (speculators/model.py) and fine-tuning keeps the release's: a
    # trained release's head is close to the target's, a random one would never be learnt away from.
    tensors = mla_standin_tensors(shape, seed=3, naming="layers.0.", fused=True)
    tensors["lm_head.weight"] = target.lm_head.weight.detach().to(torch.bfloat16).clone()
    released = write_mla_standin(tmp_path / "kimi-k2.5-eagle3-mla", shape, tensors=tensors, config=release_config)
    config = write_smoke_config(
        tmp_path / "m.yaml", data_root=str(tmp_path / "data"), run_name="m",
        verifier={"path": str(root / "kimi"), "cpu_kvcache_gib": 1, "engine_args": ENGINE_ARGS, **ENGINE_KEYS,
                  "trust_remote_code": True},
        generation={"reasoning": False}, hidden_states={"layer_ids": LAYER_IDS, "batch_size": 3},
        # The release's full vocabulary mapped to stage 03's 512 tokens (its lm_head rows for them): on six answers
        # a drafter learns them in 20 epochs over 512 rows, not over all of the vocabulary.
        vocab={"draft_vocab_size": 512},
        # Long enough on the six answers that the drafter is accepted: served and predicted agreeing is then not
        # two zeros agreeing (the random stand-in's greedy answers repeat, so it learns them whole).
        train={"epochs": 20, "draft_layer": "mla", "init_from": str(released), "norm_before_residual": False,
               "fc_norm": False, "norm_output": False},
        convert={"parity_prompts": 2, "reference_dir": str(released)},
        # One load level, one server each (no ngram, no schedule confirmed), few tokens: two engine starts and
        # the prediction's capture.
        serve={"ngram_baseline": False, "concurrency": 1, "num_speculative_tokens_per_batch_size": None,
               "confirm_schedule": False, "max_tokens": 16, "drafter_attention_backend": "CPU_MLA"},
    )
    for script in ("03_build_vocab_map.py", "04_train.py", "05_convert.py", "06_serve_test.py"):
        ok(run_stage(script, config))
    flat = json.loads((run_dir / "05_convert" / "vllm" / "config.json").read_text())
    assert flat["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and flat["kv_lora_rank"] == 512, flat
    assert (flat["draft_vocab_size"], flat["vocab_size"]) == (512, VOCAB), flat
    checks = json.loads((run_dir / "05_convert" / "verify.json").read_text())["checks"]
    assert all(check["ok"] for check in checks.values()), checks
    assert checks["vllm_logits"]["detail"]["attention_backend"] == "CPU_MLA", checks["vllm_logits"]
    # Every tensor has the release's shape (its fused projection compared as its two parts).
    assert checks["shapes"]["detail"]["reference"]["source"] == "weights", checks["shapes"]
    report = json.loads((run_dir / "06_serve_test" / "report.json").read_text())
    assert report["mean_acceptance_length"] > 1.1, report["per_position_acceptance"]
    diagnosis = report["diagnosis"]
    assert diagnosis["status"] == "agrees", diagnosis["line"]
    # The MLA readings were replayed beside the as-trained one (the rope here is not YaRN: no softmax reading).
    assert "rope_interleave_flipped" in diagnosis["candidates"] and not any(
        name.startswith("softmax_mscale") for name in diagnosis["candidates"]), sorted(diagnosis["candidates"])
    print(f"MLA drafter on CPU_MLA: served {diagnosis['served']}, predicted {diagnosis['predicted']}, "
          f"mean acceptance length {report.get('mean_acceptance_length')}")


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(),
                    reason="EAGLE-3 on an MLA target starts on vLLM's CPU build only with AMX_MLA, on a CPU with AMX tiles")
# All six stages again on a second stand-in, several engine starts more than the suite can afford: asked for.
@pytest.mark.skipif(os.environ.get("EAGLE_TEST_MLA_ON_AMX") != "1",
                    reason="asked for with EAGLE_TEST_MLA_ON_AMX=1 (docs/benchmarks/acceptance.md, \"An MLA target: the Kimi-K2.5 stand-in on AMX\")")
def test_eagle3_on_the_mla_target_serves_as_predicted_with_amx(tmp_path):
    """On a CPU with AMX tiles the whole pipeline runs on the MLA target, stages 05 (parity) and 06 included.

    vLLM picks AMX_MLA there (nothing named), whose KV blocks are multiples of 32 like the drafter's CPU_ATTN,
    so the engine that the fine-tune route's parity check cannot start with CPU_MLA starts. AMX_MLA packs its weights in bf16 and refuses a 16-wide
    qk_nope_head_dim, so this stand-in has Kimi's own head dimensions (128) and is served in bf16
    (docs/engines.md, "The CPU MLA limit"). The drafter is trained from scratch long enough to be accepted
    sometimes, so that served and predicted agreeing is not two zeros agreeing.
    """
    make_kimi_k25(tmp_path / "kimi", head_dim=128)
    config = write_smoke_config(
        tmp_path / "amx.yaml", data_root=str(tmp_path / "data"), run_name="amx",
        verifier={"path": str(tmp_path / "kimi"), "cpu_kvcache_gib": 1, "dtype": "bfloat16", "trust_remote_code": True,
                  "enforce_eager": True, "engine_args": {"language_model_only": True}},
        generation={"reasoning": False}, hidden_states={"layer_ids": LAYER_IDS, "batch_size": 3},
        vocab={"draft_vocab_size": 512},
        train={"epochs": 20, **KIMI_DRAFTER_TRAIN},
        convert={"parity": "vllm", "parity_prompts": 1, "parity_max_tokens": 4},
        serve={"ngram_baseline": False},
    )
    for script in ("01_generate_data.py", "02_extract_hidden.py", "03_build_vocab_map.py", "04_train.py", "05_convert.py",
                   "06_serve_test.py"):
        ok(run_stage(script, config))
    run_dir = tmp_path / "data" / "amx"
    checks = json.loads((run_dir / "05_convert" / "verify.json").read_text())["checks"]
    assert all(check["ok"] for check in checks.values()), checks
    report = json.loads((run_dir / "06_serve_test" / "report.json").read_text())
    assert report["mean_acceptance_length"] > 1.1, report["per_position_acceptance"]
    assert report["diagnosis"]["status"] == "agrees", report["diagnosis"]["line"]
