"""The drafter stage 04 will train, planned from the run config and the target's config before it exists: its
dimensions in speculators' layout (`planned_draft_dims`, the numbers `tensors.DraftDims` holds for a folder) and
the parameters they make. The disk plan, the online memory plan and the engine rehearsal's stand-in folder are built
from it; stage 04 builds the same layer (train/draft_config.py), and tests/test_preconditions.py holds the two equal.
"""

from __future__ import annotations

import math

from eagle_pipeline.drafter.layouts import DFLASH, LLAMA, MLA, SPECULATORS
from eagle_pipeline.drafter.tensors import DraftDims, mla_attention_shapes


def planned_draft_dims(cfg, verifier, n_aux: int) -> DraftDims:
    """The drafter stage 04 will train, in speculators' layout: train.draft_shape where given, the verifier's
    decoder shape otherwise (a DFlash drafter's train.dflash.num_layers)."""
    text = verifier.text_config()
    shape = cfg.train.draft_shape.model_dump(exclude_none=True) if cfg.train.draft_shape else {}
    hidden = shape.get("hidden_size", verifier.hidden_size)
    heads = shape.get("num_attention_heads", text.get("num_attention_heads"))
    same = dict(format=SPECULATORS, hidden_size=hidden, num_attention_heads=heads,
                intermediate_size=shape.get("intermediate_size", text.get("intermediate_size")),
                vocab_size=verifier.vocab_size, draft_vocab_size=cfg.vocab.draft_vocab_size, num_aux=n_aux,
                target_hidden_size=verifier.hidden_size, attention_bias=False, mlp_bias=False,
                fc_norm=bool(cfg.train.fc_norm))
    if cfg.train.draft_layer == MLA:  # the verifier's MLA attention, one dense layer (train/draft_config.py)
        q_lora = text.get("q_lora_rank")
        nope, rope = int(text["qk_nope_head_dim"]), int(text["qk_rope_head_dim"])
        return DraftDims(**same, num_key_value_heads=heads, head_dim=nope + rope, num_layers=1, norm_before_fc=False,
                         layer_shape=MLA, q_lora_rank=None if q_lora is None else int(q_lora),
                         kv_lora_rank=int(text["kv_lora_rank"]), qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                         v_head_dim=int(text["v_head_dim"]))
    dflash = cfg.train.family == "dflash"
    return DraftDims(**same, head_dim=shape.get("head_dim", text.get("head_dim") or hidden // heads),
                     num_key_value_heads=shape.get("num_key_value_heads", text.get("num_key_value_heads", heads)),
                     num_layers=int(shape.get("num_hidden_layers", cfg.train.dflash.num_layers if dflash else 1)),
                     norm_before_fc=bool(cfg.train.norm_before_fc) and not dflash,
                     layer_shape=DFLASH if dflash else LLAMA)


def layer_params(dims: DraftDims, first: bool = True) -> int:
    """One decoder layer of the drafter (the first reads 2 x hidden: embeddings and fc's output). An MLA layer's
    attention tensors as the drafter folder counts them and its three norms: every tensor saved; a Llama layer
    without its norms."""
    hidden, heads, kv_heads = dims.hidden_size, dims.num_attention_heads, dims.num_key_value_heads
    head_dim = dims.head_dim
    attn_in = 2 * hidden if first else hidden
    mlp = 3 * hidden * dims.intermediate_size
    if dims.layer_shape == MLA:
        return sum(math.prod(s) for s in mla_attention_shapes(dims, attn_in).values()) + mlp + 3 * hidden
    return attn_in * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + mlp


def drafter_params(dims: DraftDims) -> int:
    """speculators' Eagle3DraftModel as saved: fc, decoder layers (the first reads 2 x hidden), lm_head and
    embed_tokens; the final norm where the layer is MLA (every tensor its checkpoint saves). A DFlashDraftModel the
    same, every layer reading the hidden width."""
    hidden = dims.hidden_size
    final_norm = hidden if dims.layer_shape == MLA else 0
    return (dims.num_aux * dims.target_hidden_size * hidden + layer_params(dims, first=dims.layer_shape != DFLASH)
            + (dims.num_layers - 1) * layer_params(dims, first=False) + final_norm
            + dims.draft_vocab_size * hidden + dims.vocab_size * hidden)
