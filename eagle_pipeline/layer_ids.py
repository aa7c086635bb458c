"""Aux hidden-state layer ids: the one rule for what an id means, which ids are valid, and how each engine
spells them (docs/layer_ids.md). Ids are HF `output_hidden_states` indices everywhere (vLLM's and speculators'
convention; SGLang's id k is HF index k+1); the final layer L is always captured as the last slot, so valid aux
ids lie in 1..L-1, strictly increasing (vLLM returns states in layer order and merges duplicates).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from eagle_pipeline.errors import BadInput

Convention = Literal["hf", "vllm", "sglang"]


def default_layer_ids(num_layers: int) -> list[int]:
    """(2, L//2, L-3): early, middle and late layers; (2, 30, 58) for Kimi-K2.5's 61 layers."""
    return [2, num_layers // 2, num_layers - 3]


def order_problem(ids: Sequence[object]) -> str | None:
    """What is wrong with a list of ids before the model's depth is known, or None."""
    if not ids:
        return "must not be empty; leave it out for the default (2, L//2, L-3)"
    if any(not isinstance(k, int) or isinstance(k, bool) for k in ids):
        return f"expected a list of integers, got {list(ids)!r}"
    if len(set(ids)) != len(ids):
        return f"has duplicates {list(ids)}; give each layer once"
    if list(ids) != sorted(ids):
        return f"must be in increasing order (vLLM returns the states in layer order), got {list(ids)}; sort them"
    return None


def check_layer_ids(ids: Sequence[int], num_layers: int, field: str = "hidden_states.layer_ids") -> list[int]:
    """Validated aux ids (HF convention) for a `num_layers`-layer target; BadInput names `field` otherwise."""
    problem = order_problem(ids)
    if problem:
        raise BadInput(f"{field}: {problem}")
    for k in ids:
        if not 0 < k < num_layers:
            raise BadInput(
                f"{field}: {k} is out of range for a {num_layers}-layer verifier; use ids in 1..{num_layers - 1} "
                f"(the final layer {num_layers} is always captured as well)"
            )
    return [int(k) for k in ids]


def resolve_layer_ids(configured: Sequence[int] | None, num_layers: int,
                      field: str = "hidden_states.layer_ids") -> list[int]:
    """The configured ids, or the default ones, checked against the target's depth."""
    return check_layer_ids(list(configured) if configured is not None else default_layer_ids(num_layers), num_layers,
                           field)


def capture_layer_ids(aux_ids: Sequence[int], num_layers: int) -> list[int]:
    """What vLLM's extract_hidden_states is asked for: the aux ids plus the final layer (pre-norm) last."""
    return check_layer_ids(aux_ids, num_layers, field="layer_ids") + [num_layers]


def to_convention(ids: Sequence[int], convention: Convention) -> list[int]:
    """Pipeline (HF-index) ids as `convention` writes them."""
    shift = -1 if convention == "sglang" else 0
    return [int(k) + shift for k in ids]


def from_convention(ids: Sequence[int], convention: Convention) -> list[int]:
    """Ids written in `convention` as pipeline (HF-index) ids."""
    shift = 1 if convention == "sglang" else 0
    return [int(k) + shift for k in ids]


def vllm_read_aux_ids(config: dict) -> dict[str, list[int] | None]:
    """The aux ids vLLM 0.32 takes from a flat drafter config, by model runner (None: the target's defaults), as
    docs/engines.md, "vLLM model runner V2" cites vLLM's code: V1 the top-level
    `eagle_aux_hidden_state_layer_ids`, else `eagle_config`'s; V2 the top level only, else
    `eagle_config["layer_ids"]`."""
    # A speculators DFlash folder names them aux_hidden_state_layer_ids, which vLLM writes to the top level
    # (transformers_utils/configs/speculators/algos.py, update_dflash).
    top = config.get("eagle_aux_hidden_state_layer_ids") or config.get("aux_hidden_state_layer_ids") or None
    eagle = config.get("eagle_config") if isinstance(config.get("eagle_config"), dict) else {}
    v1 = top or eagle.get("eagle_aux_hidden_state_layer_ids") or None
    v2 = top or eagle.get("layer_ids") or None
    return {"v1": None if v1 is None else [int(k) for k in v1], "v2": None if v2 is None else [int(k) for k in v2]}
