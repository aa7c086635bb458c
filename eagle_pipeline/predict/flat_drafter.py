"""A flat vLLM drafter folder (`LlamaForCausalLMEagle3`, stage 05's or a released one) as a speculators
checkpoint, so the offline replay can run any drafter the engine is asked to serve.

The inverse of `eagle_pipeline.convert.convert_for_vllm`: the flat config's llama fields become
`transformer_layer_config`, `midlayer.*` becomes `layers.0.*`, and the verifier is the served target (its
`embed_tokens` and final norm are loaded from there, as vLLM shares the target's embedding when the folder
has none). Which modules the speculators model is built with follows the weights, not the flags: a folder
whose `norm_before_fc` says false but that holds `input_norm.weight` keeps that weight, so a prediction can
read the folder both as declared and as it was probably trained (`declared_flags` vs the modules).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from eagle_pipeline import atomic
from eagle_pipeline.errors import BadInput
from eagle_pipeline.predict.speculators_drafter import NORM_FLAGS
from eagle_pipeline.verifier import target_embedding

FLAT_ARCHITECTURE = "LlamaForCausalLMEagle3"
_LAYER_FIELDS = ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads", "intermediate_size",
                 "hidden_act", "rms_norm_eps", "max_position_embeddings", "rope_parameters", "rope_theta",
                 "rope_scaling", "attention_bias", "mlp_bias", "num_hidden_layers", "vocab_size")
# vLLM reads a flag missing from a flat config as false (llama_eagle3.py getattr(..., False)); norm_before_fc
# is read from eagle_config first.
_FLAT_FLAG_DEFAULT = False


def read_flat_config(drafter_dir: str | Path) -> dict[str, Any]:
    path = Path(drafter_dir) / "config.json"
    if not path.is_file():
        raise BadInput(f"serve.drafter: {path} is missing; point at a flat {FLAT_ARCHITECTURE} folder")
    config = json.loads(path.read_text())
    if FLAT_ARCHITECTURE not in (config.get("architectures") or []):
        raise BadInput(f"serve.drafter: {path} has architectures {config.get('architectures')}, expected "
                       f"[{FLAT_ARCHITECTURE!r}]; convert a speculators checkpoint with 05_convert.py first")
    return config


def declared_flags(config: dict[str, Any]) -> dict[str, bool]:
    """The norm flags as vLLM's llama_eagle3 reads them from a flat config."""
    eagle = config.get("eagle_config") or {}
    flags = {name: bool(config.get(name, _FLAT_FLAG_DEFAULT)) for name in NORM_FLAGS}
    flags["norm_before_fc"] = bool(eagle.get("norm_before_fc", flags["norm_before_fc"]))
    return flags


def flat_tensor_names(drafter_dir: str | Path) -> list[str]:
    from safetensors import safe_open

    files = sorted(Path(drafter_dir).glob("*.safetensors"))
    if not files:
        raise BadInput(f"serve.drafter: {drafter_dir} holds no .safetensors weights")
    names = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            names += list(f.keys())
    return names


def speculators_key(name: str) -> str:
    return re.sub(r"^midlayer\.", "layers.0.", re.sub(r"^model\.", "", name))


def write_speculators_checkpoint(drafter_dir: str | Path, verifier_dir: str | Path, out_dir: str | Path) -> Path:
    """Write `drafter_dir` as a speculators EAGLE-3 checkpoint in `out_dir`; returns `out_dir`."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    config = read_flat_config(drafter_dir)
    tensors = {}
    for file in sorted(Path(drafter_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({speculators_key(name): tensor.float() if tensor.is_floating_point() else tensor
                            for name in f.keys() for tensor in [f.get_tensor(name)]})
    if "embed_tokens.weight" not in tensors:
        # vLLM shares the target's embedding with a drafter that has none; so does the replay, explicitly
        # (speculators would otherwise keep the uninitialised tensor it allocated).
        tensors["embed_tokens.weight"] = target_embedding(verifier_dir)
    draft_vocab, vocab = int(config.get("draft_vocab_size") or config["vocab_size"]), int(config["vocab_size"])
    if draft_vocab != vocab and "d2t" not in tensors:
        # What vLLM does without a map (its zero-initialised d2t): draft id k is target id k. speculators needs
        # the matching t2d to build the verifier's pruned head.
        import torch

        tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
        tensors["t2d"] = torch.arange(vocab) < draft_vocab
    if "fc.weight" not in tensors:
        raise BadInput(f"serve.drafter: {drafter_dir} has no fc.weight; it is not an EAGLE-3 drafter")
    flags = declared_flags(config)
    # Modules follow the weights (see the module docstring).
    flags["norm_before_fc"] = "input_norm.weight" in tensors
    flags["fc_norm"] = any(name.startswith("fc_norm.") for name in tensors)
    layer = {key: config[key] for key in _LAYER_FIELDS if config.get(key) is not None}
    layer.setdefault("rope_parameters", {"rope_theta": config.get("rope_theta", 10000.0), "rope_type": "default"})
    layer.update(model_type="llama", tie_word_embeddings=False)
    num_aux = tensors["fc.weight"].shape[1] // int(config.get("target_hidden_size") or config["hidden_size"])
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or list(range(num_aux))
    spec_config = {
        "architectures": ["Eagle3DraftModel"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": int(config.get("draft_vocab_size") or config["vocab_size"]),
        "eagle_aux_hidden_state_layer_ids": [int(k) for k in ids],
        **flags,
        "target_hidden_size": config.get("target_hidden_size"),
        "tie_word_embeddings": False,
        "embed_requires_grad": False,
        "transformer_layer_config": layer,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3, "accept_tolerance": 0.0,
                                  "verifier_accept_k": 1}],
            "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": str(verifier_dir)},
        },
    }
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic.write_json(out_dir / "config.json", spec_config)
    atomic.write_with(out_dir / "model.safetensors",
                      lambda tmp: save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp)))
    return out_dir
