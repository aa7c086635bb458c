"""The `shapes` check: every tensor of a drafter against the shapes its config implies, its d2t/t2d map,
and tensor by tensor against a reference drafter (its weights, or only its config.json when the weights
are too large to ship)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from eagle_pipeline.drafter_checks.tensors import (
    TensorSpec,
    draft_dims,
    expected_tensor_specs,
    optional_tensor_specs,
    read_tensor_specs,
)
from eagle_pipeline.drafter_format import VERIFIER_ONLY_KEYS, flat_name, weight_files
from eagle_pipeline.errors import BadInput
from eagle_pipeline.vocab_map import safetensors_vocab_map_problems

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
