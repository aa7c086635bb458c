"""Conversations answered by vLLM's offline engine with a steady number in flight (stage 01): a new one is added as
soon as one finishes, so every step decodes a full batch until the last conversations drain. Why, and why the
answers are those of fixed batches (only their order differs, so callers key them by index): docs/engines.md,
"Generating the training answers".
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any


def answer_in_flight(llm: Any, conversations: Sequence[list[dict]], params: Any, *, in_flight: int,
                     chat_template_kwargs: dict[str, Any], refill: bool = True) -> Iterator[tuple[int, Any]]:
    """Yield (index into `conversations`, vLLM RequestOutput) as each conversation finishes, with at most
    `in_flight` of them in the engine at once. `llm` is a `vllm.LLM`; `params` its SamplingParams.
    `refill=False` adds the next `in_flight` only once all before them have finished: fixed batches, as
    `LLM.chat` on one batch after another runs them (generation.refill, kept to measure the difference)."""
    if in_flight < 1:
        raise ValueError("in_flight must be at least 1")
    engine = llm.llm_engine
    if engine.has_unfinished_requests():
        raise RuntimeError("the engine already has requests; answer_in_flight needs it to itself")
    index_of: dict[str, int] = {}
    next_index = 0

    def top_up() -> None:
        nonlocal next_index
        count = min(in_flight - len(index_of), len(conversations) - next_index)
        if count <= 0 or (index_of and not refill):
            return
        batch = list(conversations[next_index : next_index + count])
        request_ids = llm.enqueue_chat(batch, params, use_tqdm=False, chat_template_kwargs=chat_template_kwargs)
        for offset, request_id in enumerate(request_ids):
            # enqueue_chat returns the engine's internal id; finished outputs carry its counter part alone.
            index_of[request_id.split("-", 1)[0]] = next_index + offset
        next_index += count

    top_up()
    while index_of:
        for output in engine.step():
            if output.finished:
                yield index_of.pop(output.request_id), output
        top_up()
