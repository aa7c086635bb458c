"""Token ids and loss mask of a conversation, rendered with the target's own chat template.

The loss mask is 1 exactly on tokens the assistant produced: the characters of each assistant message's
content plus the end-of-turn token that closes it (the target generated that token too, and a drafter
that cannot predict it cannot end a turn). Everything the template adds around it (role headers,
system prompt, newlines) is 0.

How: render the conversation once, locate each assistant content by rendering the conversation up to
that turn with the generation prompt (the content starts right where that prefix ends), and map
character spans to tokens through the tokenizer's offsets.
"""

from __future__ import annotations

from typing import Any

from eagle_pipeline.errors import BadInput


def render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool, chat_template_kwargs: dict[str, Any]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **chat_template_kwargs)


def assistant_spans(tokenizer, messages: list[dict[str, str]], chat_template_kwargs: dict[str, Any] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered text and the [start, end) character span of each assistant message's content."""
    kwargs = chat_template_kwargs or {}
    text = render(tokenizer, messages, add_generation_prompt=False, chat_template_kwargs=kwargs)
    spans = []
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = render(tokenizer, messages[:turn], add_generation_prompt=True, chat_template_kwargs=kwargs)
        start = len(prefix)
        if not text.startswith(prefix) or text[start : start + len(message["content"])] != message["content"]:
            # Some templates rewrite earlier turns (e.g. strip reasoning); fall back to locating the content.
            start = text.find(message["content"], spans[-1][1] if spans else 0)
            if start < 0:
                raise BadInput(f"chat template: assistant turn {turn} does not appear verbatim in the rendered conversation; "
                               f"this template cannot be masked by content spans")
        spans.append((start, start + len(message["content"])))
    return text, spans


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], *, max_len: int | None = None,
                          chat_template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], list[int]]:
    """Return (input_ids, loss_mask) for one conversation, truncated to max_len tokens."""
    text, spans = assistant_spans(tokenizer, messages, chat_template_kwargs)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = encoded["input_ids"]
    offsets: list[tuple[int, int]] = encoded["offset_mapping"]
    mask = [0] * len(ids)
    for start, end in spans:
        last = None
        for k, (a, b) in enumerate(offsets):
            if a >= start and b <= end and b > a:
                mask[k] = 1
                last = k
            elif a >= end:
                break
        # The end-of-turn token directly after the content (e.g. <|im_end|>) is the target's own output.
        after = (last + 1) if last is not None else next((k for k, (a, _) in enumerate(offsets) if a >= end), None)
        if after is not None and after < len(ids) and ids[after] in end_of_turn_ids(tokenizer):
            mask[after] = 1
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return ids, mask


def end_of_turn_ids(tokenizer) -> set[int]:
    """Token ids that end an assistant turn: EOS plus the chat format's end-of-turn specials."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    for token in ("<|im_end|>", "<|eot_id|>", "<|im_end_of_text|>", "<|end|>", "<end_of_turn>", "[EOS]"):
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id >= 0:
            ids.add(token_id)
    return ids
