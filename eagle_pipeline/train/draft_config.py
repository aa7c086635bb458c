"""The drafter's decoder: derived from the verifier or built from an explicit `train.draft_shape`, and
the check that a drafter to fine-tune from (`train.init_from`) has exactly this run's shape.

`train.draft_layer` chooses the layer: a Llama decoder (a LlamaConfig), or the verifier's own MLA attention (a
DeepseekV3Config that patches/speculators_mla.py trains, served by vLLM's Eagle3DeepseekV2ForCausalLM)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from eagle_pipeline.config import TrainConfig, resolve_path
from eagle_pipeline.drafter.layouts import NORM_FLAGS, SPECULATORS_TYPE_KEY
from eagle_pipeline.drafter.tensors import MLA_DIM_KEYS, MLA_LAYER_KEYS
from eagle_pipeline.drafter.to_speculators import MLA_ROPE_KEYS
from eagle_pipeline.errors import BadInput
from eagle_pipeline.train.settings import TrainRun

DRAFT_CONFIG_FILE = "draft_config.json"
# draft_shape keys without a default: the verifier's attention and MLP need not suit a one-layer drafter.
REQUIRED_SHAPE_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
# The draft_shape keys an MLA layer takes; its head dimensions are the verifier's MLA latent's.
MLA_SHAPE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act",
                  "rope_theta", "rms_norm_eps", "max_position_embeddings")
# The decoder fields that must agree between this run and a drafter it fine-tunes.
COMPARED_SHAPE_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "hidden_act",
    "rope_theta",
    "layer_types",
    *MLA_LAYER_KEYS,  # the verifier's MLA dimensions, which an MLA drafter keeps
    # An MLA layer's rope beyond its theta: what vLLM's MLA drafter rotates by (YaRN factor and mscales, which also
    # scale its softmax) and how (interleaved pairs); None on both sides for a Llama layer.
    "rope_interleave",
    "yarn",
)


def _field(text_config: Any, name: str, default: Any = None) -> Any:
    """A field of the verifier's text config, a dict (verifier.Verifier.text_config) or a transformers config."""
    if isinstance(text_config, Mapping):
        return text_config.get(name, default)
    return getattr(text_config, name, default)


def check_draft_shape(train: TrainConfig, verifier_text_config: Any) -> None:
    """Refuse a drafter that cannot be built for this verifier: an MLA layer for a verifier without MLA (or with
    rope settings vLLM's MLA drafter computes differently), an explicit train.draft_shape with keys left out or
    keys its layer does not take, a hidden size other than the target's, heads that do not group evenly. Stage 04
    calls it in its dry run and before `--force` deletes anything; the trainer would refuse the same only after
    that. `verifier_text_config`: the verifier's text config, a dict or a transformers config."""
    verifier_hidden_size = int(_field(verifier_text_config, "hidden_size"))
    shape = train.draft_shape.model_dump(exclude_none=True) if train.draft_shape else {}
    if train.draft_layer == "mla":
        _check_mla(shape, verifier_text_config)
    if not shape:  # every field left out: the shape comes from the verifier
        return
    missing = set(REQUIRED_SHAPE_KEYS) - set(shape) if train.draft_layer == "llama" else set()
    if missing:
        raise BadInput(f"train.draft_shape: missing keys {sorted(missing)}; give all of {sorted(REQUIRED_SHAPE_KEYS)}, "
                       f"or leave draft_shape out to derive the shape from the verifier")
    hidden = int(shape.get("hidden_size", verifier_hidden_size))
    if hidden != verifier_hidden_size:
        raise BadInput(
            f"train.draft_shape.hidden_size: {hidden} differs from the verifier's hidden size "
            f"{verifier_hidden_size}; an EAGLE-3 drafter must match it (leave hidden_size out)"
        )
    if train.draft_layer == "mla":
        return
    heads, kv_heads = int(shape["num_attention_heads"]), int(shape["num_key_value_heads"])
    if heads % kv_heads:
        raise BadInput(
            f"train.draft_shape: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )


def _check_mla(shape: Mapping[str, Any], text_config: Any) -> None:
    from patches.speculators_mla import rope_mismatch

    if not _field(text_config, "kv_lora_rank"):
        model_type = _field(text_config, "model_type")
        raise BadInput(f"train.draft_layer: mla needs a verifier with MLA attention (kv_lora_rank in its config; "
                       f"DeepSeek-V3, Kimi-K2), this one is {model_type!r}; set draft_layer llama")
    foreign = sorted(set(shape) - set(MLA_SHAPE_KEYS))
    if foreign:
        raise BadInput(f"train.draft_shape: {', '.join(foreign)} do not apply to draft_layer mla (its heads are the "
                       f"verifier's {'/'.join(MLA_DIM_KEYS[1:])}, every head its own key); leave them out")
    if int(shape.get("num_hidden_layers", 1)) != 1:
        raise BadInput(f"train.draft_shape.num_hidden_layers: {shape['num_hidden_layers']}, but an MLA drafter has "
                       f"one decoder layer (as vLLM's Eagle3DeepseekV2ForCausalLM is served); leave it out")
    act = shape.get("hidden_act", _field(text_config, "hidden_act", "silu"))
    if act != "silu":
        raise BadInput(f"train.draft_shape.hidden_act: {act}, but vLLM's MLA drafter MLP is SiLU only; set silu")
    problem = rope_mismatch(_mla_rope(text_config, shape))
    if problem:
        raise BadInput(f"train.draft_layer: mla, but the verifier's rope has {problem}; set draft_layer llama")


def _mla_rope(text_config: Any, shape: Mapping[str, Any]) -> dict[str, Any]:
    """The MLA drafter's rope parameters: the verifier's (YaRN included), its theta replaced by draft_shape's."""
    params = _field(text_config, "rope_parameters") or _field(text_config, "rope_scaling") or {}
    params = {**params} if isinstance(params, Mapping) else {}
    if "rope_type" not in params:
        params["rope_type"] = params.pop("type", "default")
    params["rope_theta"] = float(shape.get("rope_theta", _rope_theta(text_config)))
    return params


def build_mla_draft_config(train: TrainConfig, text_config: Any) -> dict[str, Any]:
    """The MLA draft decoder as a DeepseekV3Config dict: one dense layer with the verifier's MLA dimensions and
    rope, draft_shape's heads, MLP width, eps and positions where given."""
    from transformers import DeepseekV3Config

    shape = train.draft_shape.model_dump(exclude_none=True) if train.draft_shape else {}
    check_draft_shape(train, text_config)
    config = DeepseekV3Config(
        vocab_size=int(_field(text_config, "vocab_size")),
        hidden_size=int(_field(text_config, "hidden_size")),
        intermediate_size=int(shape.get("intermediate_size", _field(text_config, "intermediate_size"))),
        num_hidden_layers=1,
        # Dense: vLLM's EAGLE-3 MLA layer has an MLP, never experts.
        first_k_dense_replace=1,
        num_attention_heads=int(shape.get("num_attention_heads", _field(text_config, "num_attention_heads"))),
        num_key_value_heads=int(shape.get("num_attention_heads", _field(text_config, "num_attention_heads"))),
        q_lora_rank=None if _field(text_config, "q_lora_rank") is None else int(_field(text_config, "q_lora_rank")),
        **{key: int(_field(text_config, key)) for key in MLA_DIM_KEYS},
        hidden_act="silu",
        max_position_embeddings=int(shape.get("max_position_embeddings",
                                              _field(text_config, "max_position_embeddings"))),
        rms_norm_eps=float(shape.get("rms_norm_eps", _field(text_config, "rms_norm_eps", 1e-6))),
        rope_parameters=_mla_rope(text_config, shape),
        # vLLM's MLA rotates interleaved pairs (is_neox_style False), whatever the verifier's config says.
        rope_interleave=True,
        attention_bias=False,
        tie_word_embeddings=False,
    )
    return config.to_dict()


def build_draft_config(train: TrainConfig, run: TrainRun, verifier_text_config: Any) -> dict[str, Any]:
    """The draft decoder as a LlamaConfig dict: explicit from train.draft_shape, or derived from the verifier; with
    train.draft_layer mla a DeepseekV3Config dict (build_mla_draft_config)."""
    from transformers import LlamaConfig

    if train.draft_layer == "mla":
        return build_mla_draft_config(train, verifier_text_config)

    shape = train.draft_shape.model_dump(exclude_none=True) if train.draft_shape else {}
    if not shape:
        from speculators.train.cli import create_transformer_layer_config

        # A DFlash drafter: Qwen3 layers (speculators' DFlashDraftModel), the verifier's width.
        arch, layers = ("qwen3", train.dflash.num_layers) if train.family == "dflash" else ("llama", 1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = create_transformer_layer_config(
                verifier_name_or_path=str(run.verifier_dir),
                num_layers=layers,
                draft_arch=arch,
                hidden_act="silu",
                sliding_window=2048,
                # vLLM serves EAGLE-3 drafters with full attention: train them that way. A DFlash layer with full
                # attention is bidirectional inside the block (speculators' default makes every layer
                # sliding-window, causal there; vLLM's V1 runner refuses a mix of the two).
                full_attention_indices=list(range(layers)),
            )
        return config.to_dict()

    check_draft_shape(train, verifier_text_config)
    hidden = int(shape.get("hidden_size", verifier_text_config.hidden_size))
    heads, kv_heads = int(shape["num_attention_heads"]), int(shape["num_key_value_heads"])
    layers = int(shape.get("num_hidden_layers", 1))
    rope_theta = float(shape.get("rope_theta", _rope_theta(verifier_text_config)))
    config = LlamaConfig(
        vocab_size=int(verifier_text_config.vocab_size),
        hidden_size=hidden,
        intermediate_size=int(shape["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(shape["head_dim"]),
        hidden_act=str(shape.get("hidden_act", "silu")),
        max_position_embeddings=int(
            shape.get("max_position_embeddings", verifier_text_config.max_position_embeddings)
        ),
        rms_norm_eps=float(shape.get("rms_norm_eps", getattr(verifier_text_config, "rms_norm_eps", 1e-6))),
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        layer_types=["full_attention"] * layers,
    )
    return config.to_dict()


def _rope_theta(text_config: Any) -> float:
    params = _field(text_config, "rope_parameters") or {}
    if isinstance(params, Mapping) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(_field(text_config, "rope_theta", 10000.0))


def _shape_of(layer_config: Mapping[str, Any]) -> dict[str, Any]:
    """The compared decoder fields, read through transformers so that omitted defaults are filled in."""
    from transformers import AutoConfig

    config = type(AutoConfig.for_model(layer_config.get("model_type", "llama"))).from_dict(dict(layer_config))
    # The layer shape named as stage 04 names it: speculators' layer config model_type (llama or deepseek_v3).
    shape = {key: getattr(config, key, None) for key in COMPARED_SHAPE_KEYS if key not in ("rope_theta", "yarn")}
    if getattr(config, "kv_lora_rank", None):
        params = _field(config, "rope_parameters") or {}
        shape["yarn"] = {key: params.get(key) for key in MLA_ROPE_KEYS if params.get(key) is not None}
    if shape["head_dim"] is None:
        shape["head_dim"] = config.hidden_size // config.num_attention_heads
    if shape["layer_types"] is not None:
        shape["layer_types"] = list(shape["layer_types"])
    shape["rope_theta"] = _rope_theta(config)
    return shape


def check_init_from(train: TrainConfig, run: TrainRun, draft_config: Mapping[str, Any]) -> None:
    """Raise BadInput unless the drafter in train.init_from (or the speculators folder made from a flat
    one, run.init_from_dir) fits this run exactly."""
    source = run.init_from_dir or resolve_path(train.init_from)
    config_path, weights_path = source / "config.json", source / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise BadInput(f"train.init_from: {source} needs config.json and model.safetensors (a speculators drafter)")
    config = json.loads(config_path.read_text())
    if config.get(SPECULATORS_TYPE_KEY) != train.family:
        raise BadInput(
            f"train.init_from: {config_path} is not a speculators {train.family} config "
            f"({SPECULATORS_TYPE_KEY}={config.get(SPECULATORS_TYPE_KEY)!r}); convert it with "
            f"`speculators convert` first, or set train.family"
        )

    differences = []
    theirs, ours = _shape_of(config.get("transformer_layer_config", {})), _shape_of(draft_config)
    for key in COMPARED_SHAPE_KEYS:
        if theirs.get(key) != ours.get(key):
            differences.append(f"{key} {theirs.get(key)} vs {ours.get(key)}")
    dflash = train.family == "dflash"
    their_ids = config.get("aux_hidden_state_layer_ids" if dflash else "eagle_aux_hidden_state_layer_ids")
    if their_ids is not None and list(their_ids) != list(run.layer_ids):
        differences.append(f"layer_ids {their_ids} vs {run.layer_ids}")
    ours = ({"block_size": train.dflash.block_size, "mask_token_id": run.mask_token_id} if dflash
            else {flag: bool(getattr(train, flag)) for flag in NORM_FLAGS})
    for key, value in ours.items():
        theirs = config.get(key) if dflash else bool(config.get(key, False))
        if theirs != value:
            differences.append(f"{key} {theirs} vs {value}")
    if differences:
        raise BadInput(
            f"train.init_from: {source} has another drafter shape than this run (theirs vs ours): "
            f"{'; '.join(differences)}"
        )

    check_same_vocab_map(weights_path, run.d2t_path, run.t2d_path)


def check_same_vocab_map(weights_path, d2t_path, t2d_path, field: str = "train.init_from") -> None:
    """Raise BadInput unless the drafter's d2t/t2d (in `weights_path`) are exactly stage 03's files: its
    lm_head rows are only meaningful for the target tokens it was trained to propose."""
    from safetensors import safe_open

    d2t, t2d = np.load(d2t_path), np.load(t2d_path)
    with safe_open(str(weights_path), framework="pt") as f:
        keys = set(f.keys())
        their_d2t = f.get_tensor("d2t").numpy() if "d2t" in keys else None
        their_t2d = f.get_tensor("t2d").numpy() if "t2d" in keys else None
    if their_d2t is None and their_t2d is None and t2d.all() and not d2t.any() and len(d2t) == len(t2d):
        return  # a full-vocabulary drafter, and stage 03 kept the full vocabulary: the identity map either way
    if their_d2t is None or their_t2d is None:
        raise BadInput(
            f"{field}: {weights_path} has no d2t/t2d (a full-vocabulary drafter) but this run uses a "
            f"{d2t.shape[0]}-token draft vocabulary; use the drafter's own vocab map"
        )
    if their_d2t.shape != d2t.shape:
        raise BadInput(
            f"{field}: its draft vocabulary has {their_d2t.shape[0]} tokens, this run's "
            f"{d2t_path} has {d2t.shape[0]}; train with the drafter's own d2t.npy/t2d.npy (vocab.from_drafter)"
        )
    if their_t2d.shape != t2d.shape:
        raise BadInput(f"{field}: its t2d has {their_t2d.shape[0]} entries, this run's {t2d_path} has {t2d.shape[0]}; "
                       f"the drafter was built for another target model")
    if not np.array_equal(their_t2d.astype(bool), t2d) or not np.array_equal(their_d2t.astype(np.int64), d2t):
        differing = int((np.flatnonzero(their_t2d.astype(bool)) != np.flatnonzero(t2d)).sum())
        raise BadInput(
            f"{field}: its draft vocabulary maps {differing} of {d2t.shape[0]} draft ids to other "
            f"target tokens than {d2t_path}; train with the drafter's own d2t.npy/t2d.npy (vocab.from_drafter)"
        )
