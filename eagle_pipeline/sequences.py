"""A training sequence and its loss mask, from the token ids the engine produced in stage 01.

Stage 01 keeps, for every conversation, the prompt's token ids as vLLM rendered and tokenized them and the
completion's token ids as the target generated them. The training sequence is exactly their concatenation:
no re-rendering through the chat template (which may rewrite turns, e.g. drop reasoning from history) and
no re-tokenization (which may split text differently, and needs character offsets that Python-backend
tokenizers such as Kimi-K2.5's do not provide). The loss mask is 1 on the completion, including the
end-of-turn token the target generated, and 0 on the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence


def training_sequence(prompt_ids: Sequence[int], completion_ids: Sequence[int],
                      max_len: int | None = None) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) for one conversation, truncated to max_len tokens."""
    ids = [int(t) for t in prompt_ids] + [int(t) for t in completion_ids]
    mask = [0] * len(prompt_ids) + [1] * len(completion_ids)
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return ids, mask
