"""Loss mask = 1 exactly on assistant tokens, checked against the embedded verifier's chat template."""

import pytest

from eagle_pipeline.chat_tokens import tokenize_conversation


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from eagle_pipeline.embedded import materialize

    return AutoTokenizer.from_pretrained(materialize("smollm2-135m-instruct"))


def masked_text(tokenizer, ids, mask, value=1):
    return tokenizer.decode([t for t, m in zip(ids, mask) if m == value])


def test_single_turn_mask_covers_answer_and_end_of_turn(tokenizer):
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue is a colour."}]
    ids, mask = tokenize_conversation(tokenizer, messages)
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert masked_text(tokenizer, ids, mask) == "Blue is a colour.<|im_end|>"
    unmasked = masked_text(tokenizer, ids, mask, 0)
    assert "Name a colour." in unmasked and "Blue" not in unmasked and "<|im_start|>assistant" in unmasked


def test_multi_turn_masks_every_assistant_turn_and_nothing_else(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Count to three."},
        {"role": "assistant", "content": "1, 2, 3."},
    ]
    ids, mask = tokenize_conversation(tokenizer, messages)
    assert masked_text(tokenizer, ids, mask) == "Hello!<|im_end|>1, 2, 3.<|im_end|>"
    assert "Be brief." in masked_text(tokenizer, ids, mask, 0)


def test_truncation_keeps_ids_and_mask_aligned(tokenizer):
    messages = [{"role": "user", "content": "Say a lot."}, {"role": "assistant", "content": "word " * 50}]
    ids, mask = tokenize_conversation(tokenizer, messages, max_len=20)
    assert len(ids) == len(mask) == 20
