"""Conversion of speculators EAGLE-3 checkpoints into the flat vLLM / SGLang format.

Checkpoints are built by speculators itself (`Eagle3DraftModel.from_training_args` + `save_pretrained`,
what `speculators train --dry-run` does) with random weights against a tiny random Llama verifier.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle_pipeline.convert import convert_for_sglang, convert_for_vllm
from eagle_pipeline.errors import BadInput

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "num_hidden_layers": 6, "vocab_size": 1024}
TINY_LAYER_IDS = [1, 3, 5]
TINY_DRAFT_VOCAB = 256


def make_verifier(path: Path, **overrides) -> Path:
    """A random Llama verifier folder (config + weights, no tokenizer)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(TINY | overrides), max_position_embeddings=2048, tie_word_embeddings=True,
                         rms_norm_eps=1e-5, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def vocab_map(vocab_size: int, draft_vocab_size: int, first_id: int | None = None, seed: int = 0):
    """(d2t, t2d) for a random draft vocabulary; `first_id` forces the smallest kept target id."""
    generator = torch.Generator().manual_seed(seed)
    if first_id is None:
        ids = torch.randperm(vocab_size, generator=generator)[:draft_vocab_size]
    else:
        rest = first_id + 1 + torch.randperm(vocab_size - first_id - 1, generator=generator)[:draft_vocab_size - 1]
        ids = torch.cat([torch.tensor([first_id]), rest])
    ids = ids.sort().values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return ids - torch.arange(draft_vocab_size), t2d


def make_speculators_drafter(verifier_dir: Path, out_dir: Path, *, draft_vocab_size: int | None = TINY_DRAFT_VOCAB,
                             layer_ids=TINY_LAYER_IDS, norm_before_residual: bool = False, norm_before_fc: bool = False,
                             fc_norm: bool = False, norm_output: bool = False, num_layers: int = 1,
                             head_dim: int | None = None, zero_lm_head: bool = False,
                             first_draft_target_id: int | None = None) -> Path:
    """A randomly initialised speculators EAGLE-3 drafter saved as speculators saves it."""
    from speculators.models.eagle3 import Eagle3DraftModel
    from transformers import AutoConfig, LlamaConfig

    verifier = AutoConfig.from_pretrained(verifier_dir)
    layer = LlamaConfig(**{k: v for k, v in verifier.to_dict().items() if k != "architectures"})
    layer.num_hidden_layers = num_layers
    if head_dim is not None:
        layer.head_dim = head_dim
    vocab_size = verifier.vocab_size
    draft_vocab_size = draft_vocab_size or vocab_size
    d2t, t2d = (vocab_map(vocab_size, draft_vocab_size, first_draft_target_id)
                if draft_vocab_size != vocab_size else (None, None))
    torch.manual_seed(1)
    model = Eagle3DraftModel.from_training_args(
        verifier_config=layer, t2d=t2d, d2t=d2t, draft_vocab_size=draft_vocab_size,
        norm_before_residual=norm_before_residual, norm_before_fc=norm_before_fc, fc_norm=fc_norm,
        norm_output=norm_output, ttt_steps=3, verifier_name_or_path=str(verifier_dir),
        target_layer_ids=list(layer_ids), draft_attn_impl="sdpa")
    if zero_lm_head:
        # All-equal logits: the drafter always proposes draft id 0, i.e. target id `first_draft_target_id`.
        with torch.no_grad():
            model.lm_head.weight.zero_()
    model.to(torch.bfloat16).save_pretrained(out_dir)
    return out_dir


def edit_weights(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    save_file(edit(tensors), dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def edit_config(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    edit(config)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def tensor_dtypes(model_dir: Path) -> dict[str, torch.dtype]:
    with safe_open(model_dir / "model.safetensors", framework="pt") as f:
        return {name: f.get_tensor(name).dtype for name in f.keys()}


@pytest.fixture(scope="session")
def verifier(tmp_path_factory) -> Path:
    return make_verifier(tmp_path_factory.mktemp("verifier") / "tiny-llama")


@pytest.fixture(scope="session")
def checkpoint(verifier, tmp_path_factory) -> Path:
    """speculators' own defaults for an EAGLE-3 drafter built by `speculators train` (norm_before_residual on)."""
    return make_speculators_drafter(verifier, tmp_path_factory.mktemp("ckpt") / "speculators",
                                    norm_before_residual=True)


@pytest.fixture(scope="session")
def plain_checkpoint(verifier, tmp_path_factory) -> Path:
    """A drafter with every norm variant off: the one SGLang can serve."""
    return make_speculators_drafter(verifier, tmp_path_factory.mktemp("ckpt") / "plain")


EXPECTED_FLAT_KEYS = {
    "fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d",
    *(f"midlayer.{n}.weight" for n in (
        "hidden_norm", "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
        "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")),
}


def test_vllm_conversion_writes_flat_keys_dtypes_and_explicit_config(checkpoint, tmp_path):
    out = tmp_path / "vllm"
    summary = convert_for_vllm(checkpoint, out)

    dtypes = tensor_dtypes(out)
    assert set(dtypes) == EXPECTED_FLAT_KEYS
    assert dtypes["d2t"] == torch.int64 and dtypes["t2d"] == torch.bool
    assert {d for n, d in dtypes.items() if n not in ("d2t", "t2d")} == {torch.bfloat16}
    assert summary["dropped"] == ["embed_tokens.weight"]
    # Weights are moved, not altered.
    source = load_file(checkpoint / "model.safetensors")
    converted = load_file(out / "model.safetensors")
    assert torch.equal(converted["midlayer.self_attn.q_proj.weight"], source["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(converted["d2t"], source["d2t"]) and torch.equal(converted["t2d"], source["t2d"])

    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert {k: config[k] for k in TINY if k != "num_hidden_layers"} == {k: v for k, v in TINY.items()
                                                                         if k != "num_hidden_layers"}
    assert config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == TINY_DRAFT_VOCAB and config["vocab_size"] == TINY["vocab_size"]
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": TINY_LAYER_IDS, "use_aux_hidden_state": True}
    assert config["eagle_aux_hidden_state_layer_ids"] == TINY_LAYER_IDS  # read by vLLM's Model Runner V2
    assert config["num_aux_hidden_states"] == 3 and config["target_hidden_size"] == TINY["hidden_size"]
    assert {k: config[k] for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")} == {
        "norm_before_residual": True, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
    assert config["rope_theta"] == 10000.0 and config["rope_parameters"]["rope_theta"] == 10000.0
    assert config["rms_norm_eps"] == 1e-5 and config["max_position_embeddings"] == 2048
    assert config["tie_word_embeddings"] is False
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]  # no tokenizer files


def test_converted_config_parses_with_transformers_keeping_eagle_fields(checkpoint, tmp_path):
    from transformers import AutoConfig

    convert_for_vllm(checkpoint, tmp_path / "vllm")
    parsed = AutoConfig.from_pretrained(tmp_path / "vllm")
    assert type(parsed).__name__ == "LlamaConfig"
    assert parsed.draft_vocab_size == TINY_DRAFT_VOCAB and parsed.norm_before_residual is True
    assert parsed.eagle_config["eagle_aux_hidden_state_layer_ids"] == TINY_LAYER_IDS


def test_conversion_replaces_output_atomically_and_a_refused_one_keeps_it(checkpoint, tmp_path):
    out = tmp_path / "vllm"
    convert_for_vllm(checkpoint, out)
    convert_for_vllm(checkpoint, out)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    before = (out / "model.safetensors").read_bytes()
    with pytest.raises(BadInput):
        convert_for_vllm(checkpoint, out, layer_ids=[2, 3, 4])
    assert (out / "model.safetensors").read_bytes() == before


def test_verifier_only_tensors_are_dropped(checkpoint, tmp_path):
    def add_verifier_copies(t):
        return t | {"verifier_lm_head.weight": t["lm_head.weight"].clone(),
                    "verifier_norm.weight": t["norm.weight"].clone()}

    src = edit_weights(checkpoint, tmp_path / "with-verifier", add_verifier_copies)
    summary = convert_for_vllm(src, tmp_path / "vllm")
    assert summary["dropped"] == ["embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight"]
    assert set(tensor_dtypes(tmp_path / "vllm")) == EXPECTED_FLAT_KEYS


def test_norm_before_fc_weights_travel_to_vllm(verifier, tmp_path):
    ckpt = make_speculators_drafter(verifier, tmp_path / "nbf", norm_before_fc=True, norm_output=True)
    convert_for_vllm(ckpt, tmp_path / "vllm")
    config = json.loads((tmp_path / "vllm" / "config.json").read_text())
    assert config["norm_before_fc"] is True and config["norm_output"] is True
    assert "input_norm.weight" in tensor_dtypes(tmp_path / "vllm")


def test_full_vocabulary_drafter_has_no_vocab_map(verifier, tmp_path):
    ckpt = make_speculators_drafter(verifier, tmp_path / "full", draft_vocab_size=None)
    convert_for_vllm(ckpt, tmp_path / "vllm")
    names = set(tensor_dtypes(tmp_path / "vllm"))
    assert "d2t" not in names and "t2d" not in names and "lm_head.weight" in names
    assert json.loads((tmp_path / "vllm" / "config.json").read_text())["draft_vocab_size"] == TINY["vocab_size"]


def test_two_layer_drafter_keeps_later_layers_for_vllm_and_is_refused_for_sglang(verifier, tmp_path):
    ckpt = make_speculators_drafter(verifier, tmp_path / "two", num_layers=2)
    convert_for_vllm(ckpt, tmp_path / "vllm")
    names = set(tensor_dtypes(tmp_path / "vllm"))
    assert "midlayer.self_attn.q_proj.weight" in names and "layers.1.self_attn.q_proj.weight" in names
    assert not any(n.startswith("layers.0.") for n in names)
    with pytest.raises(BadInput, match="num_hidden_layers is 2"):
        convert_for_sglang(ckpt, tmp_path / "sglang")


def test_sglang_conversion_writes_ids_minus_one_in_eagle_config_only(plain_checkpoint, tmp_path):
    vllm_summary = convert_for_vllm(plain_checkpoint, tmp_path / "vllm")
    summary = convert_for_sglang(plain_checkpoint, tmp_path / "sglang")
    config = json.loads((tmp_path / "sglang" / "config.json").read_text())
    # SGLang captures the entry of layer id+1; vLLM id k is the entry of layer k.
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 4]
    assert "eagle_aux_hidden_state_layer_ids" not in config
    assert summary["layer_ids"] == TINY_LAYER_IDS and summary["written_layer_ids"] == [0, 2, 4]
    assert summary["tensors"] == vllm_summary["tensors"]
    assert (tmp_path / "sglang" / "model.safetensors").read_bytes() == (tmp_path / "vllm" / "model.safetensors").read_bytes()


@pytest.mark.parametrize("flag", ["norm_before_residual", "norm_before_fc", "fc_norm", "norm_output"])
def test_sglang_refuses_norm_variants_naming_the_flag(plain_checkpoint, tmp_path, flag):
    ckpt = edit_config(plain_checkpoint, tmp_path / flag, lambda c: c.update({flag: True}))
    with pytest.raises(BadInput) as refusal:
        convert_for_sglang(ckpt, tmp_path / "sglang")
    assert str(refusal.value).startswith(f"{flag} is true")
    assert "\n" not in str(refusal.value)
    assert not (tmp_path / "sglang").exists()


def test_sglang_refuses_ids_it_cannot_capture(verifier, tmp_path):
    final = make_speculators_drafter(verifier, tmp_path / "final", layer_ids=[1, 3, 6])
    with pytest.raises(BadInput, match="aux layer id 6"):
        convert_for_sglang(final, tmp_path / "sglang")  # the verifier folder says 6 layers
    embeddings = edit_config(final, tmp_path / "embeddings",
                             lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 3, 5]))
    with pytest.raises(BadInput, match="aux layer id 0"):
        convert_for_sglang(embeddings, tmp_path / "sglang")
    convert_for_vllm(final, tmp_path / "vllm")  # vLLM captures the final layer's output as id 6


def test_refuses_checkpoints_that_would_serve_wrong(checkpoint, tmp_path):
    cases = {
        "float-d2t": (edit_weights(checkpoint, tmp_path / "f", lambda t: t | {"d2t": t["d2t"].float()}), "d2t"),
        "no-d2t": (edit_weights(checkpoint, tmp_path / "n", lambda t: {k: v for k, v in t.items() if k != "d2t"}),
                   "d2t"),
        "bad-t2d": (edit_weights(checkpoint, tmp_path / "t", lambda t: t | {"t2d": torch.roll(t["t2d"], 1)}), "t2d"),
        "stray": (edit_weights(checkpoint, tmp_path / "s", lambda t: t | {"model.fc.weight": t["fc.weight"].clone()}),
                  "model.fc.weight"),
        "no-residual-flag": (edit_config(checkpoint, tmp_path / "r", lambda c: c.pop("norm_before_residual")),
                             "norm_before_residual"),
        "qwen3": (edit_config(checkpoint, tmp_path / "q",
                              lambda c: c["transformer_layer_config"].update(model_type="qwen3")), "model_type"),
        "not-eagle3": (edit_config(checkpoint, tmp_path / "e", lambda c: c.update(speculators_model_type="dflash")),
                       "speculators_model_type"),
    }
    for name, (ckpt, field) in cases.items():
        with pytest.raises(BadInput) as refusal:
            convert_for_vllm(ckpt, tmp_path / f"out-{name}")
        assert field in str(refusal.value), (name, str(refusal.value))
    with pytest.raises(BadInput, match="target_vocab_size 2048"):
        convert_for_vllm(checkpoint, tmp_path / "out", target_vocab_size=2048)
    with pytest.raises(BadInput, match="layer_ids"):
        convert_for_vllm(checkpoint, tmp_path / "out", layer_ids=[2, 3, 4])
    assert convert_for_vllm(checkpoint, tmp_path / "out", layer_ids=TINY_LAYER_IDS,
                            target_vocab_size=TINY["vocab_size"])["layer_ids"] == TINY_LAYER_IDS
