"""A flat vLLM drafter folder (`LlamaForCausalLMEagle3`, stage 05's or a released one) as a speculators
checkpoint, so the offline replay can run any drafter the engine is asked to serve.

The inverse of `eagle_pipeline.convert.convert_for_vllm`: the flat config's llama fields become
`transformer_layer_config`, `midlayer.*` becomes `layers.0.*`, and the verifier is the served target (its
`embed_tokens` and final norm are loaded from there, as vLLM shares the target's embedding when the folder
has none). Which modules the speculators model is built with follows the weights, not the flags: a folder
whose `norm_before_fc` says false but that holds `input_norm.weight` keeps that weight, so a prediction can
read the folder both as declared and as it was probably trained (`drafter.layouts.flat_norm_flags` vs the
modules). The speculators folder is written by drafter/to_speculators.py, the writer fine-tuning uses too.
"""

from __future__ import annotations

from pathlib import Path

# The folder is read by drafter/folder.py; stage 06 imports flat_tensor_names and read_flat_config from here.
from eagle_pipeline.drafter.folder import (  # noqa: F401 - flat_tensor_names
    engine_layer_ids,
    flat_tensor_names,
    read_flat_config,
    read_flat_tensors,
)
from eagle_pipeline.drafter.layouts import EMBED_KEY, flat_norm_flags
from eagle_pipeline.drafter.to_speculators import write_speculators_folder
from eagle_pipeline.errors import BadInput
from eagle_pipeline.verifier import target_embedding


def write_speculators_checkpoint(drafter_dir: str | Path, verifier_dir: str | Path, out_dir: str | Path, *,
                                 speculative_tokens: int) -> Path:
    """Write `drafter_dir` as a speculators EAGLE-3 checkpoint in `out_dir`; returns `out_dir`."""
    import torch

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
    # The ids vLLM's V1 runner takes from the folder (the top level first), else the first num_aux layers.
    ids = engine_layer_ids(config)["v1"] or list(range(num_aux))
    write_speculators_folder(out_dir, config, tensors, embedding=embedding, verifier_dir=verifier_dir,
                             layer_ids=[int(k) for k in ids], flags=flags, speculative_tokens=speculative_tokens)
    return Path(out_dir)
