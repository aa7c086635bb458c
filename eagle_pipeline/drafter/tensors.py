"""The tensors a drafter folder holds and the ones its config.json implies, as names, shapes and dtypes.

Works on either config format (the flat `LlamaForCausalLMEagle3` or speculators' nested one) and reads
only safetensors headers, never tensor data.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle_pipeline.drafter_format import FLAT, SPECULATORS, flat_norm_flags, layer_prefix, speculators_norm_flags, weight_files
from eagle_pipeline.errors import BadInput


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # safetensors spelling: BF16, F32, I64, BOOL, ...


@dataclass(frozen=True)
class DraftDims:
    """The numbers that fix every tensor shape of an EAGLE-3 drafter, from either config format."""

    format: str  # drafter_format.FLAT (LlamaForCausalLMEagle3) or drafter_format.SPECULATORS
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    draft_vocab_size: int
    num_aux: int
    target_hidden_size: int
    num_layers: int
    attention_bias: bool
    mlp_bias: bool
    norm_before_fc: bool
    fc_norm: bool


def is_speculators_config(config: dict[str, Any]) -> bool:
    return "speculators_config" in config


def draft_dims(config: dict[str, Any]) -> DraftDims:
    if is_speculators_config(config):
        layer = config.get("transformer_layer_config") or {}
        top = config
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        num_aux = len(ids) if ids else 3
        flags = speculators_norm_flags(config)
        fmt = SPECULATORS
    else:
        layer = top = config
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        num_aux = int(config.get("num_aux_hidden_states") or (len(ids) if ids else 3))
        flags = flat_norm_flags(config)
        fmt = FLAT
    try:
        hidden = int(layer["hidden_size"])
        heads = int(layer["num_attention_heads"])
        vocab = int(layer["vocab_size"])
        intermediate = int(layer["intermediate_size"])
    except KeyError as missing:
        raise BadInput(f"drafter config.json has no {missing.args[0]}; it cannot describe an EAGLE-3 layer") from None
    return DraftDims(
        format=fmt,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(layer.get("num_key_value_heads") or heads),
        head_dim=int(layer.get("head_dim") or hidden // heads),
        intermediate_size=intermediate,
        vocab_size=vocab,
        draft_vocab_size=int(top.get("draft_vocab_size") or vocab),
        num_aux=num_aux,
        target_hidden_size=int(top.get("target_hidden_size") or hidden),
        num_layers=int(layer.get("num_hidden_layers", 1)),
        attention_bias=bool(layer.get("attention_bias", False)),
        mlp_bias=bool(layer.get("mlp_bias", False)),
        norm_before_fc=flags["norm_before_fc"],
        fc_norm=flags["fc_norm"],
    )


def expected_tensor_specs(config: dict[str, Any]) -> dict[str, TensorSpec]:
    """Every tensor the config implies, with its shape; float tensors carry the config's dtype."""
    dims = draft_dims(config)
    dtype = safetensors_dtype(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    H, FF = dims.hidden_size, dims.intermediate_size
    q_out = dims.num_attention_heads * dims.head_dim
    kv_out = dims.num_key_value_heads * dims.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for index in range(dims.num_layers):
        p = layer_prefix(index, dims.format)
        # The first layer attends over cat(embeds, hidden), the others over hidden only.
        attn_in = 2 * H if index == 0 else H
        shapes |= {
            p + "self_attn.q_proj.weight": (q_out, attn_in),
            p + "self_attn.k_proj.weight": (kv_out, attn_in),
            p + "self_attn.v_proj.weight": (kv_out, attn_in),
            p + "self_attn.o_proj.weight": (H, q_out),
            p + "mlp.gate_proj.weight": (FF, H),
            p + "mlp.up_proj.weight": (FF, H),
            p + "mlp.down_proj.weight": (H, FF),
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
        }
        if index == 0:
            shapes[p + "hidden_norm.weight"] = (H,)
        if dims.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                       p + "self_attn.v_proj.bias": (kv_out,), p + "self_attn.o_proj.bias": (H,)}
        if dims.mlp_bias:
            shapes |= {p + "mlp.gate_proj.bias": (FF,), p + "mlp.up_proj.bias": (FF,), p + "mlp.down_proj.bias": (H,)}
    fc_in = dims.num_aux * dims.target_hidden_size
    shapes |= {"fc.weight": (H, fc_in), "norm.weight": (H,), "lm_head.weight": (dims.draft_vocab_size, H)}
    if dims.norm_before_fc:
        shapes["input_norm.weight"] = (fc_in,)
    if dims.fc_norm:
        shapes |= {f"fc_norm.{i}.weight": (dims.target_hidden_size,) for i in range(dims.num_aux)}
    specs = {name: TensorSpec(shape, dtype) for name, shape in shapes.items()}
    if dims.draft_vocab_size != dims.vocab_size:
        specs["d2t"] = TensorSpec((dims.draft_vocab_size,), "I64")
        specs["t2d"] = TensorSpec((dims.vocab_size,), "BOOL")
    return specs


def optional_tensor_specs(config: dict[str, Any]) -> dict[str, TensorSpec]:
    """Tensors a speculators checkpoint may carry besides the drafter's own (the verifier's copies)."""
    if not is_speculators_config(config):
        return {}
    dims = draft_dims(config)
    dtype = safetensors_dtype(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return {
        "embed_tokens.weight": TensorSpec((dims.vocab_size, dims.hidden_size), dtype),
        "verifier_lm_head.weight": TensorSpec((dims.draft_vocab_size, dims.hidden_size), dtype),
        "verifier_norm.weight": TensorSpec((dims.hidden_size,), dtype),
    }


_TORCH_TO_SAFETENSORS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}


def safetensors_dtype(torch_dtype: str) -> str:
    return _TORCH_TO_SAFETENSORS.get(str(torch_dtype).removeprefix("torch."), str(torch_dtype).upper())


def read_tensor_specs(model_dir: str | Path) -> dict[str, TensorSpec]:
    """Names, shapes and dtypes from the safetensors headers; no tensor data is read."""
    from safetensors import safe_open

    specs: dict[str, TensorSpec] = {}
    files: dict[Path, list[str]] = {}
    for name, path in weight_files(Path(model_dir)).items():
        files.setdefault(path, []).append(name)
    for path, names in files.items():
        with safe_open(path, framework="pt") as f:
            for name in names:
                piece = f.get_slice(name)
                specs[name] = TensorSpec(tuple(piece.get_shape()), piece.get_dtype())
    return specs
