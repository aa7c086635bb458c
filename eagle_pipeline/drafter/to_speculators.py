"""A flat drafter written as a speculators EAGLE-3 checkpoint, the inverse of convert.py: for fine-tuning
(released_drafter.py) and the offline replay (predict/flat_drafter.py), since speculators reads only its own layout
(docs/released_drafters.md, "What a released folder holds"). Which embedding, which aux layer ids and which norm
flags are the caller's to decide, since fine-tuning and the replay read a flat folder differently.

speculators 0.9's own converter (`speculators/convert/eagle/eagle3_converter.py`) is not used: it loads the tensors
with `strict=False`, so an absent `embed_tokens` stays randomly initialised; it renames `midlayer.*` only; it fills
every absent dimension with a default (vocabulary 128000, ...) instead of refusing; it fixes the speculative token
count at 3 and writes in place, not atomically. Its config classes are used.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle_pipeline.atomic import atomic_dir
from eagle_pipeline.drafter.layouts import (
    EMBED_KEY,
    MLA,
    NORM_FLAGS,
    SPECULATORS_ARCHITECTURE,
    SPECULATORS_LAYER_TYPES,
    WEIGHTS_NAME,
    speculators_name,
)
from eagle_pipeline.drafter.tensors import MLA_LAYER_KEYS, draft_dims

if TYPE_CHECKING:
    import torch


# The rope parameters an MLA layer is compared by (rope_theta aside): YaRN's, which fix its cos/sin and softmax scale.
MLA_ROPE_KEYS = ("rope_type", "factor", "mscale", "mscale_all_dim", "original_max_position_embeddings", "beta_fast",
                 "beta_slow")


def rope_parameters(c: dict[str, Any]) -> dict[str, Any]:
    """A flat config's rope as transformers 5's `rope_parameters`, from either spelling."""
    params = dict(c.get("rope_parameters") or {})
    if not params:  # transformers 4 spelling (SpecForge, the released drafters): rope_theta + rope_scaling
        scaling = dict(c.get("rope_scaling") or {})
        if "type" in scaling and "rope_type" not in scaling:  # the older key of the same field
            scaling["rope_type"] = scaling.pop("type")
        params = {"rope_type": "default", **scaling}
        params["rope_theta"] = float(c.get("rope_theta", 10000.0))
    return params


def decoder_config(flat_config: dict[str, Any]) -> dict[str, Any]:
    """The draft decoder of a flat config as speculators' transformer_layer_config: a LlamaConfig dict, or an MLA
    layer's as a DeepseekV3Config dict (one dense SwiGLU layer: first_k_dense_replace covers every layer, no MoE;
    the target's MLA dimensions, interleaved rope)."""
    c = flat_config
    dims = draft_dims(c)
    mla = dims.layer_shape == MLA
    config = {
        "model_type": SPECULATORS_LAYER_TYPES[dims.layer_shape],
        "vocab_size": dims.vocab_size,
        "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size,
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.num_attention_heads,
        "num_key_value_heads": dims.num_key_value_heads,
        "hidden_act": c.get("hidden_act", "silu"),
        "rms_norm_eps": float(c.get("rms_norm_eps", 1e-6)),
        "max_position_embeddings": int(c.get("max_position_embeddings", 4096 if mla else 2048)),
        "rope_parameters": rope_parameters(c),
        "attention_bias": dims.attention_bias,
        "tie_word_embeddings": False,
    }
    if mla:
        return config | {"first_k_dense_replace": dims.num_layers,
                         **{key: getattr(dims, key) for key in MLA_LAYER_KEYS},
                         "rope_interleave": bool(c.get("rope_interleave", True))}
    # vLLM serves EAGLE-3 drafters with full attention.
    return config | {"head_dim": dims.head_dim, "mlp_bias": dims.mlp_bias,
                     "layer_types": ["full_attention"] * dims.num_layers}


def speculators_config(flat_config: dict[str, Any], *, verifier_dir: Path, layer_ids: list[int],
                       flags: dict[str, bool], speculative_tokens: int):
    """speculators' `Eagle3SpeculatorConfig` for the drafter a flat config describes; `layer_ids` are HF indices."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import DeepseekV3Config, LlamaConfig

    dims = draft_dims(flat_config)
    layer_class = DeepseekV3Config if dims.layer_shape == MLA else LlamaConfig
    config = Eagle3SpeculatorConfig(
        architectures=[SPECULATORS_ARCHITECTURE],
        transformer_layer_config=layer_class(**decoder_config(flat_config)),
        draft_vocab_size=dims.draft_vocab_size,
        target_hidden_size=dims.target_hidden_size,
        eagle_aux_hidden_state_layer_ids=[int(k) for k in layer_ids],
        **{name: bool(flags[name]) for name in NORM_FLAGS},
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=speculative_tokens)],
            default_proposal_method="greedy",
            verifier=VerifierConfig.from_pretrained(str(verifier_dir)),
        ),
    )
    # transformers loads weights in the dtype a config names (speculators' checkpoints name theirs): without
    # one, bf16 weights would be upcast and the drafter would train and validate in another precision than a
    # speculators checkpoint of the same weights.
    dtype = flat_config.get("torch_dtype") or flat_config.get("dtype")
    if dtype:
        config.dtype = dtype
    return config


def write_speculators_folder(out_dir: str | Path, flat_config: dict[str, Any], tensors: dict[str, torch.Tensor], *,
                             embedding: torch.Tensor, verifier_dir: str | Path, layer_ids: list[int],
                             flags: dict[str, bool], speculative_tokens: int) -> dict[str, Any]:
    """Write the drafter of `flat_config` and `tensors` (as folder.read_flat_tensors reads them, without
    `embed_tokens`) in speculators' layout, atomically: config.json + model.safetensors. `embedding` is stored in
    the drafter's precision. Returns what was written."""
    from safetensors.torch import save_file

    config = speculators_config(flat_config, verifier_dir=Path(verifier_dir), layer_ids=layer_ids, flags=flags,
                                speculative_tokens=speculative_tokens)
    written = {speculators_name(name): tensor.contiguous() for name, tensor in sorted(tensors.items())}
    if EMBED_KEY in written:
        raise ValueError(f"pass the embedding as `embedding`, not among the drafter's tensors ({EMBED_KEY})")
    written[EMBED_KEY] = embedding.to(written["fc.weight"].dtype).contiguous()
    with atomic_dir(out_dir) as tmp:
        config.save_pretrained(str(tmp))
        save_file(written, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
    return {"dir": str(out_dir), "tensors": len(written)}
