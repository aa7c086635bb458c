"""The `shapes` check: every tensor of a drafter against the shapes its config implies, its d2t/t2d map,
and tensor by tensor against a reference drafter (its weights, or only its config.json when the weights
are too large to ship). What a folder should hold is eagle_pipeline.drafter.tensors'; this module runs it as
stage 05's check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle_pipeline.drafter.tensors import (
    TensorSpec,
    compare_with_reference,
    draft_dims,
    expected_tensor_specs,
    optional_tensor_specs,
    read_tensor_specs,
    shape_problems,
    split_fused_tensors,
    vocab_map_problems,
)
from eagle_pipeline.errors import BadInput


def reference_specs(reference_dir: Path) -> tuple[dict[str, TensorSpec], str]:
    """A reference drafter's tensors: from its weights, or derived from its config.json alone."""
    config_path = reference_dir / "config.json"
    if not config_path.exists():
        raise BadInput(f"{config_path} is missing; convert.reference_dir must be a drafter folder")
    config = json.loads(config_path.read_text())
    try:
        specs = read_tensor_specs(reference_dir)
    except BadInput:
        return expected_tensor_specs(config) | optional_tensor_specs(config), "config.json only"
    # A released MLA drafter may store fused_qkv_a_proj; it is compared as the two projections a folder writes.
    return split_fused_tensors(specs, draft_dims(config)), "weights"


def check_shapes(drafter_dir: str | Path, reference_dir: str | Path | None = None) -> dict[str, Any]:
    drafter_dir = Path(drafter_dir)
    config = json.loads((drafter_dir / "config.json").read_text())
    # vLLM loads an MLA layer's fused_qkv_a_proj as it stands; the shapes are those of its two parts.
    dims = draft_dims(config)
    specs = split_fused_tensors(read_tensor_specs(drafter_dir), dims)
    problems = shape_problems(specs, config)
    problems += vocab_map_problems(drafter_dir, specs, config)
    detail: dict[str, Any] = {"format": dims.format, "num_tensors": len(specs),
                              "tensors": {n: {"shape": list(s.shape), "dtype": s.dtype}
                                          for n, s in sorted(specs.items())}}
    if reference_dir is not None:
        ref, source = reference_specs(Path(reference_dir))
        ref_problems = compare_with_reference(specs, ref)
        detail["reference"] = {"dir": str(reference_dir), "source": source, "problems": ref_problems}
        problems += [f"vs reference: {p}" for p in ref_problems]
    detail["problems"] = problems
    return {"ok": not problems, "detail": detail}
