"""The MLA drafter folder (vLLM's `Eagle3DeepseekV2ForCausalLM`, the drafter of vLLM's Kimi-K2.5 recipe) as a
second layer shape of the one drafter folder home, eagle_pipeline/drafter/.

The released layout (`lightseekorg/kimi-k2.5-eagle3-mla`) comes from tests/released_drafter_standin.py in both
namings (`midlayer.`, `layers.0.`) and with q_a_proj / kv_a_proj_with_mqa stored fused or apart. Its
speculators checkpoints are written from tensors by drafter/to_speculators.py (no speculators model is built).
The one vLLM test builds vLLM's own MLA drafter class on the Kimi stand-in target (tests/test_kimi_vllm.py), loads
folders into it and runs stage 05's vllm_logits check against speculators' MLA layer; nothing else starts vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from released_drafter_standin import (
    KIMI_MLA_RELEASED,
    KIMI_MLA_STANDIN,
    MLA_NAMINGS,
    mla_standin_config,
    mla_standin_tensors,
    write_mla_standin,
)
from safetensors.torch import load_file

from eagle_pipeline.convert import convert_for_sglang, convert_for_vllm
from eagle_pipeline.drafter.folder import describe, read_flat_drafter, read_flat_tensors
from eagle_pipeline.drafter.layouts import FLAT, MLA, SPECULATORS
from eagle_pipeline.drafter.tensors import expected_tensor_specs
from eagle_pipeline.drafter.to_speculators import write_speculators_folder
from eagle_pipeline.drafter_checks.config_checks import flat_config_problems, transformers_parse
from eagle_pipeline.drafter_checks.shapes import check_shapes
from eagle_pipeline.errors import BadInput
from eagle_pipeline.released_drafter import hf_layer_ids, layer_id_convention, mapped_to_draft_vocab

FIELD = "train.init_from"
FUSED = "midlayer.self_attn.fused_qkv_a_proj.weight"


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """The Kimi stand-in target's config.json alone (Kimi-K2.5's nesting, a kimi_k2 text model): all that the
    folder code reads of a target."""
    folder = tmp_path_factory.mktemp("mla-target")
    text = {"model_type": "kimi_k2", "hidden_size": KIMI_MLA_STANDIN.hidden_size,
            "vocab_size": KIMI_MLA_STANDIN.vocab_size, "num_hidden_layers": 4, "kv_lora_rank": 512}
    (folder / "config.json").write_text(json.dumps({"architectures": ["KimiK25ForConditionalGeneration"],
                                                    "model_type": "kimi_k25", "text_config": text}))
    return folder


def released(tmp_path: Path, naming: str = "midlayer.", fused: bool = False, **config) -> Path:
    return write_mla_standin(tmp_path / f"released-{naming.strip('.')}-{'fused' if fused else 'apart'}", naming=naming,
                             fused=fused, config=mla_standin_config(**config) if config else None)


def to_speculators(source: Path, out: Path, target: Path) -> Path:
    """A flat folder in speculators' layout, as fine-tuning writes it (released_drafter.write_speculators_folder,
    with a seeded random embedding instead of the target's weights)."""
    drafter = read_flat_drafter(source, FIELD)
    embedding = torch.randn(KIMI_MLA_STANDIN.vocab_size, KIMI_MLA_STANDIN.hidden_size,
                            generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    write_speculators_folder(out, drafter.config, read_flat_tensors(drafter.path, drafter.dims), embedding=embedding,
                             verifier_dir=target, layer_ids=hf_layer_ids(drafter, "vllm"), flags=drafter.flags,
                             speculative_tokens=3)
    return out


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """The names whose tensors differ in name set, dtype, shape or any byte."""
    differ = sorted(a.keys() ^ b.keys())
    for name in sorted(a.keys() & b.keys()):
        x, y = a[name], b[name]
        if x.dtype != y.dtype or x.shape != y.shape or x.contiguous().view(torch.uint8).tolist() != \
                y.contiguous().view(torch.uint8).tolist():
            differ.append(name)
    return differ


def unfused_midlayer(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The stand-in's tensors as stage 05 writes them: `midlayer.`, q_a_proj and kv_a_proj_with_mqa apart."""
    q_rows = KIMI_MLA_STANDIN.q_lora_rank
    out = {}
    for name, tensor in tensors.items():
        name = name.replace("layers.0.", "midlayer.")
        if name == FUSED:
            out["midlayer.self_attn.q_a_proj.weight"] = tensor[:q_rows]
            out["midlayer.self_attn.kv_a_proj_with_mqa.weight"] = tensor[q_rows:]
        else:
            out[name] = tensor
    return out


# -- describe() and the shapes a config implies ------------------------------------------------------------------

def test_describe_recognises_the_released_mla_folder(tmp_path):
    folder = describe(released(tmp_path))
    assert folder.layout == FLAT and folder.layer_shape == MLA
    dims = folder.dims
    assert (dims.q_lora_rank, dims.kv_lora_rank, dims.qk_nope_head_dim, dims.qk_rope_head_dim, dims.v_head_dim) == \
        (32, 512, 16, 64, 16)
    assert dims.vocab_size == dims.draft_vocab_size == 49152 and dims.num_aux == 3 and not dims.norm_before_fc
    # vLLM's V1 runner (the CPU build's) reads eagle_config's ids as they stand; V2 reads the top level only, which
    # the release lacks (docs/layer_ids.md); stage 05 writes both.
    assert folder.engine_layer_ids["v1"] == [1, 2, 3] and folder.engine_layer_ids["v2"] is None


def test_the_released_kimi_shapes_follow_from_its_config():
    specs = expected_tensor_specs(mla_standin_config(KIMI_MLA_RELEASED))
    shapes = {name: spec.shape for name, spec in specs.items()}
    assert shapes["midlayer.self_attn.q_a_proj.weight"] == (1536, 2 * 7168)
    assert shapes["midlayer.self_attn.kv_a_proj_with_mqa.weight"] == (576, 2 * 7168)
    assert shapes["midlayer.self_attn.q_b_proj.weight"] == (64 * 192, 1536)
    assert shapes["midlayer.self_attn.kv_b_proj.weight"] == (64 * 256, 512)
    assert shapes["midlayer.self_attn.o_proj.weight"] == (7168, 64 * 128)
    assert shapes["fc.weight"] == (7168, 3 * 7168) and shapes["lm_head.weight"] == (163840, 7168)
    assert "d2t" not in shapes and not any(".k_proj." in name for name in shapes)


def test_without_q_lora_rank_the_layer_has_one_q_proj():
    config = mla_standin_config() | {"q_lora_rank": None}
    shapes = {name: spec.shape for name, spec in expected_tensor_specs(config).items()}
    assert shapes["midlayer.self_attn.q_proj.weight"] == (4 * 80, 128)
    assert not any("q_a_" in name or "q_b_" in name for name in shapes)


# -- reading a released folder, tensor by tensor -----------------------------------------------------------------

@pytest.mark.parametrize("naming", MLA_NAMINGS)
@pytest.mark.parametrize("fused", [False, True], ids=["apart", "fused"])
def test_every_naming_and_fusion_reads_as_the_unfused_midlayer_folder(tmp_path, naming, fused):
    source = released(tmp_path, naming, fused)
    reference = unfused_midlayer(mla_standin_tensors())  # the same seed: the same weights in every variant
    drafter = read_flat_drafter(source, FIELD)
    assert drafter.layer_shape == MLA
    assert same_bytes(read_flat_tensors(drafter.path, drafter.dims), reference) == []
    # The replay's reader (vLLM's reading of a folder) gives the same tensors.
    assert same_bytes(read_flat_tensors(source), reference) == []
    if naming == "midlayer.":  # stage 05's shapes check takes the names the flat folders it writes have
        assert check_shapes(source)["ok"], check_shapes(source)["detail"]["problems"]


def _refused(tmp_path, tensors) -> str:
    source = write_mla_standin(tmp_path / "broken", tensors=tensors)
    with pytest.raises(BadInput) as refusal:
        read_flat_drafter(source, FIELD)
    assert str(refusal.value).startswith(f"{FIELD}: {source}/model.safetensors: "), refusal.value
    return str(refusal.value)


@pytest.mark.parametrize("naming", MLA_NAMINGS)
def test_a_missing_tensor_is_refused_by_name(tmp_path, naming):
    tensors = mla_standin_tensors(naming=naming)
    del tensors[naming + "self_attn.kv_a_layernorm.weight"]
    assert "midlayer.self_attn.kv_a_layernorm.weight: missing (config implies [512])" in _refused(tmp_path, tensors)


def test_a_wrong_shape_is_refused_by_name(tmp_path):
    tensors = mla_standin_tensors()
    # A latent of 512 without the 64 rope rows: the mistake of an exporter that drops the MQA rope key.
    name = "midlayer.self_attn.kv_a_proj_with_mqa.weight"
    tensors[name] = tensors[name][:512]
    assert ("midlayer.self_attn.kv_a_proj_with_mqa.weight: shape [512, 128] but the config implies [576, 128]"
            in _refused(tmp_path, tensors))


def test_an_unknown_tensor_is_refused_by_name(tmp_path):
    tensors = mla_standin_tensors() | {"midlayer.self_attn.k_proj.weight": torch.zeros(4, 4, dtype=torch.bfloat16)}
    assert "midlayer.self_attn.k_proj.weight: unexpected tensor" in _refused(tmp_path, tensors)


def test_a_fused_projection_with_other_rows_is_refused_by_name(tmp_path):
    tensors = mla_standin_tensors(fused=True)
    tensors[FUSED] = tensors[FUSED][:-1]
    assert f"{FUSED}: shape [607, 128] but the config implies [608, *]" in _refused(tmp_path, tensors)


def test_a_projection_stored_fused_and_apart_is_refused(tmp_path):
    tensors = mla_standin_tensors(fused=True)
    tensors["midlayer.self_attn.q_a_proj.weight"] = tensors[FUSED][:32].clone()
    assert f"{FUSED}: holds midlayer.self_attn.q_a_proj.weight a second time" in _refused(tmp_path, tensors)


def test_the_architecture_is_named_when_neither_shape_matches(tmp_path):
    config = mla_standin_config() | {"architectures": ["DeepseekV3ForCausalLM"]}
    source = write_mla_standin(tmp_path / "other", config=config)
    with pytest.raises(BadInput, match=r"expected \['LlamaForCausalLMEagle3'\] or \['Eagle3DeepseekV2ForCausalLM'\]"):
        read_flat_drafter(source, FIELD)


# -- aux layer ids as vLLM reads them ----------------------------------------------------------------------------

def test_its_layer_ids_are_read_as_vllm_reads_them(tmp_path):
    drafter = read_flat_drafter(released(tmp_path), FIELD)
    # vLLM is the one engine of Eagle3DeepseekV2ForCausalLM: no convention to name, the ids are HF indices as written.
    assert layer_id_convention(drafter, None) == "vllm"
    assert hf_layer_ids(drafter, layer_id_convention(drafter, None)) == [1, 2, 3]
    # A run that knows the ids were written in SGLang's numbering still says so.
    assert hf_layer_ids(drafter, layer_id_convention(drafter, "sglang")) == [2, 3, 4]


# -- flat -> speculators -> flat ---------------------------------------------------------------------------------

@pytest.mark.parametrize("naming,fused", [("midlayer.", False), ("layers.0.", True)],
                         ids=["midlayer-apart", "layers0-fused"])
def test_flat_to_speculators_to_flat_keeps_every_tensor_byte_for_byte(tmp_path, target, naming, fused):
    source = released(tmp_path, naming, fused)
    checkpoint = to_speculators(source, tmp_path / "speculators", target)

    # The speculators checkpoint: the contract's names and a DeepseekV3 layer config with the target's MLA dims.
    assert describe(checkpoint).layout == SPECULATORS and describe(checkpoint).layer_shape == MLA
    config = json.loads((checkpoint / "config.json").read_text())
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "deepseek_v3" and layer["first_k_dense_replace"] == layer["num_hidden_layers"] == 1
    assert (layer["q_lora_rank"], layer["kv_lora_rank"], layer["qk_nope_head_dim"], layer["qk_rope_head_dim"],
            layer["v_head_dim"]) == (32, 512, 16, 64, 16)
    assert layer["rope_interleave"] is True and layer["rope_parameters"]["rope_type"] == "yarn"
    assert layer["rope_parameters"]["factor"] == 64.0 and layer["rope_parameters"]["rope_theta"] == 50000.0
    weights = load_file(str(checkpoint / "model.safetensors"))
    assert {"layers.0.self_attn.q_a_proj.weight", "layers.0.self_attn.kv_a_proj_with_mqa.weight"} <= weights.keys()
    assert not any(name.startswith("midlayer.") or "fused" in name for name in weights)

    summary = convert_for_vllm(checkpoint, tmp_path / "flat")
    assert summary["architecture"] == "Eagle3DeepseekV2ForCausalLM"
    flat = load_file(str(tmp_path / "flat" / "model.safetensors"))
    assert same_bytes(flat, unfused_midlayer(load_file(str(source / "model.safetensors")))) == []

    written = json.loads((tmp_path / "flat" / "config.json").read_text())
    assert written["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and written["model_type"] == "kimi_k2"
    assert written["eagle_aux_hidden_state_layer_ids"] == written["eagle_config"]["eagle_aux_hidden_state_layer_ids"] \
        == [1, 2, 3]
    assert written["vocab_size"] == written["draft_vocab_size"] == 49152 and "d2t" not in flat
    assert written["rope_scaling"]["rope_type"] == "yarn" and written["rope_scaling"]["factor"] == 64.0
    assert describe(tmp_path / "flat").dims == describe(source).dims

    # Once more: the written folder is stable, config and tensors.
    convert_for_vllm(to_speculators(tmp_path / "flat", tmp_path / "speculators-2", target), tmp_path / "flat-2")
    for name in ("config.json", "model.safetensors"):
        assert (tmp_path / "flat" / name).read_bytes() == (tmp_path / "flat-2" / name).read_bytes(), name


def test_a_full_vocabulary_mapped_to_a_draft_vocabulary_keeps_those_rows(tmp_path, target):
    source = released(tmp_path)
    drafter = read_flat_drafter(source, FIELD)
    ids = torch.tensor([0, 5, 77, 49151])
    d2t = (ids - torch.arange(len(ids))).numpy()
    t2d = torch.zeros(49152, dtype=torch.bool)
    t2d[ids] = True
    config, tensors = mapped_to_draft_vocab(drafter.config, read_flat_tensors(drafter.path, drafter.dims), d2t, t2d.numpy())
    write_speculators_folder(tmp_path / "speculators", config, tensors, embedding=torch.zeros(49152, 64),
                             verifier_dir=target, layer_ids=[1, 2, 3], flags=drafter.flags, speculative_tokens=3)
    convert_for_vllm(tmp_path / "speculators", tmp_path / "flat")
    flat = load_file(str(tmp_path / "flat" / "model.safetensors"))
    full = load_file(str(source / "model.safetensors"))["lm_head.weight"]
    assert same_bytes({"lm_head.weight": flat["lm_head.weight"]}, {"lm_head.weight": full[ids]}) == []
    assert flat["d2t"].tolist() == d2t.tolist() and flat["t2d"].equal(t2d)
    assert json.loads((tmp_path / "flat" / "config.json").read_text())["draft_vocab_size"] == 4


def test_sglang_is_refused_for_an_mla_drafter(tmp_path, target):
    checkpoint = to_speculators(released(tmp_path), tmp_path / "speculators", target)
    with pytest.raises(BadInput, match="an MLA layer.*serve this drafter with vLLM"):
        convert_for_sglang(checkpoint, tmp_path / "sglang")
    assert not (tmp_path / "sglang").exists()


# -- stage 05's config check -------------------------------------------------------------------------------------

def test_the_config_check_takes_the_written_mla_folder_and_names_what_vllm_would_misread(tmp_path, target):
    convert_for_vllm(to_speculators(released(tmp_path), tmp_path / "speculators", target), tmp_path / "flat")
    config = json.loads((tmp_path / "flat" / "config.json").read_text())
    target_config = json.loads((target / "config.json").read_text())
    assert flat_config_problems(config, target_config) == []
    parsed, problems = transformers_parse(tmp_path / "flat", config)  # kimi_k2 is read as DeepseekV3Config
    assert parsed["class"] == "DeepseekV3Config" and problems == [], (parsed, problems)
    broken = config | {"architectures": ["LlamaForCausalLMEagle3"], "norm_before_fc": True}
    assert any("model_type is 'kimi_k2', expected 'llama'" in p for p in flat_config_problems(broken, target_config))
    assert any("norm_before_fc is true; vLLM's Eagle3DeepseekV2ForCausalLM has no input_norm" in p
               for p in flat_config_problems(config | {"norm_before_fc": True}, target_config))
    assert any(p.startswith("rope_interleave is false; vLLM's MLA layers rotate interleaved pairs")
               for p in flat_config_problems(config | {"rope_interleave": False}, target_config))
    assert flat_config_problems(config | {"rope_interleave": True}, target_config) == []


# -- vLLM's own loader -------------------------------------------------------------------------------------------

@pytest.mark.vllm
def test_vllms_loader_takes_the_written_folder_and_the_fused_release_and_computes_the_checkpoints_logits(tmp_path,
                                                                                                       monkeypatch):
    """vLLM's config path resolves both folders to Eagle3DeepseekV2ForCausalLM on the Kimi stand-in target and its
    load_weights fills every parameter: the folder stage 05 writes (`midlayer.`, projections apart) and the release
    in its other form (`layers.0.`, fused_qkv_a_proj). CPU_MLA is named for target and drafter (docs/engines.md,
    "The CPU MLA limit").

    The same job runs stage 05's vllm_logits check on the written folder: vLLM's class, outside an engine on
    CPU_MLA, gives the speculators checkpoint's logits on the same rows, for the context pass (a prefill) and a
    draft step (a decode from the latent cache). The checkpoint computed with RoPE over halves, or without YaRN's
    softmax mscale, is named."""
    import functools

    from test_kimi_vllm import ENGINE_ARGS, ENGINE_KEYS, make_kimi_k25

    from eagle_pipeline.drafter_checks import vllm_logits
    from eagle_pipeline.drafter_checks.config_checks import vllm_config_problems
    from eagle_pipeline.drafter_checks.vllm_load import check_vllm
    from eagle_pipeline.predict import speculators_drafter
    from eagle_pipeline.predict.speculators_drafter import load_drafter

    make_kimi_k25(tmp_path / "kimi")
    speculators = to_speculators(released(tmp_path), tmp_path / "speculators", tmp_path / "kimi")
    convert_for_vllm(speculators, tmp_path / "flat")
    generator = torch.Generator().manual_seed(1)
    rows = 30
    conversation = (torch.randint(0, KIMI_MLA_STANDIN.vocab_size, (rows,), generator=generator),
                    torch.randn(rows, 4, KIMI_MLA_STANDIN.hidden_size, generator=generator), 8)
    inputs, out = tmp_path / "inputs.safetensors", tmp_path / "vllm.safetensors"
    model = load_drafter(speculators)
    trained = vllm_logits.speculators_side(model, conversation, inputs)
    engine = {**ENGINE_ARGS, **ENGINE_KEYS, "trust_remote_code": True}
    for folder in (tmp_path / "flat", released(tmp_path, "layers.0.", fused=True)):
        written = folder.name == "flat"
        result = check_vllm(folder, tmp_path / "kimi", engine_kwargs=engine,
                            drafter_settings={"attention_backend": "CPU_MLA"}, log_dir=tmp_path,
                            logits_files=(inputs, out) if written else None)
        assert result["load"]["ok"] and result["load"]["model_class"] == "Eagle3DeepseekV2ForCausalLM", result
        config = json.loads((folder / "config.json").read_text())
        problems = vllm_config_problems(config, result["config"])
        if written:
            assert problems == [], problems
            side = result["logits"]
        else:  # the release has no top-level ids: vLLM's V2 runner (the GPU default) would capture its defaults
            assert len(problems) == 1 and "model_runner_v2 would capture aux layers default" in problems[0], problems
            assert "logits" not in result

    check = vllm_logits.compare(trained, side, out)
    assert check["ok"] and side["attention_backend"] == "CPU_MLA" and side["rows"] == rows - 1, check
    assert all(check["detail"][part]["relative_difference"] < vllm_logits.TOLERANCE / 10 for part in ("context",
                                                                                                      "step"))
    for reading in ({"rope_interleave": False}, {"softmax_mscale": False}):
        monkeypatch.setattr(speculators_drafter, "SpeculatorsDrafter",
                            functools.partial(speculators_drafter.SpeculatorsDrafter, attention=reading))
        planted = vllm_logits.compare(vllm_logits.speculators_side(model, conversation, tmp_path / "unused"), side,
                                      out)
        assert not planted["ok"] and planted["detail"]["context"]["relative_difference"] > 10 * vllm_logits.TOLERANCE
        assert "vLLM's Eagle3DeepseekV2ForCausalLM differs from the checkpoint" in planted["detail"]["problems"][0]


# -- a full-vocabulary release, kept whole or mapped -----------------------------------------------------------

def test_a_release_mapped_to_a_smaller_draft_vocabulary_still_has_the_releases_shapes():
    from eagle_pipeline.drafter.tensors import TensorSpec, compare_with_reference

    release = {"fc.weight": TensorSpec((64, 192), "BF16"), "lm_head.weight": TensorSpec((49152, 64), "BF16")}
    mapped = {"fc.weight": TensorSpec((64, 192), "BF16"), "lm_head.weight": TensorSpec((512, 64), "BF16"),
              "d2t": TensorSpec((512,), "I64"), "t2d": TensorSpec((49152,), "BOOL")}
    assert compare_with_reference(mapped, release) == []
    narrower = mapped | {"lm_head.weight": TensorSpec((512, 32), "BF16")}
    assert compare_with_reference(narrower, release) == [
        "lm_head.weight: shape [512, 32] but the reference has [49152, 64]"]
    # A release with a map of its own is compared tensor by tensor, as before.
    assert compare_with_reference(release, mapped) == [
        "d2t: in the reference [512] but missing here", "lm_head.weight: shape [49152, 64] but the reference has "
        "[512, 64]", "t2d: in the reference [49152] but missing here"]


def test_a_full_vocabulary_release_kept_whole_matches_stage_03s_full_vocabulary(tmp_path):
    """vocab.draft_vocab_size = the target's vocabulary (configs/kimi-k2.5-10k-finetune-mla.yaml): stage 03's map is
    the identity and the release has none; a smaller stage 03 vocabulary with a release kept whole is refused."""
    import numpy as np
    from safetensors.torch import save_file

    from eagle_pipeline.train.draft_config import check_same_vocab_map

    save_file({"fc.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    np.save(tmp_path / "d2t.npy", np.zeros(8, dtype=np.int64))
    np.save(tmp_path / "t2d.npy", np.ones(8, dtype=bool))
    check_same_vocab_map(tmp_path / "model.safetensors", tmp_path / "d2t.npy", tmp_path / "t2d.npy")
    np.save(tmp_path / "d2t.npy", np.array([0, 0, 1, 1], dtype=np.int64))
    np.save(tmp_path / "t2d.npy", np.array([1, 1, 0, 1, 0, 1, 0, 0], dtype=bool))
    with pytest.raises(BadInput, match="has no d2t/t2d \\(a full-vocabulary drafter\\) but this run uses a 4-token"):
        check_same_vocab_map(tmp_path / "model.safetensors", tmp_path / "d2t.npy", tmp_path / "t2d.npy")
