"""A flat vLLM drafter folder (`LlamaForCausalLMEagle3`, stage 05's or a released one) as a speculators
checkpoint, so the offline replay can run any drafter the engine is asked to serve.

The inverse of `eagle_pipeline.convert.convert_for_vllm`: the flat config's llama fields become
`transformer_layer_config`, `midlayer.*` becomes `layers.0.*`, and the verifier is the served target (its
`embed_tokens` and final norm are loaded from there, as vLLM shares the target's embedding when the folder
has none). Which modules the speculators model is built with follows the weights, not the flags: a folder
whose `norm_before_fc` says false but that holds `input_norm.weight` keeps that weight, so a prediction can
read the folder both as declared and as it was probably trained (`drafter_format.flat_norm_flags` vs the
modules). The speculators folder is written by flat_to_speculators.py, the writer fine-tuning uses too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle_pipeline.drafter_format import EMBED_KEY, FLAT_ARCHITECTURE, flat_name, flat_norm_flags
from eagle_pipeline.errors import BadInput
from eagle_pipeline.verifier import target_embedding

# Some exports prefix every decoder key with `model.`; the replay reads them as the unprefixed names (the
# shapes check reports them as a slip).
EXPORT_PREFIX = "model."


def read_flat_config(drafter_dir: str | Path) -> dict[str, Any]:
    path = Path(drafter_dir) / "config.json"
    if not path.is_file():
        raise BadInput(f"serve.drafter: {path} is missing; point at a flat {FLAT_ARCHITECTURE} folder")
    config = json.loads(path.read_text())
    if FLAT_ARCHITECTURE not in (config.get("architectures") or []):
        raise BadInput(f"serve.drafter: {path} has architectures {config.get('architectures')}, expected "
                       f"[{FLAT_ARCHITECTURE!r}]; convert a speculators checkpoint with 05_convert.py first")
    return config


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


def read_flat_tensors(drafter_dir: str | Path) -> dict:
    """Every tensor of every .safetensors file in the folder (as vLLM reads a folder), under its flat name."""
    from safetensors import safe_open

    tensors = {}
    for file in sorted(Path(drafter_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({flat_name(name.removeprefix(EXPORT_PREFIX)): f.get_tensor(name) for name in f.keys()})
    return tensors


def write_speculators_checkpoint(drafter_dir: str | Path, verifier_dir: str | Path, out_dir: str | Path, *,
                                 speculative_tokens: int) -> Path:
    """Write `drafter_dir` as a speculators EAGLE-3 checkpoint in `out_dir`; returns `out_dir`."""
    import torch

    from eagle_pipeline.flat_to_speculators import write_speculators_folder

    config = read_flat_config(drafter_dir)
    tensors = read_flat_tensors(drafter_dir)
    # vLLM shares the target's embedding with a drafter that has none; so does the replay, explicitly
    # (speculators would otherwise keep the uninitialised tensor it allocated).
    embedding = tensors.pop(EMBED_KEY, None)
    if embedding is None:
        embedding = target_embedding(verifier_dir)
    draft_vocab, vocab = int(config.get("draft_vocab_size") or config["vocab_size"]), int(config["vocab_size"])
    if draft_vocab != vocab and "d2t" not in tensors:
        # What vLLM does without a map (its zero-initialised d2t): draft id k is target id k. speculators needs
        # the matching t2d to build the verifier's pruned head.
        tensors["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
        tensors["t2d"] = torch.arange(vocab) < draft_vocab
    if "fc.weight" not in tensors:
        raise BadInput(f"serve.drafter: {drafter_dir} has no fc.weight; it is not an EAGLE-3 drafter")
    flags = flat_norm_flags(config)
    # Modules follow the weights (see the module docstring).
    flags["norm_before_fc"] = "input_norm.weight" in tensors
    flags["fc_norm"] = any(name.startswith("fc_norm.") for name in tensors)
    num_aux = tensors["fc.weight"].shape[1] // int(config.get("target_hidden_size") or config["hidden_size"])
    ids = config.get("eagle_aux_hidden_state_layer_ids") or (config.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids") or list(range(num_aux))
    write_speculators_folder(out_dir, config, tensors, embedding=embedding, verifier_dir=verifier_dir,
                             layer_ids=[int(k) for k in ids], flags=flags, speculative_tokens=speculative_tokens)
    return Path(out_dir)
