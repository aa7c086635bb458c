"""Validation by topic (eagle_pipeline/train/topic_split.py) and early stopping (train/early_stop.py):
no topic on both sides, the same split for the same seed, about val_ratio of the rows, speculators' own
loader reading the held-out rows from the view; the stopping rule, live and on resume."""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import pytest
import torch

from eagle_pipeline.errors import BadInput
from eagle_pipeline.train import checkpoints
from eagle_pipeline.train.early_stop import EarlyStopping, StopTraining, stop_due
from eagle_pipeline.train.topic_split import dataset_topics, read_split, split_by_topic, write_split_view

REPO = Path(__file__).resolve().parent.parent


def shipped_topics() -> list[str]:
    rows = [json.loads(line) for line in (REPO / "data" / "prompts_train.jsonl").read_text().splitlines() if line.strip()]
    return [r["topic"] for r in rows]


@pytest.mark.parametrize("val_ratio", [0.05, 0.2])
def test_validation_takes_whole_topics_about_val_ratio_of_the_rows(val_ratio):
    topics = shipped_topics()
    split = split_by_topic(topics, val_ratio, seed=0)
    train_topics = {topics[i] for i in split.train_rows}
    val_topics = {topics[i] for i in split.val_rows}
    assert not train_topics & val_topics
    assert sorted(split.train_rows + split.val_rows) == list(range(len(topics)))
    assert val_topics == set(split.val_topics) and split.train_topics == len(train_topics)
    # Whole topics of 4-11 rows: within one topic's size below the target, never above it.
    assert val_ratio * len(topics) - max(Counter(topics).values()) <= len(split.val_rows) <= val_ratio * len(topics)


def test_the_split_depends_on_the_seed_alone():
    topics = shipped_topics()
    assert split_by_topic(topics, 0.05, seed=0) == split_by_topic(list(topics), 0.05, seed=0)
    assert split_by_topic(topics, 0.05, seed=0).val_topics != split_by_topic(topics, 0.05, seed=1).val_topics


def test_few_large_topics_still_leave_both_sides_non_empty():
    topics = ["a"] * 9 + ["b"] * 3 + ["c"] * 5
    split = split_by_topic(topics, 0.05, seed=3)  # every topic is larger than 5% of 17 rows
    assert split.val_topics == ["b"] and len(split.train_rows) == 14
    with pytest.raises(BadInput, match=r"train.val_ratio: the training data has 1 topic\(s\).*at least two topics"):
        split_by_topic(["a"] * 5, 0.2, seed=0)


def write_rows(data_dir: Path, topics: list[str]) -> None:
    """Stage 02's layout: the dataset and one hidden-state file per row whose token ids name the row."""
    from datasets import Dataset
    from safetensors.torch import save_file

    (data_dir / "hidden_states").mkdir(parents=True)
    rows = {"sample_id": [], "topic": [], "input_ids": [], "loss_mask": [], "seq_len": []}
    for row, topic in enumerate(topics):
        ids = torch.tensor([row, row + 100, row + 200])
        save_file({"hidden_states": torch.full((3, 2, 4), float(row)), "token_ids": ids},
                  str(data_dir / "hidden_states" / f"hs_{row}.safetensors"))
        for key, value in (("sample_id", f"s{row:06d}"), ("topic", topic), ("input_ids", ids.tolist()),
                           ("loss_mask", [0, 1, 1]), ("seq_len", 3)):
            rows[key].append(value)
    Dataset.from_dict(rows).with_format("torch").save_to_disk(str(data_dir))


def test_speculators_loader_validates_on_exactly_the_held_out_topics(tmp_path):
    from speculators.train.data import ArrowDataset

    topics = ["t0", "t1", "t2", "t0", "t3", "t1", "t4", "t2", "t5", "t3"]
    data_dir, out = tmp_path / "02" / "data", tmp_path / "04"
    write_rows(data_dir, topics)
    assert dataset_topics(data_dir) == topics
    split = split_by_topic(topics, 0.3, seed=0)
    view = write_split_view(data_dir, out, split)
    ratio = read_split(out)["train_data_ratio"]

    loaded = {}
    for side in ("train", "val"):
        dataset = ArrowDataset(max_len=64, datapath=str(view), train_ratio=ratio, split=side, on_missing="raise")
        # Each row reads its own hidden states: the token ids name the stage 02 row they came from.
        loaded[side] = [int(dataset._get_raw_data(i)["input_ids"][0]) for i in range(len(dataset))]
    assert loaded == {"train": split.train_rows, "val": split.val_rows}
    assert {topics[i] for i in loaded["val"]} == set(split.val_topics)
    # The run folder can move: the links are relative.
    moved = tmp_path.rename(tmp_path.with_name(tmp_path.name + "-moved"))
    assert (moved / "04" / "split_data" / "hidden_states" / "hs_0.safetensors").is_file()


def test_data_without_topics_splits_by_row(tmp_path):
    from datasets import Dataset

    Dataset.from_dict({"input_ids": [[1], [2], [3]]}).save_to_disk(str(tmp_path))
    assert dataset_topics(tmp_path) == ["row-0", "row-1", "row-2"]


def val_record(epoch: int, loss: float) -> logging.LogRecord:
    record = logging.LogRecord("speculators.metrics", logging.INFO, __file__, 0, None, None, None)
    record.msg = {"val": {"loss_epoch": loss}, "epoch": epoch}
    return record


def test_early_stopping_ends_training_patience_epochs_after_the_best():
    assert not stop_due(5, 1, None) and not stop_due(2, 1, 2) and stop_due(3, 1, 2)
    handler = EarlyStopping(patience=2)
    for epoch, loss in enumerate([3.0, 2.0, 2.0, 2.5]):  # a tie is no improvement
        if epoch < 3:
            handler.handle(val_record(epoch, loss))
        else:
            with pytest.raises(StopTraining, match="no lower validation loss in the 2 epochs after epoch 1"):
                handler.handle(val_record(epoch, loss))
    # A resumed run counts from the best before it; train records are ignored.
    resumed = EarlyStopping(patience=2, best={"epoch": 1, "val_loss": 2.0})
    train = val_record(2, 9.0)
    train.msg = {"train": {"loss": 9.0}, "epoch": 2}
    resumed.handle(train)
    resumed.handle(val_record(2, 1.5))
    resumed.handle(val_record(3, 1.6))
    with pytest.raises(StopTraining):
        resumed.handle(val_record(4, 1.7))


def fake_checkpoint(out: Path, epoch: int, val_loss: float, predicted: float | None = None) -> None:
    folder = out / "checkpoints" / str(epoch)
    folder.mkdir(parents=True)
    for name in checkpoints.CHECKPOINT_FILES:
        (folder / name).write_bytes(b"")
    (folder / checkpoints.TRAINING_STATE).write_text(json.dumps({"epoch": epoch, "global_step": 10 * (epoch + 1)}))
    validation = {"loss": val_loss} if predicted is None else {"loss": val_loss, "predicted_acceptance_length": predicted}
    (folder / checkpoints.COMPLETE_MARKER).write_text(json.dumps(validation))


def test_best_checkpoint_by_predicted_acceptance_or_by_validation_loss(tmp_path):
    # Epoch 1 has the lowest loss, epoch 2 the longest predicted chains; epochs 2 and 3 tie on prediction.
    for epoch, (loss, predicted) in enumerate([(3.0, 1.2), (2.0, 1.4), (2.2, 1.6), (2.1, 1.6)]):
        fake_checkpoint(tmp_path, epoch, loss, predicted)
    by_prediction = checkpoints.best_checkpoint(tmp_path, "predicted_acceptance")
    # Of the two with the longest predicted chains, the lower validation loss.
    assert (by_prediction["epoch"], by_prediction["selected_by"], by_prediction["predicted_acceptance_length"]) == (
        3, "predicted_acceptance", 1.6)
    by_loss = checkpoints.best_checkpoint(tmp_path, "val_loss")
    assert (by_loss["epoch"], by_loss["selected_by"], by_loss["val_loss"]) == (1, "val_loss", 2.0)
    # Early stopping counts from the same best: epoch 3 is the best by prediction, epoch 1 by loss.
    assert checkpoints.stopped_early(tmp_path, 2, "predicted_acceptance") is None
    assert checkpoints.stopped_early(tmp_path, 2, "val_loss") == {"epoch": 3, "best_epoch": 1, "patience": 2}
    # One checkpoint without a prediction (validated before predictions were made): every one is ranked by loss.
    fake_checkpoint(tmp_path, 4, 2.5)
    assert checkpoints.best_checkpoint(tmp_path, "predicted_acceptance")["selected_by"] == "val_loss"


class FixedPredictions:
    def __init__(self, lengths):
        self.lengths, self.asked = lengths, []

    def predict(self, epoch):
        self.asked.append(epoch)
        return {"predicted_acceptance_length": self.lengths[epoch]}


def test_early_stopping_by_predicted_acceptance_follows_the_prediction_not_the_loss():
    predictions = FixedPredictions([1.2, 1.5, 1.5, 1.4, 1.3])
    handler = EarlyStopping(patience=2, predictor=predictions)
    # The loss keeps falling, but no checkpoint after epoch 1 predicts longer chains (a tie is broken by the
    # lower loss, which makes epoch 2 the best).
    for epoch, loss in enumerate([3.0, 2.0, 1.9, 1.8]):
        handler.handle(val_record(epoch, loss))
    with pytest.raises(StopTraining, match="no higher predicted acceptance length in the 2 epochs after epoch 2"):
        handler.handle(val_record(4, 1.7))
    assert predictions.asked == [0, 1, 2, 3, 4]
    # Resumed from a best.json chosen by the same rule, it continues from that best.
    resumed = EarlyStopping(patience=1, best={"epoch": 2, "val_loss": 1.9, "predicted_acceptance_length": 1.5,
                                              "selected_by": "predicted_acceptance"}, predictor=predictions)
    with pytest.raises(StopTraining, match="after epoch 2"):
        resumed.handle(val_record(3, 1.0))


def test_a_run_that_stopped_early_has_finished(tmp_path):
    for epoch, loss in enumerate([3.0, 2.0, 2.2, 2.1]):
        fake_checkpoint(tmp_path, epoch, loss)
    assert checkpoints.stopped_early(tmp_path, 2, "val_loss") == {"epoch": 3, "best_epoch": 1, "patience": 2}
    assert checkpoints.training_finished(tmp_path / "checkpoints", epochs=10, max_steps=None, patience=2, select_by="val_loss")
    # More patience (a resumable setting) continues the run; without any it trains every epoch.
    assert checkpoints.stopped_early(tmp_path, 3, "val_loss") is None
    assert not checkpoints.training_finished(tmp_path / "checkpoints", epochs=10, max_steps=None, patience=3, select_by="val_loss")
    assert not checkpoints.training_finished(tmp_path / "checkpoints", epochs=10, max_steps=None, patience=None, select_by="val_loss")


def test_selection_by_prediction_needs_a_conversation_to_replay():
    from eagle_pipeline.config import load_section

    with pytest.raises(BadInput, match=r"train.predict_conversations: 0 leaves nothing to select by; set select_by: val_loss"):
        load_section("train", {"predict_conversations": 0}, source="test")
    assert load_section("train", {"predict_conversations": 0, "select_by": "val_loss"}, source="test").predict_conversations == 0
