"""The draft vocabulary: the DV target tokens the drafter can propose, and the maps between the two.

Exactly as vLLM and speculators read them (docs/formats.md, "Draft vocabulary"):
- `t2d`: bool [V], DV entries true: which target tokens are in the draft vocabulary.
- `d2t`: int64 [DV], an offset: target_id = draft_id + d2t[draft_id].
Draft ids are assigned in ascending target-id order, so the drafter's lm_head row k is target id ids[k].
"""

from __future__ import annotations

import numpy as np

from eagle_pipeline.errors import BadInput


def count_tokens(input_ids_rows, loss_mask_rows, vocab_size: int) -> np.ndarray:
    """Occurrences of each target token on loss-masked (assistant) positions."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids, mask in zip(input_ids_rows, loss_mask_rows):
        ids = np.asarray(ids, dtype=np.int64)
        mask = np.asarray(mask, dtype=bool)
        kept = ids[mask]
        if kept.size and (kept.max() >= vocab_size or kept.min() < 0):
            raise BadInput(f"token id {int(kept.max())} is outside the target vocabulary "
                           f"of {vocab_size}; the data was made with another tokenizer")
        counts += np.bincount(kept, minlength=vocab_size)
    return counts


def select_draft_ids(counts: np.ndarray, draft_vocab_size: int) -> np.ndarray:
    """Top draft_vocab_size ids by (-count, id), padded with the lowest unused ids, sorted ascending."""
    vocab_size = counts.shape[0]
    if draft_vocab_size > vocab_size:
        raise BadInput(f"vocab.draft_vocab_size: {draft_vocab_size} is larger "
                       f"than the target vocabulary ({vocab_size}); lower it")
    # lexsort sorts by the last key first: count descending, then id ascending for ties.
    order = np.lexsort((np.arange(vocab_size), -counts))
    seen = order[counts[order] > 0][:draft_vocab_size]
    if seen.size < draft_vocab_size:
        unused = np.setdiff1d(np.arange(vocab_size), seen, assume_unique=False)
        seen = np.concatenate([seen, unused[: draft_vocab_size - seen.size]])
    return np.sort(seen)


def build_maps(draft_ids: np.ndarray, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    draft_ids = np.asarray(draft_ids, dtype=np.int64)
    if np.unique(draft_ids).size != draft_ids.size:
        raise ValueError("draft ids must be distinct: a duplicate would overwrite another token's logit")
    d2t = draft_ids - np.arange(draft_ids.size, dtype=np.int64)
    t2d = np.zeros(vocab_size, dtype=bool)
    t2d[draft_ids] = True
    return d2t, t2d


def coverage(counts: np.ndarray, draft_ids: np.ndarray) -> float:
    """Share of training (loss-masked) tokens that the draft vocabulary contains."""
    total = counts.sum()
    return float(counts[draft_ids].sum() / total) if total else 0.0


def coverage_curve(counts: np.ndarray, sizes) -> list[float]:
    ranked = np.sort(counts)[::-1]
    cumulative = np.cumsum(ranked)
    total = cumulative[-1] if cumulative.size and cumulative[-1] else 1
    return [float(cumulative[min(s, ranked.size) - 1] / total) for s in sizes]


# A chat with every kind of turn: the ids the chat template itself writes are those of its rendering.
TEMPLATE_PROBE = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                  {"role": "assistant", "content": "a"}, {"role": "user", "content": "u"}]


def mask_token_id(tokenizer, vocab_size: int, chat_kwargs: dict, configured: int | None = None,
                  token_counts: np.ndarray | None = None) -> int:
    """DFlash's mask token, the input of every drafted slot: `configured` checked (inside the target's vocabulary,
    never written by the chat template), or chosen: the lowest added special token that is not bos/eos/pad/unk, not
    written by the chat template rendered with the run's `chat_kwargs` and not among the answers' `token_counts`
    (stage 03's). speculators' own fallback, the pad token, is a turn marker the drafter also reads as text."""
    rendered = set(tokenizer.apply_chat_template(TEMPLATE_PROBE, tokenize=True, add_generation_prompt=True,
                                                 return_dict=False, **chat_kwargs))
    if configured is not None:
        if configured >= vocab_size:
            raise BadInput(f"train.dflash.mask_token_id: {configured} is outside the target's vocabulary of "
                           f"{vocab_size}; choose a special token of the target's tokenizer, or leave it out")
        if configured in rendered:
            raise BadInput(f"train.dflash.mask_token_id: {configured} ({tokenizer.convert_ids_to_tokens(configured)}) "
                           f"is written by the chat template, so drafted slots would read as turn markers; choose "
                           f"another special token, or leave it out")
        return configured
    reserved = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    seen = set() if token_counts is None else set(np.flatnonzero(token_counts).tolist())
    for token_id in sorted(i for i, token in tokenizer.added_tokens_decoder.items() if token.special):
        if token_id < vocab_size and token_id not in reserved | rendered | seen:
            return token_id
    raise BadInput("train.dflash.mask_token_id: the target's tokenizer has no special token that its chat template "
                   "and the answers leave unused; set one")
