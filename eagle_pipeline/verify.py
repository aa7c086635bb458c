"""Checks that a drafter folder is what vLLM loads: shapes, config, vLLM's own loader, acceptance parity.

`verify_drafter` returns `{"ok": bool, "checks": {"shapes", "config", "vllm_load", "parity"}}`, each
check with `ok` (bool) and `detail` (CONVENTIONS.md, stage 05's verify.json).

- shapes: tensor names, shapes and dtypes from the safetensors headers (no weights are read, except
  the small d2t/t2d) against the shapes the config implies, and tensor by tensor against a reference
  drafter (its weights, or only its config.json when the weights are too large to ship).
- config: transformers' AutoConfig parses it and keeps the EAGLE-3 fields; vLLM's own config path
  (`EngineArgs.create_engine_config`, which builds the draft ModelConfig and wraps it in EAGLEConfig)
  yields the architecture, vocabularies, norm flags and aux layer ids vLLM will use.
- vllm_load: vLLM's `Eagle3LlamaForCausalLM` is built on the CPU and its real `load_weights` is
  given every tensor of the checkpoint; parameters left at a sentinel value afterwards were not loaded.
- parity: vLLM runs the same prompts greedily with two drafter folders and the accepted tokens per
  draft position are compared.

vLLM work runs in subprocesses (`python -m eagle_pipeline.verify ...`): vLLM spawns workers and keeps
process-global state (distributed groups, current config) that must not leak into the caller.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from eagle_pipeline.convert import (
    FLAT_ARCHITECTURE,
    NORM_FLAGS,
    SPECULATORS_FLAG_DEFAULTS,
    VERIFIER_ONLY_KEYS,
    check_vocab_map,
    flat_key,
    weight_files,
)
from eagle_pipeline.errors import BadInput

CHECK_NAMES = ("shapes", "config", "vllm_load", "parity")
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}
# Parameters vLLM's EAGLE proposer replaces with the target's after loading, so a drafter may omit them.
SHARED_FROM_TARGET = ("model.embed_tokens.weight",)
SUBPROCESS_TIMEOUT_S = 1800


# ----------------------------------------------------------------------------------------------
# Shapes


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str  # safetensors spelling: BF16, F32, I64, BOOL, ...


@dataclass(frozen=True)
class DraftDims:
    """The numbers that fix every tensor shape of an EAGLE-3 drafter, from either config format."""

    format: str  # "flat" (LlamaForCausalLMEagle3) or "speculators"
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
        flags = {name: bool(config.get(name, default)) for name, default in SPECULATORS_FLAG_DEFAULTS.items()}
        fmt = "speculators"
    else:
        layer = top = config
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        num_aux = int(config.get("num_aux_hidden_states") or (len(ids) if ids else 3))
        flags = {name: bool(config.get(name, False)) for name in NORM_FLAGS}
        fmt = "flat"
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


def layer_prefix(dims: DraftDims, index: int) -> str:
    if index == 0 and dims.format == "flat":
        return "midlayer."
    return f"layers.{index}."


def expected_tensor_specs(config: dict[str, Any]) -> dict[str, TensorSpec]:
    """Every tensor the config implies, with its shape; float tensors carry the config's dtype."""
    dims = draft_dims(config)
    dtype = safetensors_dtype(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    H, I = dims.hidden_size, dims.intermediate_size
    q_out = dims.num_attention_heads * dims.head_dim
    kv_out = dims.num_key_value_heads * dims.head_dim
    shapes: dict[str, tuple[int, ...]] = {}
    for index in range(dims.num_layers):
        p = layer_prefix(dims, index)
        # The first layer attends over cat(embeds, hidden), the others over hidden only.
        attn_in = 2 * H if index == 0 else H
        shapes |= {
            p + "self_attn.q_proj.weight": (q_out, attn_in),
            p + "self_attn.k_proj.weight": (kv_out, attn_in),
            p + "self_attn.v_proj.weight": (kv_out, attn_in),
            p + "self_attn.o_proj.weight": (H, q_out),
            p + "mlp.gate_proj.weight": (I, H),
            p + "mlp.up_proj.weight": (I, H),
            p + "mlp.down_proj.weight": (H, I),
            p + "input_layernorm.weight": (H,),
            p + "post_attention_layernorm.weight": (H,),
        }
        if index == 0:
            shapes[p + "hidden_norm.weight"] = (H,)
        if dims.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (q_out,), p + "self_attn.k_proj.bias": (kv_out,),
                       p + "self_attn.v_proj.bias": (kv_out,), p + "self_attn.o_proj.bias": (H,)}
        if dims.mlp_bias:
            shapes |= {p + "mlp.gate_proj.bias": (I,), p + "mlp.up_proj.bias": (I,), p + "mlp.down_proj.bias": (H,)}
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


def canonical_name(name: str) -> str:
    """A name comparable across formats: speculators' `layers.0.` is the flat format's `midlayer.`."""
    return flat_key(name)


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
    mine = {canonical_name(n): s for n, s in specs.items() if n not in VERIFIER_ONLY_KEYS}
    theirs = {canonical_name(n): s for n, s in reference.items() if n not in VERIFIER_ONLY_KEYS}
    problems = []
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
    from safetensors import safe_open

    files = weight_files(model_dir)
    tensors = {}
    for name in ("d2t", "t2d"):
        with safe_open(files[name], framework="pt") as f:
            tensors[name] = f.get_tensor(name)
    try:
        check_vocab_map(tensors["d2t"], tensors["t2d"], dims.vocab_size, dims.draft_vocab_size, "d2t/t2d")
    except BadInput as problem:
        return [str(problem)]
    return []


def reference_specs(reference_dir: Path) -> tuple[dict[str, TensorSpec], str]:
    """A reference drafter's tensors: from its weights, or derived from its config.json alone."""
    config_path = reference_dir / "config.json"
    if not config_path.exists():
        raise BadInput(f"{config_path} is missing; convert.reference_dir must be a drafter folder")
    try:
        return read_tensor_specs(reference_dir), "weights"
    except BadInput:
        config = json.loads(config_path.read_text())
        return expected_tensor_specs(config) | optional_tensor_specs(config), "config.json only"


def check_shapes(drafter_dir: str | Path, reference_dir: str | Path | None = None) -> dict[str, Any]:
    drafter_dir = Path(drafter_dir)
    config = json.loads((drafter_dir / "config.json").read_text())
    specs = read_tensor_specs(drafter_dir)
    problems = shape_problems(specs, config)
    problems += vocab_map_problems(drafter_dir, specs, config)
    detail: dict[str, Any] = {"format": draft_dims(config).format, "num_tensors": len(specs),
                              "tensors": {n: {"shape": list(s.shape), "dtype": s.dtype} for n, s in sorted(specs.items())}}
    if reference_dir is not None:
        ref, source = reference_specs(Path(reference_dir))
        ref_problems = compare_with_reference(specs, ref)
        detail["reference"] = {"dir": str(reference_dir), "source": source, "problems": ref_problems}
        problems += [f"vs reference: {p}" for p in ref_problems]
    detail["problems"] = problems
    return {"ok": not problems, "detail": detail}


# ----------------------------------------------------------------------------------------------
# Config


def _dotted(config: dict[str, Any], key: str) -> Any:
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def flat_config_problems(config: dict[str, Any], target: dict[str, Any], engine: str = "vllm") -> list[str]:
    """Fields the engines read, present and consistent with the target (REFERENCE section 3)."""
    problems = []
    if config.get("architectures") != [FLAT_ARCHITECTURE]:
        problems.append(f"architectures is {config.get('architectures')}, expected [{FLAT_ARCHITECTURE!r}]")
    if config.get("model_type") != "llama":
        problems.append(f"model_type is {config.get('model_type')!r}, expected 'llama'")
    for name in NORM_FLAGS:
        if name not in config:
            problems.append(f"{name} is not written; vLLM's default for a missing flag depends on the format")
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        problems.append("eagle_config.eagle_aux_hidden_state_layer_ids is missing; engines would fall back to defaults")
    if eagle.get("use_aux_hidden_state") is not True:
        problems.append("eagle_config.use_aux_hidden_state is not true")
    if ids and config.get("num_aux_hidden_states") not in (None, len(ids)):
        problems.append(f"num_aux_hidden_states {config.get('num_aux_hidden_states')} != {len(ids)} layer ids")
    if config.get("draft_vocab_size") is None:
        problems.append("draft_vocab_size is missing")
    if engine == "vllm" and config.get("eagle_aux_hidden_state_layer_ids") != ids:
        problems.append("top-level eagle_aux_hidden_state_layer_ids differs from eagle_config's; vLLM's Model "
                        "Runner V2 reads only the top-level one")
    if engine == "sglang":
        problems += [f"{name} is true; SGLang's llama_eagle3 has no such norm variant"
                     for name in NORM_FLAGS if config.get(name)]
        if "eagle_aux_hidden_state_layer_ids" in config:
            problems.append("top-level eagle_aux_hidden_state_layer_ids in an SGLang folder: vLLM would read these "
                            "SGLang-convention (id - 1) ids")
        # SGLang ids are one lower: id j is the output of layer j, so vLLM's range check applies to j + 1.
        ids = [i + 1 for i in ids] if ids else ids
    problems += target_problems(config, target, ids)
    return problems


def target_problems(config: dict[str, Any], target: dict[str, Any], ids: list[int] | None) -> list[str]:
    target = target.get("text_config", target)
    dims = draft_dims(config)
    problems = []
    if dims.vocab_size != int(target["vocab_size"]):
        problems.append(f"vocab_size {dims.vocab_size} != the target's {target['vocab_size']}")
    if dims.target_hidden_size != int(target["hidden_size"]):
        problems.append(f"target_hidden_size {dims.target_hidden_size} != the target's hidden_size {target['hidden_size']}")
    if ids and (min(ids) < 0 or max(ids) > int(target["num_hidden_layers"])):
        problems.append(f"aux layer ids {ids} fall outside the target's 0..{target['num_hidden_layers']}")
    return problems


def expected_problems(config: dict[str, Any], expected: dict[str, Any] | None) -> list[str]:
    problems = []
    for key, want in (expected or {}).items():
        got = _dotted(config, key)
        if got != want:
            problems.append(f"{key} is {got!r}, expected {want!r}")
    return problems


def transformers_parse(drafter_dir: Path, config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Parse with transformers (speculators' own config class for a speculators folder)."""
    problems = []
    try:
        if is_speculators_config(config):
            from speculators.models.eagle3 import Eagle3SpeculatorConfig

            parsed = Eagle3SpeculatorConfig.from_pretrained(str(drafter_dir))
            summary = {"class": type(parsed).__name__, "draft_vocab_size": parsed.draft_vocab_size}
        else:
            from transformers import AutoConfig

            parsed = AutoConfig.from_pretrained(str(drafter_dir))
            summary = {"class": type(parsed).__name__}
            # transformers keeps unknown fields as attributes; a field it dropped would be invisible to SGLang.
            for key in ("draft_vocab_size", "eagle_config", "target_hidden_size", *NORM_FLAGS):
                if key in config and getattr(parsed, key, None) != config[key]:
                    problems.append(f"transformers parses {key} as {getattr(parsed, key, None)!r}, not {config[key]!r}")
            summary["head_dim"] = getattr(parsed, "head_dim", None)
    except Exception as error:  # a parse failure is the finding
        return {"error": f"{type(error).__name__}: {error}"}, [f"transformers cannot parse config.json: {error}"]
    return summary, problems


def check_config(drafter_dir: str | Path, target_dir: str | Path, expected: dict[str, Any] | None,
                 vllm_view: dict[str, Any] | None, engine: str = "vllm") -> dict[str, Any]:
    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    config = json.loads((drafter_dir / "config.json").read_text())
    target = json.loads((target_dir / "config.json").read_text())
    problems: list[str] = []
    if is_speculators_config(config):
        problems += target_problems(config, target, config.get("eagle_aux_hidden_state_layer_ids"))
    else:
        problems += flat_config_problems(config, target, engine)
    problems += expected_problems(config, expected)
    parsed, parse_problems = transformers_parse(drafter_dir, config)
    problems += parse_problems
    detail: dict[str, Any] = {"transformers": parsed}
    if vllm_view is not None:
        detail["vllm"] = vllm_view
        problems += vllm_config_problems(config, vllm_view, check_layer_ids=engine == "vllm")
    detail["problems"] = problems
    return {"ok": not problems, "detail": detail}


def vllm_config_problems(config: dict[str, Any], view: dict[str, Any], check_layer_ids: bool = True) -> list[str]:
    """What vLLM's config path made of the drafter against what the file says (an SGLang folder's ids
    are in SGLang's convention, so they are not compared)."""
    if "error" in view:
        return [f"vLLM's config loader failed: {view['error']}"]
    problems = []
    if view.get("model_class") != "Eagle3LlamaForCausalLM":
        problems.append(f"vLLM resolves the drafter to {view.get('model_class')}, not Eagle3LlamaForCausalLM")
    dims = draft_dims(config)
    if view.get("draft_vocab_size") != dims.draft_vocab_size:
        problems.append(f"vLLM reads draft_vocab_size {view.get('draft_vocab_size')}, the file says {dims.draft_vocab_size}")
    if is_speculators_config(config):
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        flags = {n: bool(config.get(n, True if n == "norm_before_residual" else False)) for n in NORM_FLAGS}
    else:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        flags = {n: bool(config.get(n, False)) for n in NORM_FLAGS}
    for runner, captured in (view.get("aux_layer_ids") or {}).items() if check_layer_ids else ():
        if ids and captured != list(ids):
            problems.append(f"vLLM's {runner} would capture aux layers {captured or 'default'}, the file says "
                            f"{list(ids)}" + ("; write eagle_aux_hidden_state_layer_ids at the top level"
                                              if runner == "model_runner_v2" else ""))
    for name, value in flags.items():
        if view.get("norm_flags", {}).get(name) != value:
            problems.append(f"vLLM reads {name}={view.get('norm_flags', {}).get(name)}, the file means {value}")
    return problems


# ----------------------------------------------------------------------------------------------
# vLLM: config path and load_weights (run in a subprocess through `main`)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_vllm_config(target_dir: str, drafter_dir: str, engine_kwargs: dict[str, Any] | None = None):
    """The VllmConfig `LLM(target, speculative_config={"method": "eagle3", "model": drafter})` would use."""
    from vllm.engine.arg_utils import EngineArgs

    kwargs = {"max_model_len": 512, "enforce_eager": True} | dict(engine_kwargs or {})
    kwargs["tensor_parallel_size"] = 1  # the load check builds the drafter in this one process
    args = EngineArgs(model=target_dir, speculative_config={"method": "eagle3", "model": drafter_dir,
                                                            "num_speculative_tokens": 1}, **kwargs)
    return args.create_engine_config()


def vllm_aux_layer_ids(spec) -> dict[str, list[int] | None]:
    """The aux layer ids each of vLLM's model runners takes from the draft config (None: its defaults).

    The two runners read the config differently (V1: top level, then eagle_config; V2, the default
    where Triton is present: top level, then eagle_config["layer_ids"]), so both are asked.
    """
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))
    v2 = get_eagle3_aux_layers_from_config(spec)
    return {"model_runner_v1": list(v1) if v1 else None, "model_runner_v2": list(v2) if v2 else None}


def vllm_config_view(vllm_config) -> dict[str, Any]:
    from vllm.model_executor.model_loader.utils import get_model_architecture

    spec = vllm_config.speculative_config
    hf = spec.draft_model_config.hf_config
    model_class, _ = get_model_architecture(spec.draft_model_config)
    return {
        "hf_config_class": type(hf).__name__,
        "architectures": list(getattr(hf, "architectures", []) or []),
        "model_class": model_class.__name__,
        "vocab_size": getattr(hf, "vocab_size", None),
        "draft_vocab_size": getattr(hf, "draft_vocab_size", None),
        "aux_layer_ids": vllm_aux_layer_ids(spec),
        "norm_flags": {name: bool(getattr(hf, name, False)) for name in NORM_FLAGS},
        "head_dim": getattr(hf, "head_dim", None),
    }


def vllm_load_weights(vllm_config, drafter_dir: str) -> dict[str, Any]:
    """Build vLLM's drafter class and feed its real load_weights every tensor of the checkpoint.

    Every parameter starts at a sentinel (NaN; -1 for the integer d2t buffer, whose offsets are never
    negative); a parameter that still holds it, wholly or in part (one shard of a fused q/k/v), was
    not loaded.
    """
    import torch
    from safetensors import safe_open
    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.model_executor.model_loader.utils import get_model_architecture

    spec = vllm_config.speculative_config
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{_free_port()}")
        ensure_model_parallel_initialized(1, 1)
        model_class, _ = get_model_architecture(spec.draft_model_config)
        with torch.device("cpu"):
            model = model_class(vllm_config=vllm_config)
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float("nan") if param.is_floating_point() else -1)

        def tensors():
            for name, path in sorted(weight_files(Path(drafter_dir)).items()):
                with safe_open(path, framework="pt") as f:
                    yield name, f.get_tensor(name)

        try:
            model.load_weights(tensors())
        except Exception as error:  # vLLM's refusal is the finding
            return {"ok": False, "model_class": model_class.__name__,
                    "error": f"{type(error).__name__}: {error}"}

    shared = set(SHARED_FROM_TARGET)
    if spec.draft_model_config.hf_config.draft_vocab_size == vllm_config.model_config.get_vocab_size():
        shared.add("lm_head.weight")  # a full-vocabulary drafter may use the target's lm_head
    unloaded = []
    for name, param in model.named_parameters():
        if name in shared or unused_in_forward(name):
            continue
        untouched = torch.isnan(param) if param.is_floating_point() else param == -1
        if bool(untouched.any()):
            part = "" if bool(untouched.all()) else f" ({int(untouched.sum())} of {param.numel()} values)"
            unloaded.append(name + part)
    return {"ok": not unloaded, "model_class": model_class.__name__, "unloaded_parameters": unloaded,
            "has_own_lm_head": bool(getattr(model, "has_own_lm_head", False)),
            "has_own_embed_tokens": bool(getattr(model, "has_own_embed_tokens", False))}


def unused_in_forward(name: str) -> bool:
    """vLLM creates a hidden_norm in every draft layer but only the first one applies it."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.hidden_norm\.weight", name)
    return bool(match) and int(match.group(1)) > 0


def vllm_inspect(target_dir: str, drafter_dir: str, engine_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's config view and load result for a drafter, in this process (call through a subprocess)."""
    try:
        vllm_config = build_vllm_config(target_dir, drafter_dir, engine_kwargs)
        view = vllm_config_view(vllm_config)
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
        return {"config": {"error": message},
                "load": {"ok": False, "error": f"not attempted, vLLM's config loader failed: {message}"}}
    return {"config": view, "load": vllm_load_weights(vllm_config, drafter_dir)}


def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env |= extra or {}
    # The child imports this package from the same checkout as the caller.
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def run_json_subprocess(args: list[str], env: dict[str, str] | None = None,
                        timeout: int = SUBPROCESS_TIMEOUT_S) -> dict[str, Any]:
    """Run `python -m eagle_pipeline.verify ARGS --out FILE` and return FILE's JSON (or the failure)."""
    with tempfile.TemporaryDirectory(prefix="eagle-verify-") as tmp:
        out = Path(tmp) / "result.json"
        log = Path(tmp) / "log.txt"
        with open(log, "wb") as log_file:
            proc = subprocess.run([sys.executable, "-m", "eagle_pipeline.verify", *args, "--out", str(out)],
                                  stdout=log_file, stderr=subprocess.STDOUT, env=subprocess_env(env),
                                  timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"vLLM subprocess {args[0]} exited with {proc.returncode}:\n{tail}")
        return json.loads(out.read_text())


def check_vllm(drafter_dir: str | Path, target_dir: str | Path, *, engine_kwargs: dict[str, Any] | None = None,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """vLLM's view of the config and its load_weights result, from a fresh subprocess."""
    args = ["inspect", "--target", str(target_dir), "--drafter", str(drafter_dir),
            "--engine-kwargs", json.dumps(engine_kwargs or {})]
    try:
        return run_json_subprocess(args, env)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        message = str(error)
        return {"config": {"error": message}, "load": {"ok": False, "error": message}}


# ----------------------------------------------------------------------------------------------
# Parity


def acceptance_run(target_dir: str, drafter_dir: str, prompts: list, num_speculative_tokens: int,
                   max_tokens: int, engine_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Greedy generation with a drafter in vLLM; spec-decode counters from llm.get_metrics()."""
    from vllm import LLM, SamplingParams

    kwargs = {"max_model_len": 1024, "enforce_eager": True, "seed": 0} | dict(engine_kwargs or {})
    llm = LLM(model=target_dir, disable_log_stats=False,
              speculative_config={"method": "eagle3", "model": drafter_dir,
                                  "num_speculative_tokens": num_speculative_tokens}, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if all(isinstance(p, str) for p in prompts):
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outputs = llm.chat(prompts, params, use_tqdm=False)
    counters: dict[str, int] = {}
    per_position: list[int] = [0] * num_speculative_tokens
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            for pos, value in enumerate(metric.values):
                per_position[pos] += int(value)
        elif metric.name.startswith("vllm:spec_decode_num_"):
            key = metric.name.removeprefix("vllm:spec_decode_")
            counters[key] = counters.get(key, 0) + int(metric.value)
    return {
        "drafter": drafter_dir,
        "num_drafts": counters.get("num_drafts", 0),
        "num_draft_tokens": counters.get("num_draft_tokens", 0),
        "num_accepted_tokens": counters.get("num_accepted_tokens", 0),
        "accepted_per_position": per_position,
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
    }


def acceptance_summary(run: dict[str, Any]) -> dict[str, Any]:
    drafts = run["num_drafts"]
    rates = [a / drafts if drafts else 0.0 for a in run["accepted_per_position"]]
    return {
        "drafter": run["drafter"],
        "num_drafts": drafts,
        "accepted_per_position": run["accepted_per_position"],
        "acceptance_rate_per_position": [round(r, 4) for r in rates],
        "mean_acceptance_length": round(1 + run["num_accepted_tokens"] / drafts, 4) if drafts else None,
    }


def compare_acceptance(run_a: dict[str, Any], run_b: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """Per-position acceptance rates (accepted / drafts) must agree within `tolerance`."""
    a, b = acceptance_summary(run_a), acceptance_summary(run_b)
    diffs = [abs(x - y) for x, y in zip(a["acceptance_rate_per_position"], b["acceptance_rate_per_position"])]
    problems = []
    if not a["num_drafts"] or not b["num_drafts"]:
        problems.append("a run made no drafts; spec decoding did not run")
    worst = max(diffs) if diffs else math.inf
    if worst > tolerance:
        pos = diffs.index(worst)
        problems.append(f"position {pos}: acceptance {a['acceptance_rate_per_position'][pos]} vs "
                        f"{b['acceptance_rate_per_position'][pos]} differs by {worst:.4f} > tolerance {tolerance}")
    same_outputs = run_a["output_token_ids"] == run_b["output_token_ids"]
    if not same_outputs:
        problems.append("greedy outputs differ between the two drafters (they must not: the target decides)")
    return {"ok": not problems, "detail": {"a": a, "b": b, "tolerance": tolerance,
                                           "max_rate_difference": round(worst, 6) if diffs else None,
                                           "same_greedy_outputs": same_outputs, "problems": problems}}


def acceptance_parity(target_dir: str | Path, dir_a: str | Path, dir_b: str | Path, prompts: list,
                      num_speculative_tokens: int, max_tokens: int, tolerance: float, *,
                      engine_kwargs: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run vLLM greedily with drafter A (e.g. the speculators checkpoint) and B (its conversion) and
    compare accepted tokens per draft position; `prompts` are strings or chat message lists."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="eagle-parity-") as tmp:
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        for drafter in (dir_a, dir_b):
            args = ["acceptance", "--target", str(target_dir), "--drafter", str(drafter),
                    "--prompts", str(prompts_file), "--num-speculative-tokens", str(num_speculative_tokens),
                    "--max-tokens", str(max_tokens), "--engine-kwargs", json.dumps(engine_kwargs or {})]
            try:
                runs.append(run_json_subprocess(args, env))
            except (RuntimeError, subprocess.TimeoutExpired) as error:
                return {"ok": False, "detail": {"tolerance": tolerance, "problems": [f"{drafter}: {error}"]}}
    return compare_acceptance(runs[0], runs[1], tolerance)


# ----------------------------------------------------------------------------------------------
# All checks


def verify_drafter(drafter_dir: str | Path, *, target_dir: str | Path, reference_dir: str | Path | None = None,
                   expected: dict[str, Any] | None = None, parity_source_dir: str | Path | None = None,
                   parity_prompts: list | None = None, num_speculative_tokens: int = 3, max_tokens: int = 32,
                   tolerance: float = 0.05, engine_kwargs: dict[str, Any] | None = None,
                   env: dict[str, str] | None = None, engine: str = "vllm") -> dict[str, Any]:
    """Run all four checks on a drafter folder; `expected` maps (dotted) config keys to required values.

    `engine` is the engine the folder was written for ("vllm" or "sglang"). Parity runs only for a
    vLLM folder with `parity_source_dir` (the speculators checkpoint) and `parity_prompts`; otherwise
    it is reported as skipped (ok false, skipped true) and left out of the overall `ok`. An SGLang
    folder still goes through vLLM's loader (the same weight names) but its layer ids are SGLang's.
    """
    if engine not in ("vllm", "sglang"):
        raise BadInput(f"engine {engine!r}: expected 'vllm' or 'sglang'")
    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    folders = [(drafter_dir, "drafter"), (target_dir, "target")]
    if reference_dir is not None:
        folders.append((Path(reference_dir), "reference"))
    for path, what in folders:
        if not (path / "config.json").exists():
            raise BadInput(f"{path / 'config.json'} is missing; the {what} folder is not a model folder")
    checks: dict[str, dict[str, Any]] = {}
    try:
        checks["shapes"] = check_shapes(drafter_dir, reference_dir)
    except BadInput as problem:
        checks["shapes"] = {"ok": False, "detail": {"problems": [str(problem)]}}
    vllm = check_vllm(drafter_dir, target_dir, engine_kwargs=engine_kwargs, env=env)
    checks["config"] = check_config(drafter_dir, target_dir, expected, vllm["config"], engine)
    load = vllm["load"]
    checks["vllm_load"] = {"ok": bool(load.get("ok")), "detail": load}
    if engine == "sglang":
        checks["parity"] = {"ok": False, "skipped": True,
                            "detail": "not run: vLLM would read an SGLang folder's layer ids one layer off"}
    elif parity_source_dir is not None and parity_prompts:
        checks["parity"] = acceptance_parity(target_dir, parity_source_dir, drafter_dir, parity_prompts,
                                             num_speculative_tokens, max_tokens, tolerance,
                                             engine_kwargs=engine_kwargs, env=env)
    else:
        checks["parity"] = {"ok": False, "skipped": True,
                            "detail": "not run: no parity_source_dir and parity_prompts given"}
    ran = [c for c in checks.values() if not c.get("skipped")]
    return {"ok": all(c["ok"] for c in ran), "checks": checks}


def _summary(name: str, check: dict[str, Any]) -> str:
    detail = check.get("detail")
    if check.get("skipped"):
        return str(detail)
    if isinstance(detail, dict):
        problems = detail.get("problems") or detail.get("unloaded_parameters") or []
        if detail.get("error"):
            return detail["error"].splitlines()[0][:200]
        if problems:
            more = f" (+{len(problems) - 1} more)" if len(problems) > 1 else ""
            return problems[0][:200] + more
        if name == "parity":
            return (f"per-position acceptance {detail['a']['acceptance_rate_per_position']} vs "
                    f"{detail['b']['acceptance_rate_per_position']} (tolerance {detail['tolerance']})")
        if name == "vllm_load":
            return f"{detail.get('model_class')} loaded every tensor"
        if name == "shapes":
            return f"{detail.get('num_tensors')} tensors match the config" + (
                " and the reference" if "reference" in detail else "")
        if name == "config":
            return "transformers and vLLM read the expected fields"
    return str(detail)[:200]


def format_table(result: dict[str, Any]) -> str:
    """The checks as a fixed-width table: check, result, one-line detail."""
    rows = []
    for name in CHECK_NAMES:
        check = result["checks"].get(name)
        if check is None:
            continue
        status = "SKIP" if check.get("skipped") else ("PASS" if check["ok"] else "FAIL")
        rows.append((name, status, _summary(name, check)))
    width = max(len(r[0]) for r in rows)
    lines = [f"{'check':<{width}}  result  detail", f"{'-' * width}  ------  ------"]
    lines += [f"{n:<{width}}  {s:<6}  {d}" for n, s, d in rows]
    return "\n".join(lines)


def print_table(result: dict[str, Any], file=None) -> None:
    print(format_table(result), file=file or sys.stdout)


# ----------------------------------------------------------------------------------------------
# Subprocess entry points


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="vLLM-side drafter checks (run by eagle_pipeline.verify itself)")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="vLLM config view + load_weights of a drafter")
    accept = sub.add_parser("acceptance", help="greedy generation with a drafter; spec-decode counters")
    for p in (inspect, accept):
        p.add_argument("--target", required=True)
        p.add_argument("--drafter", required=True)
        p.add_argument("--engine-kwargs", default="{}")
        p.add_argument("--out", required=True)
    accept.add_argument("--prompts", required=True)
    accept.add_argument("--num-speculative-tokens", type=int, required=True)
    accept.add_argument("--max-tokens", type=int, required=True)
    args = parser.parse_args(argv)
    engine_kwargs = json.loads(args.engine_kwargs)
    if args.command == "inspect":
        result = vllm_inspect(args.target, args.drafter, engine_kwargs)
    else:
        prompts = json.loads(Path(args.prompts).read_text())
        result = acceptance_run(args.target, args.drafter, prompts, args.num_speculative_tokens,
                                args.max_tokens, engine_kwargs)
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
