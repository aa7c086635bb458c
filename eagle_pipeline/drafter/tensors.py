"""The numbers that fix a drafter's tensor shapes (`DraftDims`, from either config format and either layer shape),
the tensors a config implies, and the ones a folder holds (safetensors headers only); `shape_problems` and
`compare_with_reference` say how they differ, one line per problem (stage 05's `shapes` check, drafter/folder.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from eagle_pipeline.drafter.layouts import (
    FLAT,
    LLAMA,
    MLA,
    MLA_FUSED_QKV_A,
    MLA_QKV_A_PARTS,
    SPECULATORS,
    VERIFIER_ONLY_KEYS,
    config_layout,
    flat_name,
    flat_norm_flags,
    layer_prefix,
    layer_shape,
    speculators_norm_flags,
    weight_files,
)
from eagle_pipeline.errors import BadInput
from eagle_pipeline.vocab_map import safetensors_vocab_map_problems


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # safetensors spelling: BF16, F32, I64, BOOL, ...


@dataclass(frozen=True)
class DraftDims:
    """The numbers that fix every tensor shape of an EAGLE-3 drafter: read from either config format
    (`draft_dims`), or planned from a run config before stage 04 (drafter/planned.py)."""

    format: str  # layouts.FLAT (LlamaForCausalLMEagle3) or layouts.SPECULATORS
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
    # The decoder layer's shape (layouts.LLAMA or layouts.MLA) and, for MLA, its attention's dimensions (the
    # target's: DeepSeek-V3 / Kimi-K2); head_dim is then the query/key head, qk_nope_head_dim + qk_rope_head_dim.
    layer_shape: str = LLAMA
    q_lora_rank: int | None = None  # None: one q_proj instead of q_a_proj / q_a_layernorm / q_b_proj
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0


MLA_DIM_KEYS = ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
MLA_LAYER_KEYS = ("q_lora_rank", *MLA_DIM_KEYS)  # the MLA layer's fields, as the target has them


def mla_dims(layer: dict[str, Any]) -> dict[str, Any]:
    """The MLA attention's dimensions from a config (flat or transformer_layer_config); q_lora_rank may be null."""
    missing = [key for key in (*MLA_DIM_KEYS, "q_lora_rank") if key not in layer]
    if missing:
        raise BadInput(f"drafter config.json has no {missing[0]}; it cannot describe an MLA layer")
    dims = {key: int(layer[key]) for key in MLA_DIM_KEYS}
    q_lora = layer["q_lora_rank"]
    dims["q_lora_rank"] = None if q_lora is None else int(q_lora)
    return dims


def draft_dims(config: dict[str, Any]) -> DraftDims:
    if config_layout(config) == SPECULATORS:
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
    shape = layer_shape(config)
    mla: dict[str, Any] = {}
    if shape == MLA:
        mla = mla_dims(layer)
        # MLA has no key/value heads of its own (one latent for all heads) and no projection biases in vLLM's layer.
        mla |= {"num_key_value_heads": heads, "head_dim": mla["qk_nope_head_dim"] + mla["qk_rope_head_dim"],
                "attention_bias": False, "mlp_bias": False}
    return DraftDims(
        format=fmt,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=mla.pop("num_key_value_heads", None) or int(layer.get("num_key_value_heads") or heads),
        head_dim=mla.pop("head_dim", None) or int(layer.get("head_dim") or hidden // heads),
        intermediate_size=intermediate,
        vocab_size=vocab,
        draft_vocab_size=int(top.get("draft_vocab_size") or vocab),
        num_aux=num_aux,
        target_hidden_size=int(top.get("target_hidden_size") or hidden),
        num_layers=int(layer.get("num_hidden_layers", 1)),
        attention_bias=mla.pop("attention_bias", bool(layer.get("attention_bias", False))),
        mlp_bias=mla.pop("mlp_bias", bool(layer.get("mlp_bias", False))),
        # vLLM's MLA drafter has no input_norm: the flag cannot hold for it.
        norm_before_fc=flags["norm_before_fc"] and shape == LLAMA,
        fc_norm=flags["fc_norm"],
        layer_shape=shape,
        **mla,
    )


def mla_attention_shapes(dims: DraftDims, attn_in: int) -> dict[str, tuple[int, ...]]:
    """The MLA attention's tensors (names inside a layer) as vLLM's DeepseekV2MLAAttention builds them."""
    H, heads = dims.hidden_size, dims.num_attention_heads
    qk_head = dims.qk_nope_head_dim + dims.qk_rope_head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    if dims.q_lora_rank is None:
        shapes["self_attn.q_proj.weight"] = (heads * qk_head, attn_in)
    else:
        shapes |= {"self_attn.q_a_proj.weight": (dims.q_lora_rank, attn_in),
                   "self_attn.q_a_layernorm.weight": (dims.q_lora_rank,),
                   "self_attn.q_b_proj.weight": (heads * qk_head, dims.q_lora_rank)}
    return shapes | {
        "self_attn.kv_a_proj_with_mqa.weight": (dims.kv_lora_rank + dims.qk_rope_head_dim, attn_in),
        "self_attn.kv_a_layernorm.weight": (dims.kv_lora_rank,),
        "self_attn.kv_b_proj.weight": (heads * (dims.qk_nope_head_dim + dims.v_head_dim), dims.kv_lora_rank),
        "self_attn.o_proj.weight": (H, heads * dims.v_head_dim),
    }


def split_fused_tensors(items: dict[str, Any], dims: DraftDims) -> dict[str, Any]:
    """`items` (tensor name -> TensorSpec or tensor) with every MLA `fused_qkv_a_proj` replaced by its two parts,
    named as the unfused layout names them. A fused tensor where the config implies none, or one whose rows are not
    q_lora_rank + kv_lora_rank + qk_rope_head_dim, is refused naming it."""
    fused = [name for name in items if name.endswith(MLA_FUSED_QKV_A)]
    rows = (dims.q_lora_rank, dims.kv_lora_rank + dims.qk_rope_head_dim)
    out = dict(items)
    for name in fused:
        if dims.layer_shape != MLA or dims.q_lora_rank is None:
            raise BadInput(f"{name}: unexpected tensor; only an MLA layer with q_lora_rank fuses q_a_proj and "
                           f"kv_a_proj_with_mqa")
        prefix = name[: -len(MLA_FUSED_QKV_A)]
        parts = [prefix + part for part in MLA_QKV_A_PARTS]
        for part in parts:
            if part in items:
                raise BadInput(f"{name}: holds {part} a second time (fused and unfused); keep one")
        item = out.pop(name)
        shape = tuple(item.shape)
        if len(shape) != 2 or shape[0] != sum(rows):
            raise BadInput(f"{name}: shape {_fmt(shape)} but the config implies [{sum(rows)}, *] "
                           f"(q_lora_rank {rows[0]} + kv_lora_rank + qk_rope_head_dim {rows[1]})")
        pieces = ([TensorSpec((r, shape[1]), item.dtype) for r in rows] if isinstance(item, TensorSpec)
                  else [piece.contiguous() for piece in item.split(list(rows), dim=0)])
        out |= dict(zip(parts, pieces))
    return out


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
        if dims.layer_shape == MLA:
            shapes |= {p + name: shape for name, shape in mla_attention_shapes(dims, attn_in).items()}
        else:
            shapes |= {
                p + "self_attn.q_proj.weight": (q_out, attn_in),
                p + "self_attn.k_proj.weight": (kv_out, attn_in),
                p + "self_attn.v_proj.weight": (kv_out, attn_in),
                p + "self_attn.o_proj.weight": (H, q_out),
            }
        shapes |= {
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
    if config_layout(config) != SPECULATORS:
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
    for name, path in weight_files(Path(model_dir)).items():
        with safe_open(path, framework="pt") as f:
            piece = f.get_slice(name)
            specs[name] = TensorSpec(tuple(piece.get_shape()), piece.get_dtype())
    return specs


FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}


def _fmt(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def _unprefixed_match(name: str, expected: Iterable[str]) -> str | None:
    """`model.midlayer.x` -> `midlayer.x` when that is an expected name (a common export slip)."""
    parts = name.split(".")
    for cut in range(1, len(parts)):
        rest = ".".join(parts[cut:])
        if rest in expected:
            return rest
    return None


def compare_with_reference(specs: dict[str, TensorSpec], reference: dict[str, TensorSpec]) -> list[str]:
    """Tensor-by-tensor differences from a reference drafter (either format; verifier copies ignored)."""
    # Compared under their flat names, so that a speculators checkpoint and a flat folder line up.
    mine = {flat_name(n): s for n, s in specs.items() if n not in VERIFIER_ONLY_KEYS}
    theirs = {flat_name(n): s for n, s in reference.items() if n not in VERIFIER_ONLY_KEYS}
    problems = []
    if "d2t" in mine and "d2t" not in theirs and "lm_head.weight" in mine and "lm_head.weight" in theirs:
        # A full-vocabulary reference fine-tuned to a smaller draft vocabulary (released_drafter.py): its map and
        # its head's rows are this run's; the head's width is still the reference's.
        mine_head, their_head = mine.pop("lm_head.weight"), theirs.pop("lm_head.weight")
        if mine_head.shape[1:] != their_head.shape[1:] or mine_head.shape[0] > their_head.shape[0]:
            problems.append(f"lm_head.weight: shape {_fmt(mine_head.shape)} but the reference has "
                            f"{_fmt(their_head.shape)}")
        for name in ("d2t", "t2d"):
            mine.pop(name, None)
    for name in sorted(theirs.keys() | mine.keys()):
        if name not in mine:
            problems.append(f"{name}: in the reference {_fmt(theirs[name].shape)} but missing here")
        elif name not in theirs:
            problems.append(f"{name}: {_fmt(mine[name].shape)} here but not in the reference")
        elif mine[name].shape != theirs[name].shape:
            problems.append(f"{name}: shape {_fmt(mine[name].shape)} but the reference has {_fmt(theirs[name].shape)}")
        elif mine[name].dtype != theirs[name].dtype and not (
            mine[name].dtype in FLOAT_DTYPES and theirs[name].dtype in FLOAT_DTYPES
        ):
            problems.append(f"{name}: dtype {mine[name].dtype} but the reference has {theirs[name].dtype}")
    return problems


def shape_problems(specs: dict[str, TensorSpec], config: dict[str, Any]) -> list[str]:
    """Every tensor against the shapes and dtypes the config implies; one message per problem."""
    dims = draft_dims(config)
    expected = expected_tensor_specs(config)
    optional = optional_tensor_specs(config)
    problems = []
    for name, spec in sorted(specs.items()):
        if name in expected:
            want = expected[name]
            if spec.shape != want.shape:
                problems.append(f"{name}: shape {_fmt(spec.shape)} but the config implies {_fmt(want.shape)}")
            if want.dtype in ("I64", "BOOL"):
                if spec.dtype != want.dtype:
                    problems.append(f"{name}: dtype {spec.dtype}, expected {want.dtype}"
                                    + ("; a float d2t corrupts target ids" if name == "d2t" else ""))
            elif spec.dtype not in FLOAT_DTYPES:
                problems.append(f"{name}: dtype {spec.dtype}, expected a float dtype")
        elif name in optional:
            if spec.shape != optional[name].shape:
                problems.append(f"{name}: shape {_fmt(spec.shape)} but the config implies {_fmt(optional[name].shape)}")
        elif name == "embed_tokens.weight":
            problems.append("embed_tokens.weight: stray verifier tensor in a flat drafter; the engines share the "
                            "target's embeddings, drop it")
        elif name in VERIFIER_ONLY_KEYS:
            problems.append(f"{name}: stray verifier tensor in a flat drafter; drop it")
        elif (bare := _unprefixed_match(name, expected)) is not None:
            problems.append(f"{name}: prefixed key; the engines expect unprefixed names ({bare})")
        elif dims.draft_vocab_size == dims.vocab_size and name in ("d2t", "t2d"):
            continue  # an identity map with a full vocabulary: loaded and ignored
        else:
            problems.append(f"{name}: unexpected tensor; vLLM's loader raises on unknown keys")
    present = set(specs) | {_unprefixed_match(n, expected) for n in specs}
    for name in sorted(expected.keys() - present):
        if name == "d2t":
            problems.append(f"d2t: missing; with draft_vocab_size {dims.draft_vocab_size} < vocab_size "
                            f"{dims.vocab_size} vLLM would map draft id k to target id k")
        else:
            problems.append(f"{name}: missing (config implies {_fmt(expected[name].shape)})")
    return problems


def vocab_map_problems(model_dir: Path, specs: dict[str, TensorSpec], config: dict[str, Any]) -> list[str]:
    """d2t and t2d agree with each other (only when both are present with the right dtypes and shapes)."""
    dims = draft_dims(config)
    expected = expected_tensor_specs(config)
    if "d2t" not in expected or any(specs.get(n) != expected[n] for n in ("d2t", "t2d")):
        return []
    files = weight_files(model_dir)
    return safetensors_vocab_map_problems(files["d2t"], files["t2d"], dims.vocab_size, dims.draft_vocab_size)


def dflash_tensor_problems(config, specs: dict[str, Any]) -> list[str]:
    """`specs` (name -> TensorSpec) against speculators' DFlashDraftModel built from `config` (a
    DFlashSpeculatorConfig) on the meta device: none missing but what the verifier lends (its head too, for a drafter
    of the whole vocabulary), none it has no place for, every shape its."""
    import torch
    from speculators.models.dflash import DFlashDraftModel

    config.transformer_layer_config._attn_implementation = "sdpa"
    # What the checkpoint leaves to the verifier: its embedding, and its head and final norm (training targets).
    full_vocabulary = config.draft_vocab_size == config.transformer_layer_config.vocab_size
    lent = VERIFIER_ONLY_KEYS + ("lm_head.weight",) * full_vocabulary
    with torch.device("meta"):
        expected = {name: tuple(t.shape) for name, t in DFlashDraftModel(config).state_dict().items()}
    problems = [f"{name}: missing" for name in sorted(set(expected) - set(specs) - set(lent))]
    problems += [f"{name}: no tensor of speculators' DFlashDraftModel for this config"
                 for name in sorted(set(specs) - set(expected))]
    return problems + [f"{name}: shape {list(spec.shape)}, the config implies {list(expected[name])}"
                       for name, spec in sorted(specs.items()) if name in expected
                       and tuple(spec.shape) != expected[name]]
