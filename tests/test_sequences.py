"""Stage 02's training sequence is the engine's prompt ids plus the target's completion ids."""

from eagle_pipeline.sequences import training_sequence


def test_mask_is_zero_on_the_prompt_and_one_on_the_completion():
    ids, mask = training_sequence([5, 6, 7], [8, 9, 2])
    assert ids == [5, 6, 7, 8, 9, 2] and mask == [0, 0, 0, 1, 1, 1]


def test_truncation_keeps_ids_and_mask_aligned():
    ids, mask = training_sequence(list(range(10)), list(range(10, 30)), max_len=12)
    assert ids == list(range(12)) and mask == [0] * 10 + [1, 1]
