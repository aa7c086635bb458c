"""A DFlash drafter's block drafting replayed offline: the counts vLLM's DFlashProposer reports at temperature 0.

What vLLM 0.32 does (v1/spec_decode/dflash.py): once the target has emitted x_p (the anchor), the drafter reads the
target's aux states of rows < p (their keys and values precomputed into its cache) and one query block
[x_p, mask x k] at positions p..p+k; its k mask slots draft x_{p+1..p+k}, all in one pass. Verification and counting
are EAGLE-3's (predict/simulate.py).

Every anchor's block depends on the target's states alone, so all anchors of a conversation are drafted by the
checkpoint's own training forward (speculators' `DFlashDraftModel._backbone_forward`, its loss mask 1 at the
anchors), its block length set to the k + 1 tokens vLLM queries: served with k < block_size - 1, the bidirectional
block is shorter than in training, and so are the drafts' inputs. The drafts of anchor p fill row p - 1 of
simulate.draft_table's layout (the chain whose context ends at p - 1), so `walk_chains` follows the chains vLLM
runs, tail rule included.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from eagle_pipeline.predict.simulate import AcceptanceCounts, walk_chains
from eagle_pipeline.predict.variants import Sample, serving_inputs

# Anchors drafted per forward pass: the dense anchor-block mask grows with their number times the sequence.
ANCHORS_PER_PASS = 64
# The model attributes a reading changes for one replay.
READING = ("block_size", "uses_full_attn", "uses_sliding_window_attn", "sliding_window",
           "sliding_window_indices", "sliding_window_non_causal")


def load_block_drafter(drafter_dir: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """speculators' `DFlashDraftModel` from a checkpoint folder (stage 04's, or stage 05's `vllm/`), in eval mode on
    the CPU, attending through SDPA with the dense anchor-block mask; the embedding and the verifier's head read
    from the verifier folder its config names (a DFlash checkpoint saves neither)."""
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig

    config = DFlashSpeculatorConfig.from_pretrained(str(drafter_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = DFlashDraftModel.from_pretrained(str(drafter_dir), config=config)
    model.load_verifier_weights()
    return model.to(dtype).eval()


@contextlib.contextmanager
def reading(model, query: int, causal: bool = False, mask_token_id: int | None = None):
    """The model drafting blocks of `query` tokens; `causal`: attending causally inside the block (what vLLM 0.32
    serves for a folder whose sliding_window_non_causal is false), through a window that never binds;
    `mask_token_id`: another mask token than the one it was trained with."""
    saved, saved_mask = {name: getattr(model, name) for name in READING}, model.config.mask_token_id
    model.block_size = query
    if mask_token_id is not None:
        model.config.mask_token_id = mask_token_id
    if causal:
        model.uses_full_attn, model.uses_sliding_window_attn = False, True
        model.sliding_window, model.sliding_window_indices = 1 << 30, list(range(len(model.layers)))
        model.sliding_window_non_causal = False
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(model, name, value)
        model.config.mask_token_id = saved_mask


@torch.no_grad()
def block_logits(model, token_ids, aux_states: torch.Tensor, anchors: Sequence[int], num_speculative_tokens: int,
                 **reading_args: Any) -> torch.Tensor:
    """Draft-vocabulary logits [len(anchors), k, V] of the blocks anchored at x_p for each p of `anchors` (ascending,
    below N - k), one training forward per ANCHORS_PER_PASS anchors; `reading_args` go to `reading`."""
    k = num_speculative_tokens
    tokens = torch.as_tensor(token_ids, dtype=torch.long)
    # speculators never anchors in the last block's rows: padding past the sequence, which no anchor attends to.
    ids = torch.cat([tokens, tokens.new_zeros(k + 1)])
    states = aux_states.flatten(1).float()
    states = torch.cat([states, states.new_zeros(k + 1, states.shape[1])]).to(model.fc.weight.dtype)
    hidden = model.config.transformer_layer_config.hidden_size
    out = []
    with reading(model, k + 1, **reading_args):
        for start in range(0, len(anchors), ANCHORS_PER_PASS):
            chunk = torch.as_tensor(anchors[start:start + ANCHORS_PER_PASS])
            loss_mask = torch.zeros(1, ids.shape[0], dtype=torch.long)
            loss_mask[0, chunk] = 1
            _, logits, _, _, _ = model._backbone_forward(
                hidden_states=states[None], input_ids=ids[None], loss_mask=loss_mask,
                verifier_last_hidden_states=states.new_zeros(1, ids.shape[0], hidden),
                document_ids=torch.zeros_like(loss_mask), max_anchors=len(chunk))
            out.append(logits[0].view(len(chunk), k + 1, -1)[:, 1:].float())
    return torch.cat(out) if out else torch.empty(0, k, model.lm_head.out_features)


def block_draft_table(model, token_ids, aux_states: torch.Tensor, num_speculative_tokens: int, first_anchor: int,
                      **reading_args: Any) -> torch.Tensor:
    """Drafts [N-1, k] in `simulate.draft_table`'s layout: row p - 1 holds the target-vocabulary drafts of the block
    anchored at x_p, for the anchors walk_chains can count (first_anchor..N-k-1); the other rows hold -1."""
    k, n = num_speculative_tokens, len(token_ids)
    table = torch.full((n - 1, k), -1, dtype=torch.long)
    anchors = torch.arange(first_anchor, n - k)
    drafts = block_logits(model, token_ids, aux_states, anchors, k, **reading_args).argmax(-1)
    table[anchors - 1] = drafts if model.d2t is None else drafts + model.d2t[drafts]
    return table


def predict_block_acceptance(drafter: str | os.PathLike | Any, samples: Iterable[Sample], num_speculative_tokens: int,
                             *, aux_slots: Sequence[int] | None = None, **reading_args: Any) -> dict[str, Any]:
    """Predicted vLLM acceptance of a DFlash drafter (a folder or a loaded model) over (token ids, states in stage
    02's layout, prompt length) samples: `AcceptanceCounts.summary()`. `aux_slots` picks other slots as the served
    aux states (a layer-id offset); `reading_args` go to `reading` (causal, mask_token_id)."""
    model = load_block_drafter(drafter) if isinstance(drafter, (str, os.PathLike)) else drafter
    counts = AcceptanceCounts(num_speculative_tokens)
    for index, (token_ids, hidden_states, prompt_len) in enumerate(samples):
        aux = serving_inputs(torch.as_tensor(hidden_states), None if aux_slots is None else tuple(aux_slots))
        drafts = block_draft_table(model, token_ids, aux, num_speculative_tokens, int(prompt_len), **reading_args)
        walk_chains(drafts, token_ids, int(prompt_len), counts, index)
    return counts.summary()
