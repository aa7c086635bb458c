"""The one table of drafter tensor names (eagle_pipeline/drafter/layouts.py) and the two directions through it:
speculators -> flat (convert.py) and flat -> speculators (drafter/to_speculators.py, as fine-tuning and the replay
call it). Drafters are built by speculators itself against a tiny random Llama verifier (tests/test_convert.py).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_convert import edit_weights, make_speculators_drafter, make_verifier

from eagle_pipeline import released_drafter
from eagle_pipeline.convert import convert_for_sglang, convert_for_vllm
from eagle_pipeline.drafter.folder import describe, is_speculators_drafter, read_flat_drafter
from eagle_pipeline.drafter.layouts import (
    FLAT,
    SGLANG,
    SPECULATORS,
    SPECULATORS_TYPE_KEY,
    VERIFIER_ONLY_KEYS,
    flat_name,
    layer_index,
    layer_prefix,
    speculators_name,
    vllm_config_flags,
    weight_name,
)
from eagle_pipeline.predict.flat_drafter import write_speculators_checkpoint
from eagle_pipeline.verifier import target_embedding

# One tensor per row, as each layout spells it: speculators, flat (vLLM), SGLang (None: not in that layout).
NAMES = [
    ("layers.0.self_attn.q_proj.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.q_proj.weight"),
    ("layers.1.mlp.down_proj.weight", "layers.1.mlp.down_proj.weight", None),
    ("fc.weight", "fc.weight", "fc.weight"),
    ("lm_head.weight", "lm_head.weight", "lm_head.weight"),
    ("d2t", "d2t", "d2t"),
    ("input_norm.weight", "input_norm.weight", None),
    ("fc_norm.2.weight", "fc_norm.2.weight", None),
    ("embed_tokens.weight", None, None),
    ("verifier_norm.weight", None, None),
]


@pytest.mark.parametrize("speculators, flat, sglang", NAMES, ids=[n[0] for n in NAMES])
def test_the_table_spells_each_tensor_in_each_layout(speculators, flat, sglang):
    assert weight_name(speculators, source=SPECULATORS, target=FLAT) == flat
    assert weight_name(speculators, source=SPECULATORS, target=SGLANG) == sglang
    if flat is not None:
        assert weight_name(flat, source=FLAT, target=SPECULATORS) == speculators
        assert flat_name(speculators) == flat_name(flat) == flat
        assert speculators_name(flat) == speculators_name(speculators) == speculators
    else:
        assert speculators in VERIFIER_ONLY_KEYS


def test_layer_zero_in_a_flat_export_and_layer_numbers():
    # Some flat exports keep speculators' `layers.0.*`; both spellings are the same tensor.
    assert flat_name("layers.0.mlp.up_proj.weight") == "midlayer.mlp.up_proj.weight"
    assert speculators_name("layers.0.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    assert [layer_index(n) for n in ("midlayer.x", "layers.0.x", "layers.3.x", "fc.weight", "fc_norm.1.weight")] == [0, 0, 3, None, None]
    assert (layer_prefix(0, FLAT), layer_prefix(1, FLAT), layer_prefix(0, SPECULATORS), layer_prefix(1, SGLANG)) == (
        "midlayer.", "layers.1.", "layers.0.", None)
    assert flat_name("rotary.inv_freq") == speculators_name("rotary.inv_freq") == "rotary.inv_freq"  # for the checks to report


@pytest.fixture(scope="module")
def verifier(tmp_path_factory) -> Path:
    return make_verifier(tmp_path_factory.mktemp("verifier") / "tiny-llama")


DRAFTERS = {
    "plain": {},
    "norm-before-residual": {"norm_before_residual": True},
    "norm-before-fc-and-output": {"norm_before_fc": True, "norm_output": True},
    "fc-norm": {"fc_norm": True},
    "two-layers": {"num_layers": 2, "norm_before_residual": True},
    "full-vocabulary": {"draft_vocab_size": None},
}


def speculators_to_flat_to_speculators(verifier: Path, tmp_path: Path, caller: str, **drafter) -> tuple[Path, Path, Path]:
    """(the speculators checkpoint, its flat folder, that flat folder written back in speculators' layout)."""
    built = make_speculators_drafter(verifier, tmp_path / "built", **drafter)
    # speculators' trainer stores the target's embedding in the drafter's precision; so does the way back.
    embedding = target_embedding(verifier).to(torch.bfloat16)
    checkpoint = edit_weights(built, tmp_path / "speculators", lambda t: t | {"embed_tokens.weight": embedding})
    flat = tmp_path / "flat"
    convert_for_vllm(checkpoint, flat)
    back = tmp_path / "back"
    if caller == "train.init_from":
        folder = read_flat_drafter(flat, "train.init_from")
        ids = released_drafter.hf_layer_ids(folder, released_drafter.layer_id_convention(folder, None))
        released_drafter.write_speculators_folder(folder, back, verifier_dir=verifier, layer_ids=ids, ttt_steps=3)
    else:
        write_speculators_checkpoint(flat, verifier, back, speculative_tokens=3)
    return checkpoint, flat, back


@pytest.mark.parametrize("caller", ["train.init_from", "replay"])
@pytest.mark.parametrize("drafter", DRAFTERS, ids=list(DRAFTERS))
def test_speculators_to_flat_and_back_is_lossless(verifier, tmp_path, drafter, caller):
    checkpoint, flat, back = speculators_to_flat_to_speculators(verifier, tmp_path, caller, **DRAFTERS[drafter])

    original, written = load_file(checkpoint / "model.safetensors"), load_file(back / "model.safetensors")
    if "d2t" not in original:  # a full vocabulary has no map; the replay writes vLLM's identity for speculators
        written = {k: v for k, v in written.items() if k not in ("d2t", "t2d")}
        original = {k: v for k, v in original.items() if k not in ("d2t", "t2d")}
    assert set(written) == set(original)
    for name, tensor in original.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    config, written_config = (json.loads((d / "config.json").read_text()) for d in (checkpoint, back))
    for key in ("eagle_aux_hidden_state_layer_ids", "draft_vocab_size", "norm_before_residual", "norm_before_fc",
                "fc_norm", "norm_output"):
        assert written_config[key] == config[key], key
    # speculators leaves it out when it is the drafter's own width; the way back writes it out.
    assert written_config["target_hidden_size"] == (config["target_hidden_size"] or config["transformer_layer_config"]["hidden_size"])
    assert written_config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3

    again = tmp_path / "flat-again"
    convert_for_vllm(back, again)
    for file in ("config.json", "model.safetensors"):
        assert (again / file).read_bytes() == (flat / file).read_bytes(), file


def test_fine_tuning_and_the_replay_write_the_same_folder(verifier, tmp_path):
    """One writer: a flat folder both callers read the same way comes out byte for byte the same."""
    _, _, for_training = speculators_to_flat_to_speculators(verifier, tmp_path / "a", "train.init_from",
                                                            norm_before_residual=True)
    _, _, for_replay = speculators_to_flat_to_speculators(verifier, tmp_path / "b", "replay", norm_before_residual=True)
    for file in ("config.json", "model.safetensors"):
        assert (for_training / file).read_bytes() == (for_replay / file).read_bytes(), file


def test_the_speculative_token_count_is_the_callers(verifier, tmp_path):
    _, flat, _ = speculators_to_flat_to_speculators(verifier, tmp_path, "replay")
    write_speculators_checkpoint(flat, verifier, tmp_path / "five", speculative_tokens=5)
    config = json.loads((tmp_path / "five" / "config.json").read_text())
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5


def test_sglang_folder_takes_its_names_from_the_table(verifier, tmp_path):
    checkpoint = make_speculators_drafter(verifier, tmp_path / "plain")
    summary = convert_for_sglang(checkpoint, tmp_path / "sglang")
    expected = {weight_name(n, source=SPECULATORS, target=SGLANG) for n in load_file(checkpoint / "model.safetensors")}
    assert set(summary["tensors"]) == expected - {None}
    assert all(n.startswith("midlayer.") for n in summary["tensors"] if layer_index(n) is not None)


def test_one_reader_describes_a_folder_in_every_layout(verifier, tmp_path):
    """describe() gives the same drafter for its speculators checkpoint and the flat and SGLang folders made from
    it: the layout, the dimensions, the flags as the drafter was built, and the aux ids as each engine reads them."""
    checkpoint = make_speculators_drafter(verifier, tmp_path / "speculators", norm_before_fc=True)
    convert_for_vllm(checkpoint, tmp_path / "vllm")
    ids = json.loads((checkpoint / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"]
    sglang_ids = [k - 1 for k in ids]
    plain = make_speculators_drafter(verifier, tmp_path / "plain")
    convert_for_sglang(plain, tmp_path / "sglang")
    folders = {name: describe(tmp_path / name) for name in ("speculators", "vllm", "sglang", "plain")}
    assert {name: f.layout for name, f in folders.items()} == {"speculators": SPECULATORS, "vllm": FLAT,
                                                                "sglang": FLAT, "plain": SPECULATORS}
    dims = {name: dataclasses.replace(f.dims, format="-", norm_before_fc=False) for name, f in folders.items()}
    assert dims["speculators"] == dims["vllm"] == dims["sglang"] == dims["plain"]
    assert folders["speculators"].flags == folders["vllm"].flags and folders["vllm"].flags["norm_before_fc"]
    assert folders["vllm"].engine_layer_ids == {"v1": ids, "v2": ids, "sglang": ids}
    assert folders["sglang"].engine_layer_ids == {"v1": sglang_ids, "v2": None, "sglang": sglang_ids}
    assert folders["speculators"].engine_layer_ids == {"v1": ids, "v2": ids, "sglang": None}
    assert set(folders["vllm"].tensor_files) == set(convert_for_vllm(checkpoint, tmp_path / "again")["tensors"])
    assert describe(tmp_path / "nothing") is None and not is_speculators_drafter(tmp_path / "vllm")
    # vLLM's config path reads a speculators config without norm_before_residual as true, a flat one as false.
    assert vllm_config_flags({SPECULATORS_TYPE_KEY: "eagle3"})["norm_before_residual"]
    assert not vllm_config_flags({"architectures": ["LlamaForCausalLMEagle3"]})["norm_before_residual"]

