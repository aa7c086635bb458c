"""Turn a speculators 0.9 EAGLE-3 checkpoint into the flat folder vLLM and SGLang load (docs/formats.md, "The flat
drafter folder"; an MLA layer: "The MLA drafter folder", vLLM's alone). Every name goes through the one table of
drafter/layouts.py; drafter/to_speculators.py writes the other way.

Layer ids are given once, in the vLLM/speculators convention (HF `hidden_states[k]`), and written per engine: as
they are for vLLM, minus one for SGLang (docs/layer_ids.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle_pipeline.atomic import atomic_dir
from eagle_pipeline.drafter.folder import (
    SpeculatorsCheckpoint,
    read_config,
    read_speculators_checkpoint,
    target_vocab,
)
from eagle_pipeline.drafter.layouts import (
    DFLASH_ARCHITECTURE,
    FLAT,
    FLAT_ARCHITECTURE,
    FLAT_ARCHITECTURES,
    MLA,
    NORM_FLAGS,
    SGLANG,
    SPECULATORS,
    VERIFIER_ONLY_KEYS,
    WEIGHTS_NAME,
    dflash_trained_causal,
    is_dflash_config,
    layer_index,
    weight_name,
    weight_row,
)
from eagle_pipeline.drafter.tensors import MLA_LAYER_KEYS
from eagle_pipeline.errors import BadInput
from eagle_pipeline.json_files import read_json_object
from eagle_pipeline.layer_ids import to_convention
from eagle_pipeline.vocab_map import check_vocab_map

if TYPE_CHECKING:
    import torch

# The layout each engine's folder is written in (drafter.layouts.WEIGHT_NAMES).
ENGINE_LAYOUTS = {"vllm": FLAT, "sglang": SGLANG}


def resolve_layer_ids(ckpt: SpeculatorsCheckpoint, layer_ids: list[int] | tuple[int, ...] | None) -> list[int]:
    """The aux layer ids (vLLM convention) the drafter was trained on; a caller's ids must agree with them."""
    stored = ckpt.config.get("eagle_aux_hidden_state_layer_ids")
    if stored and layer_ids is not None and list(stored) != list(layer_ids):
        raise BadInput(
            f"layer_ids {list(layer_ids)} differ from the checkpoint's eagle_aux_hidden_state_layer_ids "
            f"{list(stored)}; the drafter only works with the ids it was trained on: drop the override or retrain"
        )
    ids = list(stored or layer_ids or [])
    if not ids:
        raise BadInput(
            f"{ckpt.path / 'config.json'}: eagle_aux_hidden_state_layer_ids is empty; pass layer_ids "
            "(the HF hidden_states indices the drafter was trained on)"
        )
    return [int(i) for i in ids]


def rope_fields(layer: dict[str, Any]) -> dict[str, Any]:
    """Rope settings in both spellings (docs/formats.md, "config.json fields")."""
    params = dict(layer.get("rope_parameters") or {})
    theta = params.get("rope_theta", layer.get("rope_theta"))
    if theta is None:
        raise BadInput("transformer_layer_config: no rope_theta / rope_parameters.rope_theta; "
                       "the draft layer's rope is unknown")
    params.setdefault("rope_theta", theta)
    params.setdefault("rope_type", "default")
    legacy_scaling = (None if params["rope_type"] == "default"
                      else {k: v for k, v in params.items() if k != "rope_theta"})
    return {"rope_theta": theta, "rope_scaling": legacy_scaling, "rope_parameters": params}


def flat_config(ckpt: SpeculatorsCheckpoint, *, vocab_size: int, written_layer_ids: list[int],
                dtype: str, engine: str) -> dict[str, Any]:
    """The flat config the engines read (Llama-shaped, or the MLA one of `mla_flat_config`); every field that
    changes behaviour is explicit."""
    if ckpt.dims.layer_shape == MLA:
        return mla_flat_config(ckpt, vocab_size=vocab_size, written_layer_ids=written_layer_ids, dtype=dtype)
    layer, dims = ckpt.layer, ckpt.dims
    return {
        "architectures": [FLAT_ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": dims.hidden_size,
        "head_dim": dims.head_dim,
        "num_attention_heads": dims.num_attention_heads,
        "num_key_value_heads": dims.num_key_value_heads,
        "intermediate_size": dims.intermediate_size,
        "hidden_act": layer.get("hidden_act", "silu"),
        "rms_norm_eps": float(layer["rms_norm_eps"]),
        "max_position_embeddings": int(layer["max_position_embeddings"]),
        **rope_fields(layer),
        "attention_bias": dims.attention_bias,
        "mlp_bias": dims.mlp_bias,
    } | eagle3_fields(ckpt, vocab_size=vocab_size, written_layer_ids=written_layer_ids, dtype=dtype, engine=engine)


def eagle3_fields(ckpt: SpeculatorsCheckpoint, *, vocab_size: int, written_layer_ids: list[int], dtype: str,
                  engine: str) -> dict[str, Any]:
    """The fields every flat drafter config carries beside its decoder layer's, whatever the layer's shape."""
    config: dict[str, Any] = {
        "num_hidden_layers": ckpt.dims.num_layers,
        "vocab_size": vocab_size,
        "draft_vocab_size": ckpt.dims.draft_vocab_size,
        # A tied config makes SGLang use embed_tokens as lm_head; the drafter has its own lm_head.
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": written_layer_ids, "use_aux_hidden_state": True},
        "num_aux_hidden_states": len(written_layer_ids),
        "target_hidden_size": ckpt.dims.target_hidden_size,
        # vLLM's default for a missing norm_before_residual differs between flat (False) and speculators
        # (True) configs, so every flag is written.
        **{name: ckpt.flags[name] for name in NORM_FLAGS},
        "torch_dtype": dtype,
    }
    if engine == "vllm":
        # vLLM's V1 model runner reads the ids from eagle_config, but Model Runner V2 (its default where
        # Triton is present) reads only a top-level eagle_aux_hidden_state_layer_ids and otherwise
        # silently captures its default layers. SGLang reads eagle_config only.
        config["eagle_aux_hidden_state_layer_ids"] = written_layer_ids
    return config


def verifier_text_config(ckpt: SpeculatorsCheckpoint) -> dict[str, Any]:
    """The text model's config of the checkpoint's verifier, where its folder is local and readable; else {}."""
    config = (read_config(ckpt.verifier_path) if ckpt.verifier_path else None) or {}
    text = config.get("text_config", config)
    return text if isinstance(text, dict) else {}


def mla_model_type(ckpt: SpeculatorsCheckpoint) -> str:
    """kimi_k2 for a Kimi target (vLLM maps it to DeepseekV3Config, as the released Kimi drafter names it), else
    deepseek_v3."""
    return "kimi_k2" if verifier_text_config(ckpt).get("model_type") == "kimi_k2" else "deepseek_v3"


def mla_flat_config(ckpt: SpeculatorsCheckpoint, *, vocab_size: int, written_layer_ids: list[int],
                    dtype: str) -> dict[str, Any]:
    """The flat `Eagle3DeepseekV2ForCausalLM` config vLLM reads (deepseek_eagle3.py): the MLA dimensions and rope
    of the checkpoint's transformer_layer_config (a DeepseekV3Config), the EAGLE-3 fields as for a Llama layer.
    vLLM's MLA drafter has a dense SwiGLU MLP and no input_norm, so no MoE field and no norm_before_fc."""
    layer = ckpt.layer
    dims = ckpt.dims
    return {
        "architectures": [FLAT_ARCHITECTURES[MLA]],
        "model_type": mla_model_type(ckpt),
        "hidden_size": dims.hidden_size,
        "num_attention_heads": dims.num_attention_heads,
        "num_key_value_heads": dims.num_key_value_heads,
        **{key: getattr(dims, key) for key in MLA_LAYER_KEYS},
        "intermediate_size": dims.intermediate_size,
        "hidden_act": layer.get("hidden_act", "silu"),
        "rms_norm_eps": float(layer["rms_norm_eps"]),
        "max_position_embeddings": int(layer.get("max_position_embeddings", 4096)),
        **rope_fields(layer),
        "rope_interleave": bool(layer.get("rope_interleave", True)),
    } | eagle3_fields(ckpt, vocab_size=vocab_size, written_layer_ids=written_layer_ids, dtype=dtype, engine="vllm")


def allowed_drafter_key(name: str, ckpt: SpeculatorsCheckpoint) -> bool:
    """Whether a speculators checkpoint with this config's layer count and norm flags can hold `name`."""
    if (index := layer_index(name)) is not None:
        return index < ckpt.dims.num_layers
    row = weight_row(name, SPECULATORS)
    return row is not None and row.flat is not None and (row.flag is None or ckpt.flags[row.flag])


def drafter_tensors(ckpt: SpeculatorsCheckpoint, *, vocab_size: int, num_aux: int,
                    layout: str = FLAT) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Load the drafter's own tensors under their names in `layout`; returns (tensors, dropped verifier-only names)."""
    names = set(ckpt.tensor_files)
    unknown = sorted(n for n in names if n not in VERIFIER_ONLY_KEYS and not allowed_drafter_key(n, ckpt))
    if unknown:
        raise BadInput(
            f"{ckpt.path}: unexpected tensor {unknown[0]!r} ({len(unknown)} unexpected in all) for this config's "
            "layer count and norm flags; the checkpoint and its config.json disagree"
        )
    dims = ckpt.dims
    draft_vocab_size = dims.draft_vocab_size
    if draft_vocab_size != vocab_size:
        missing = [n for n in ("lm_head.weight", "d2t", "t2d") if n not in names]
        if missing:
            raise BadInput(
                f"{ckpt.path}: a pruned vocabulary ({draft_vocab_size} of {vocab_size}) needs {', '.join(missing)} "
                "in the checkpoint; without d2t vLLM silently maps draft id k to target id k"
            )
        check_vocab_map(ckpt.tensor("d2t"), ckpt.tensor("t2d"), vocab_size, draft_vocab_size, str(ckpt.path))

    fc_shape = None
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(names):
        if name in VERIFIER_ONLY_KEYS:
            continue
        if draft_vocab_size == vocab_size and name in ("d2t", "t2d"):
            continue  # identity map: the engines expect none with a full vocabulary
        tensor = ckpt.tensor(name).contiguous()
        if name == "fc.weight":
            fc_shape = tuple(tensor.shape)
        written = weight_name(name, source=SPECULATORS, target=layout)
        if written is None:  # sglang_refusal names the setting first; this is the table's own guard
            raise BadInput(f"{ckpt.path}: {name} has no counterpart in the {layout} layout")
        tensors[written] = tensor
    expected_fc = (dims.hidden_size, num_aux * dims.target_hidden_size)
    if fc_shape != expected_fc:
        raise BadInput(
            f"{ckpt.path}: fc.weight has shape {fc_shape}, expected {expected_fc} for {num_aux} aux layers "
            f"of width {dims.target_hidden_size}; eagle_aux_hidden_state_layer_ids and the weights disagree"
        )
    dropped = sorted(n for n in names if n in VERIFIER_ONLY_KEYS)
    return tensors, dropped


def float_dtype_name(tensors: dict[str, torch.Tensor]) -> str:
    dtypes = {t.dtype for t in tensors.values() if t.is_floating_point()}
    if len(dtypes) != 1:
        raise BadInput(f"drafter weights mix float dtypes {sorted(map(str, dtypes))}; save the checkpoint in one dtype")
    return str(dtypes.pop()).removeprefix("torch.")


def write_flat_dir(out_dir: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    with atomic_dir(out_dir) as tmp:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
        # The temporary folder is created private; a served model folder is read by other users too.
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)


def _convert(ckpt: SpeculatorsCheckpoint, out_dir: str | Path, *, engine: str, vocab_size: int,
             layer_ids: list[int], written_layer_ids: list[int]) -> dict[str, Any]:
    tensors, dropped = drafter_tensors(ckpt, vocab_size=vocab_size, num_aux=len(layer_ids),
                                       layout=ENGINE_LAYOUTS[engine])
    config = flat_config(ckpt, vocab_size=vocab_size, written_layer_ids=written_layer_ids,
                         dtype=float_dtype_name(tensors), engine=engine)
    write_flat_dir(out_dir, config, tensors)
    return {
        "engine": engine,
        "source": str(ckpt.path),
        "out_dir": str(out_dir),
        "architecture": FLAT_ARCHITECTURES[ckpt.dims.layer_shape],
        "layer_ids": layer_ids,
        "written_layer_ids": written_layer_ids,
        "vocab_size": vocab_size,
        "draft_vocab_size": ckpt.dims.draft_vocab_size,
        "norm_flags": {name: ckpt.flags[name] for name in NORM_FLAGS},
        "tensors": {name: list(t.shape) for name, t in tensors.items()},
        "dropped": dropped,
    }


def convert_for_vllm(ckpt_dir: str | Path, out_dir: str | Path, *, target_vocab_size: int | None = None,
                     layer_ids: list[int] | tuple[int, ...] | None = None) -> dict[str, Any]:
    """Write a flat `LlamaForCausalLMEagle3` (or, for an MLA layer, `Eagle3DeepseekV2ForCausalLM`) drafter folder
    for vLLM, without tokenizer files (the drafter uses the target's); returns a summary of what was written."""
    ckpt = read_speculators_checkpoint(ckpt_dir)
    vocab_size = target_vocab(ckpt, target_vocab_size)
    ids = resolve_layer_ids(ckpt, layer_ids)
    return _convert(ckpt, out_dir, engine="vllm", vocab_size=vocab_size, layer_ids=ids, written_layer_ids=ids)


def dflash_config(ckpt_dir: str | Path, layer_ids: list[int]) -> dict[str, Any]:
    """A DFlash checkpoint's config as vLLM is to read it, refused unless the checkpoint is a DFlash drafter of the
    run's aux layers with its weights; a folder whose layers were all trained alike says so in
    sliding_window_non_causal (why: docs/drafter_families.md, "Traps the pipeline checks")."""
    path = Path(ckpt_dir) / "config.json"
    config = read_json_object(path, "rerun 04_train.py to write the checkpoint again")
    if not is_dflash_config(config) or not (Path(ckpt_dir) / WEIGHTS_NAME).is_file():
        raise BadInput(f"{path}: not a speculators DFlash checkpoint with {WEIGHTS_NAME} (train.family is dflash); "
                       f"rerun 04_train.py with --force")
    if list(config.get("aux_hidden_state_layer_ids") or []) != list(layer_ids):
        raise BadInput(f"{path}: aux_hidden_state_layer_ids {config.get('aux_hidden_state_layer_ids')} differ from the "
                       f"{list(layer_ids)} stage 02 captured; rerun 04_train.py with --force")
    trained = dflash_trained_causal(config)
    if trained is not None:  # vLLM attends alike in every layer; layers trained both ways want it said
        config["sliding_window_non_causal"] = not trained
    return config


def write_dflash_folder(ckpt_dir: str | Path, out_dir: str | Path, layer_ids: list[int]) -> dict[str, Any]:
    """The folder vLLM loads for method dflash: the speculators checkpoint itself (vLLM reads it through
    transformers_utils/configs/speculators/algos.py, update_dflash), its weights as saved, its config `dflash_config`'s.
    """
    from safetensors.torch import load_file

    config = dflash_config(ckpt_dir, layer_ids)
    tensors = load_file(str(Path(ckpt_dir) / WEIGHTS_NAME))
    write_flat_dir(out_dir, config, tensors)
    return {"engine": "vllm", "source": str(ckpt_dir), "out_dir": str(out_dir), "architecture": DFLASH_ARCHITECTURE,
            "layer_ids": list(layer_ids), "sliding_window_non_causal": config.get("sliding_window_non_causal"),
            "tensors": {name: list(t.shape) for name, t in tensors.items()}}


def sglang_refusal(ckpt: SpeculatorsCheckpoint, layer_ids: list[int], target_num_layers: int | None) -> str | None:
    """Why SGLang's llama_eagle3 cannot run this drafter as trained, or None (docs/formats.md, "What SGLang reads
    differently")."""
    if ckpt.dims.layer_shape == MLA:
        return (f"transformer_layer_config.model_type is {ckpt.layer.get('model_type')!r} (an MLA layer); SGLang's "
                f"llama_eagle3 runs Llama layers only: serve this drafter with vLLM (Eagle3DeepseekV2ForCausalLM)")
    set_flags = [name for name in NORM_FLAGS if ckpt.flags[name]]
    if set_flags:
        flag = set_flags[0]
        return (f"{flag} is true in {ckpt.path / 'config.json'} (set: {', '.join(set_flags)}); SGLang's "
                f"llama_eagle3 has no such norm variant: train with train.{flag}=false or serve with vLLM")
    if ckpt.dims.num_layers != 1:
        return (f"transformer_layer_config.num_hidden_layers is {ckpt.dims.num_layers}; "
                f"SGLang loads one-layer EAGLE-3 drafters only")
    if len(layer_ids) != 3:
        return f"eagle_aux_hidden_state_layer_ids has {len(layer_ids)} ids; SGLang's fc takes exactly 3 aux layers"
    for bias in ("attention_bias", "mlp_bias"):
        if ckpt.layer.get(bias):
            return f"transformer_layer_config.{bias} is true; SGLang's EAGLE-3 midlayer has no such bias"
    if min(layer_ids) < 1:
        return (f"aux layer id {min(layer_ids)} (the embeddings) cannot be written for SGLang, whose ids mean "
                "'output of layer id'; choose ids >= 1")
    if target_num_layers is not None and max(layer_ids) >= target_num_layers:
        return (f"aux layer id {max(layer_ids)} (the final layer's output) is never captured by SGLang, which "
                f"captures entries of layers 0..{target_num_layers - 1}; choose ids < {target_num_layers}")
    return None


def convert_for_sglang(ckpt_dir: str | Path, out_dir: str | Path, *, target_vocab_size: int | None = None,
                       layer_ids: list[int] | tuple[int, ...] | None = None,
                       target_num_layers: int | None = None) -> dict[str, Any]:
    """Write a flat drafter folder for SGLang: the vLLM layout with every aux layer id minus one. Raises BadInput
    (sglang_refusal) for a drafter SGLang would run differently from how it was trained; `target_num_layers` (else
    the checkpoint's local verifier's) lets the final-layer id be refused."""
    ckpt = read_speculators_checkpoint(ckpt_dir)
    vocab_size = target_vocab(ckpt, target_vocab_size)
    ids = resolve_layer_ids(ckpt, layer_ids)
    if target_num_layers is None and "num_hidden_layers" in verifier_text_config(ckpt):
        target_num_layers = int(verifier_text_config(ckpt)["num_hidden_layers"])
    refusal = sglang_refusal(ckpt, ids, target_num_layers)
    if refusal:
        raise BadInput(refusal)
    return _convert(ckpt, out_dir, engine="sglang", vocab_size=vocab_size, layer_ids=ids,
                    written_layer_ids=to_convention(ids, "sglang"))
