"""A flat vLLM drafter folder (stage 05's or a released one) as a speculators checkpoint, written by
drafter/to_speculators.py, so the offline replay can run any drafter the engine is asked to serve. The verifier is
the served target, whose embedding the folder gets when it has none (as vLLM shares it). Which modules the
speculators model is built with follows the weights, not the flags: a folder whose `norm_before_fc` says false but
that holds `input_norm.weight` keeps that weight, so a prediction can read the folder both as declared and as it
was probably trained (`drafter.layouts.flat_norm_flags` vs the modules).
"""

from __future__ import annotations

from pathlib import Path

from eagle_pipeline.drafter.folder import engine_layer_ids, read_flat_config, read_flat_tensors
from eagle_pipeline.drafter.layouts import EMBED_KEY, FLAT, WEIGHT_NAMES, flat_norm_flags
from eagle_pipeline.drafter.tensors import draft_dims
from eagle_pipeline.drafter.to_speculators import write_speculators_folder
from eagle_pipeline.errors import BadInput
from eagle_pipeline.verifier import target_embedding


def write_speculators_checkpoint(drafter_dir: str | Path, verifier_dir: str | Path, out_dir: str | Path, *,
                                 speculative_tokens: int) -> Path:
    """Write `drafter_dir` as a speculators EAGLE-3 checkpoint in `out_dir`; returns `out_dir`."""
    import torch

    config = read_flat_config(drafter_dir)
    dims = draft_dims(config)
    tensors = read_flat_tensors(drafter_dir, dims)
    # vLLM shares the target's embedding with a drafter that has none; so does the replay, explicitly
    # (speculators would otherwise keep the uninitialised tensor it allocated).
    embedding = tensors.pop(EMBED_KEY, None)
    if embedding is None:
        embedding = target_embedding(verifier_dir)
    if dims.draft_vocab_size != dims.vocab_size and "d2t" not in tensors:
        # What vLLM does without a map (its zero-initialised d2t): draft id k is target id k. speculators needs
        # the matching t2d to build the verifier's pruned head.
        tensors["d2t"] = torch.zeros(dims.draft_vocab_size, dtype=torch.long)
        tensors["t2d"] = torch.arange(dims.vocab_size) < dims.draft_vocab_size
    if "fc.weight" not in tensors:
        raise BadInput(f"serve.drafter: {drafter_dir} has no fc.weight; it is not an EAGLE-3 drafter")
    # Modules follow the weights (see the module docstring): input_norm, fc_norm.<i>.
    flags = flat_norm_flags(config) | {row.flag: any(row.matches(name, FLAT) for name in tensors)
                                       for row in WEIGHT_NAMES if row.flag}
    num_aux = tensors["fc.weight"].shape[1] // dims.target_hidden_size
    # The ids vLLM's V1 runner takes from the folder (the top level first), else the first num_aux layers.
    ids = engine_layer_ids(config)["v1"] or list(range(num_aux))
    write_speculators_folder(out_dir, config, tensors, embedding=embedding, verifier_dir=verifier_dir,
                             layer_ids=[int(k) for k in ids], flags=flags, speculative_tokens=speculative_tokens)
    return Path(out_dir)
