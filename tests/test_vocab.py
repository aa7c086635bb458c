"""Draft vocabulary: docs/formats.md "Draft vocabulary", including its worked example."""

import numpy as np
import pytest

from eagle_pipeline import vocab
from eagle_pipeline.errors import BadInput


def test_reference_worked_example():
    d2t, t2d = vocab.build_maps(np.array([1, 3, 4, 8]), vocab_size=10)
    assert d2t.dtype == np.int64 and d2t.tolist() == [1, 2, 2, 5]
    assert t2d.dtype == np.bool_ and t2d.sum() == 4 and np.flatnonzero(t2d).tolist() == [1, 3, 4, 8]
    draft_argmax = 2
    assert draft_argmax + d2t[draft_argmax] == 4


def test_selection_by_count_then_id_and_ascending_order():
    counts = np.array([0, 5, 9, 5, 0, 1, 0, 0], dtype=np.int64)
    # top 3 by (-count, id): 2 (9), 1 (5), 3 (5); ascending -> [1, 2, 3]
    assert vocab.select_draft_ids(counts, 3).tolist() == [1, 2, 3]


def test_padding_with_lowest_unused_ids_when_too_few_tokens_seen():
    counts = np.array([0, 0, 7, 0, 3, 0], dtype=np.int64)
    assert vocab.select_draft_ids(counts, 4).tolist() == [0, 1, 2, 4]


def test_counts_only_loss_masked_tokens():
    counts = vocab.count_tokens([[1, 2, 2, 3]], [[0, 1, 1, 0]], vocab_size=5)
    assert counts.tolist() == [0, 0, 2, 0, 0]


def test_draft_vocab_larger_than_target_is_refused():
    with pytest.raises(BadInput, match=r"vocab\.draft_vocab_size: 11 is larger than the target vocabulary \(10\)"):
        vocab.select_draft_ids(np.zeros(10, dtype=np.int64), 11)


def test_duplicate_draft_ids_are_refused():
    with pytest.raises(ValueError, match="distinct"):
        vocab.build_maps(np.array([1, 1, 2]), vocab_size=4)


def test_coverage_is_share_of_masked_tokens_in_draft_vocab():
    counts = np.array([10, 0, 30, 60], dtype=np.int64)
    assert vocab.coverage(counts, np.array([2, 3])) == pytest.approx(0.9)
    assert vocab.coverage_curve(counts, [1, 2, 4]) == pytest.approx([0.6, 0.9, 1.0])


@pytest.fixture(scope="module")
def smollm2():
    from eagle_pipeline.config import load_config
    from eagle_pipeline.verifier import Verifier

    verifier = Verifier.from_config(load_config("configs/tiny.yaml"))
    return verifier.tokenizer, verifier.vocab_size


def test_the_dflash_mask_token_is_a_special_token_no_chat_and_no_answer_uses(smollm2):
    tokenizer, size = smollm2
    # SmolLM2: 0-2 are unk/bos/eos-pad (the template writes 1 and 2); 3 (<repo_name>) is the first one left.
    assert vocab.mask_token_id(tokenizer, size, {}) == 3
    counts = np.zeros(size, dtype=np.int64)
    counts[[3, 5]] = 1  # the answers use <repo_name>: the next special token
    assert vocab.mask_token_id(tokenizer, size, {}, token_counts=counts) == 4
    assert vocab.mask_token_id(tokenizer, size, {}, configured=7) == 7


@pytest.mark.parametrize("configured,expected", [
    (2, r"train\.dflash\.mask_token_id: 2 \(<\|im_end\|>\) is written by the chat template"),
    (49152, r"train\.dflash\.mask_token_id: 49152 is outside the target's vocabulary of 49152"),
])
def test_a_configured_mask_token_the_template_writes_or_the_target_lacks_is_refused(smollm2, configured, expected):
    tokenizer, size = smollm2
    with pytest.raises(BadInput, match=expected):
        vocab.mask_token_id(tokenizer, size, {}, configured=configured)


def test_no_free_special_token_asks_for_one(smollm2):
    tokenizer, size = smollm2
    with pytest.raises(BadInput, match=r"train\.dflash\.mask_token_id: .*no special token .* set one"):
        vocab.mask_token_id(tokenizer, size, {}, token_counts=np.ones(size, dtype=np.int64))
