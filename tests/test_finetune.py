"""Fine-tuning from a released drafter in two config values: `vocab.from_drafter` (stage 03 adopts its
d2t/t2d) and `train.init_from` (stage 04 starts from its weights), with the layer-id convention explicit.

The heavy tests reuse the suite's small run (tests/conftest.py), copied so that it stays untouched: stages
01-02 (and 03) of it feed a released-drafter stand-in (tests/released_drafter_standin.py) and the pipeline's
own stage 05 `vllm/` folder.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ok, run_stage, write_smoke_config
from released_drafter_standin import KIMI_STANDIN, SMOLLM2, sglang_ids, standin_config, standin_tensors, write_released_standin
from test_bad_input import snapshot

from eagle_pipeline import released_drafter
from eagle_pipeline.drafter.folder import read_flat_drafter
from eagle_pipeline.embedded import resolve_verifier_path
from eagle_pipeline.errors import BadInput
from eagle_pipeline.verifier import target_embedding

# SpecForge trains with every norm variant off; the run must train the drafter the way it was built.
SPECFORGE_FLAGS = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}


def copy_run(run_dir: Path, dest_root: Path, stages: tuple[str, ...]) -> Path:
    """The given stages of a finished run, copied under dest_root/data/t."""
    dest = dest_root / "data" / "t"
    for stage in stages:
        shutil.copytree(run_dir / stage, dest / stage)
    return dest


def read_metrics(stage_dir: Path) -> list[dict]:
    with open(stage_dir / "metrics.csv") as f:
        return list(csv.DictReader(f))


def read_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


# -- in process: reading, checking and converting a flat drafter -------------------------------------------------

@pytest.mark.parametrize("shape", [SMOLLM2, KIMI_STANDIN], ids=["smollm2", "kimi-standin"])
def test_released_layout_converts_to_speculators_with_hf_layer_ids(tmp_path, shape):
    folder = write_released_standin(tmp_path / "released", shape)
    drafter = read_flat_drafter(folder, "train.init_from")
    released_drafter.check_against_target(drafter, hidden_size=shape.hidden_size, vocab_size=shape.vocab_size)
    with pytest.raises(BadInput, match=r"train.init_from_convention: not set, .*only in eagle_config"):
        released_drafter.layer_id_convention(drafter, None)
    convention = released_drafter.layer_id_convention(drafter, "sglang")
    ids = released_drafter.hf_layer_ids(drafter, convention)
    assert ids == list(shape.hf_layer_ids) and drafter.written_layer_ids == sglang_ids(shape.hf_layer_ids)

    out = tmp_path / "speculators"
    released_drafter.write_speculators_folder(drafter, out, verifier_dir=resolve_verifier_path("embedded:smollm2-135m-instruct"),
                                              layer_ids=ids, ttt_steps=3)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == ids
    assert all(config[flag] is False for flag in SPECFORGE_FLAGS)
    assert config["dtype"] == "bfloat16"  # loaded (and trained) in the released precision, as a checkpoint would be
    layer = config["transformer_layer_config"]
    assert (layer["hidden_size"], layer["head_dim"], layer["rope_parameters"]["rope_theta"]) == (
        shape.hidden_size, shape.head_dim, shape.rope_theta)
    source, written = standin_tensors(shape), read_tensors(out / "model.safetensors")
    assert set(written) == {k.replace("midlayer.", "layers.0.") for k in source} | {"embed_tokens.weight"}
    # The target's embedding, written out: speculators would load a missing one as zeros and train from them.
    target = target_embedding(resolve_verifier_path("embedded:smollm2-135m-instruct"))
    assert written["embed_tokens.weight"].dtype == torch.bfloat16
    assert torch.equal(written["embed_tokens.weight"], target.to(torch.bfloat16))
    assert torch.equal(written["layers.0.self_attn.q_proj.weight"], source["midlayer.self_attn.q_proj.weight"])
    assert torch.equal(written["d2t"], source["d2t"])


def test_layers_0_keys_and_a_top_level_id_list_are_read_too(tmp_path):
    tensors = {k.replace("midlayer.", "layers.0."): v for k, v in standin_tensors(SMOLLM2).items()}
    tensors["embed_tokens.weight"] = torch.zeros(SMOLLM2.vocab_size, SMOLLM2.hidden_size, dtype=torch.bfloat16)
    config = standin_config(SMOLLM2) | {"eagle_aux_hidden_state_layer_ids": list(SMOLLM2.hf_layer_ids)}
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = list(SMOLLM2.hf_layer_ids)
    drafter = read_flat_drafter(write_released_standin(tmp_path / "d", tensors=tensors, config=config), "f")
    # Only vLLM reads a top-level id list, so such a folder is in the vllm convention.
    assert released_drafter.layer_id_convention(drafter, None) == "vllm"
    with pytest.raises(BadInput, match=r"train.init_from_convention: sglang, but .* top-level"):
        released_drafter.layer_id_convention(drafter, "sglang")


# -- the small run, fine-tuned from a released stand-in ----------------------------------------------------------

def test_fine_tune_from_a_released_drafter(small_run, tmp_path):
    from eagle_pipeline import convert
    from eagle_pipeline.drafter_checks.shapes import check_shapes

    _, _, run_dir = small_run
    dest = copy_run(run_dir, tmp_path, ("01_generate_data", "02_extract_hidden"))
    released = write_released_standin(tmp_path / "released", SMOLLM2, seed=3)
    config = write_smoke_config(
        tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="t",
        vocab={"draft_vocab_size": SMOLLM2.draft_vocab_size, "from_drafter": str(released)},
        train={"epochs": 1, "init_from": str(released), "init_from_convention": "sglang", **SPECFORGE_FLAGS},
    )

    # Stage 03 adopts the drafter's vocabulary byte for byte (not the one it would count).
    ok(run_stage("03_build_vocab_map.py", config))
    source = read_tensors(released / "model.safetensors")
    vocab_dir = dest / "03_build_vocab_map"
    d2t, t2d = np.load(vocab_dir / "d2t.npy"), np.load(vocab_dir / "t2d.npy")
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_
    assert d2t.tobytes() == source["d2t"].numpy().tobytes() and t2d.tobytes() == source["t2d"].numpy().tobytes()
    assert not np.array_equal(d2t, np.load(run_dir / "03_build_vocab_map" / "d2t.npy"))
    vocab_manifest = json.loads((vocab_dir / "manifest.json").read_text())
    assert vocab_manifest["inputs"]["from_drafter"]["file"] == str(released / "model.safetensors")
    assert 0 <= vocab_manifest["counts"]["coverage"] <= 1 and (vocab_dir / "coverage.png").is_file()

    # Stage 04 fine-tunes from it: the convention and the converted ids are recorded.
    ok(run_stage("04_train.py", config, timeout=1800))
    train_dir = dest / "04_train"
    manifest = json.loads((train_dir / "manifest.json").read_text())
    assert manifest["inputs"]["init_from_layer_ids"] == {"convention": "sglang", "written": sglang_ids(SMOLLM2.hf_layer_ids),
                                                         "hf": list(SMOLLM2.hf_layer_ids)}
    checkpoint = train_dir / manifest["counts"]["last_checkpoint"]
    trained = read_tensors(checkpoint / "model.safetensors")
    # Started from the released weights: after one step they still point the same way (a fresh start would
    # be uncorrelated with them: cosine ~0).
    for flat, name in (("fc.weight", "fc.weight"), ("midlayer.self_attn.q_proj.weight", "layers.0.self_attn.q_proj.weight")):
        cosine = torch.nn.functional.cosine_similarity(trained[name].float().flatten(), source[flat].float().flatten(), dim=0)
        assert cosine > 0.9, (name, float(cosine))
    # The frozen embedding it trained with is the target's, the one vLLM serves the drafter with.
    target = target_embedding(resolve_verifier_path("embedded:smollm2-135m-instruct")).to(torch.bfloat16)
    assert torch.equal(trained["embed_tokens.weight"], target)

    # Stage 05's conversion gives a flat folder whose every tensor has the released drafter's shape.
    out = tmp_path / "vllm"
    convert.convert_for_vllm(checkpoint, out, target_vocab_size=SMOLLM2.vocab_size, layer_ids=list(SMOLLM2.hf_layer_ids))
    result = check_shapes(out, reference_dir=released)
    assert result["ok"], result["detail"]["problems"]
    assert result["detail"]["reference"]["source"] == "weights"


def _first_val_row(run_dir: Path, tmp: Path, **train) -> tuple[dict, dict]:
    """Stage 04 on a copy of the run's stages 01-03, one epoch at lr 1e-7: (its first val row, its manifest)."""
    dest = copy_run(run_dir, tmp, ("01_generate_data", "02_extract_hidden", "03_build_vocab_map"))
    config = write_smoke_config(tmp / "run.yaml", data_root=str(tmp / "data"), run_name="t",
                                train={"epochs": 1, "lr": 1e-7, **train})
    ok(run_stage("04_train.py", config, timeout=1800))
    manifest = json.loads((dest / "04_train" / "manifest.json").read_text())
    return next(r for r in read_metrics(dest / "04_train") if r["split"] == "val"), manifest


def test_fine_tune_from_the_pipelines_own_converted_drafter_starts_from_its_weights(finished_small_run, tmp_path):
    """Stage 04 started from stage 05's vllm/ folder validates, after its first step, as the trained drafter does.

    The step is taken with lr 1e-7, far below the bf16 resolution of the weights (~1e-4 at this scale), so the first
    validation sees the loaded weights on the same validation split. Against the same fine-tune started from the
    speculators checkpoint stage 05 converted: per-position losses within 0.5% (the same bf16 weights through two
    layouts; only summation order may differ). Against the original run's validation of that checkpoint: total
    loss within 5%, since the original validated its fp32 training weights and the checkpoint stores them in bf16 (measured:
    3%). A start from anything else (fresh weights, another layer, another embedding) lands much farther.
    """
    _, run_dir = finished_small_run
    converted = json.loads((run_dir / "05_convert" / "manifest.json").read_text())["counts"]["checkpoint"]
    epoch = int(Path(converted).name)
    reference = next(r for r in read_metrics(run_dir / "04_train") if r["split"] == "val" and int(r["epoch"]) == epoch)

    from_flat, manifest = _first_val_row(run_dir, tmp_path / "flat", init_from=str(run_dir / "05_convert" / "vllm"))
    assert manifest["inputs"]["init_from_layer_ids"]["convention"] == "vllm"  # known from the top-level id list
    from_checkpoint, _ = _first_val_row(run_dir, tmp_path / "checkpoint", init_from=str(run_dir / converted))
    for key in ("loss_0", "loss_1", "loss_2"):
        assert float(from_flat[key]) == pytest.approx(float(from_checkpoint[key]), rel=0.005), (key, from_flat, from_checkpoint)
    assert float(from_flat["loss"]) == pytest.approx(float(reference["loss"]), rel=0.05), (from_flat, reference)


# -- refusals, before any work -----------------------------------------------------------------------------------

def _tensors_without(name):
    return lambda: {k: v for k, v in standin_tensors(SMOLLM2).items() if k != name}


def _tensors_with(name, value):
    return lambda: standin_tensors(SMOLLM2) | {name: value}


REFUSALS = [
    # (id, stand-in shape, tensors, config changes, script, settings, expected in the error line)
    ("wrong-hidden-size", SMOLLM2.but(hidden_size=64, num_attention_heads=4, num_key_value_heads=4), None, {},
     "03_build_vocab_map.py", {}, r"vocab.from_drafter: \S+/config.json: hidden_size 64 differs from the target's hidden size 576"),
    ("other-vocab-size", SMOLLM2.but(vocab_size=32000), None, {},
     "03_build_vocab_map.py", {}, r"vocab.from_drafter: \S+/config.json: vocab_size 32000 differs from the target's vocabulary size 49152"),
    ("unknown-key", SMOLLM2, _tensors_with("midlayer.self_attn.rotary.weight", torch.ones(4)), {},
     "03_build_vocab_map.py", {}, r"vocab.from_drafter: \S+/model.safetensors: midlayer.self_attn.rotary.weight: unexpected tensor"),
    ("missing-d2t", SMOLLM2, _tensors_without("d2t"), {},
     "04_train.py", {}, r"train.init_from: \S+/model.safetensors: d2t: missing"),
    ("unknown-convention", SMOLLM2, None, {},
     "04_train.py", {}, r"train.init_from_convention: not set, and \S+/config.json gives its aux layer ids \[1, 14, 26\]"),
    ("wrong-convention", SMOLLM2, None, {},
     "04_train.py", {"init_from_convention": "vllm"}, r"train.init_from: \S+/config.json: eagle_config.eagle_aux_hidden_state_layer_ids "
     r"\[1, 14, 26\] in the vllm convention are HF layers \[1, 14, 26\], but this run captured \[2, 15, 27\]"),
]


@pytest.fixture(scope="module")
def refusal_run(small_run, tmp_path_factory):
    """A copy of the small run's stages 01-03, which every refusal must leave as it is."""
    _, _, run_dir = small_run
    root = tmp_path_factory.mktemp("refusals")
    copy_run(run_dir, root, ("01_generate_data", "02_extract_hidden", "03_build_vocab_map"))
    return root


@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_bad_released_drafter_is_refused_before_any_work(refusal_run, tmp_path, case):
    _, shape, tensors, config_changes, script, settings, expected = case
    config = standin_config(shape) | config_changes
    released = write_released_standin(tmp_path / "released", shape, tensors=tensors() if tensors else None, config=config)
    section = ({"vocab": {"draft_vocab_size": 512, "from_drafter": str(released)}} if script.startswith("03")
               else {"train": {"init_from": str(released), **SPECFORGE_FLAGS, **settings}})
    run_config = write_smoke_config(tmp_path / "run.yaml", data_root=str(refusal_run / "data"), run_name="t", **section)
    before = snapshot(refusal_run / "data")
    result = run_stage(script, run_config)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2, result.stderr[-2000:]
    assert lines[-1].startswith("error: ") and sum(line.startswith("error: ") for line in lines) == 1, lines[-3:]
    assert re.search(expected, lines[-1]), lines[-1]
    assert snapshot(refusal_run / "data") == before


def test_convention_without_init_from_is_refused_when_the_config_loads(tmp_path):
    from conftest import write_config

    from eagle_pipeline.config import load_config

    with pytest.raises(BadInput, match=r"train\.init_from_convention: .*train\.init_from, which is not set"):
        load_config(write_config(tmp_path / "c.yaml", train={"init_from_convention": "sglang"}))
    with pytest.raises(BadInput, match=r"train\.init_from_convention"):
        load_config(write_config(tmp_path / "c.yaml", train={"init_from": "x", "init_from_convention": "hf"}))
    assert load_config(write_config(tmp_path / "c.yaml", train={"init_from": "x", "init_from_convention": "sglang"}))
