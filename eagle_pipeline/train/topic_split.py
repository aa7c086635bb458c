"""Validation on whole topics: the rows of a few topics are held out of training, so that the validation
loss predicts how the drafter does on prompts about things it was never trained on (stage 06 serves
held-out topics), not how well it remembers near-copies of its training prompts. Each row of stage 02's
dataset carries a `topic` (stage 01 records the prompt's; a prompt without one is its own topic). How topics
are chosen, and the view of stage 02's data that speculators' positional split reads (`split_data/`,
`split.json`): docs/formats.md, "speculators checkpoint".
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from eagle_pipeline import atomic
from eagle_pipeline.errors import BadInput
from eagle_pipeline.samples import SAMPLES_DIR, sample_path
from eagle_pipeline.train.settings import SPLIT_DIR

SPLIT_FILE = "split.json"
TOPIC_COLUMN = "topic"


@dataclass(frozen=True)
class TopicSplit:
    train_rows: list[int]  # row numbers of stage 02's dataset, in its order
    val_rows: list[int]
    val_topics: list[str]
    train_topics: int

    @property
    def train_data_ratio(self) -> float:
        """The ratio for which speculators' int(rows * ratio) is exactly the number of training rows."""
        # Halfway between two row counts, so float rounding cannot move the boundary by a row.
        return (len(self.train_rows) + 0.5) / (len(self.train_rows) + len(self.val_rows))


def choose_validation_topics(topics: Sequence[str], val_ratio: float, seed: int) -> set[str]:
    """Whole topics holding about val_ratio of the rows (at least one topic, never all of them)."""
    counts = Counter(topics)
    if len(counts) < 2:
        raise BadInput(f"train.val_ratio: the training data has {len(counts)} topic(s) and validation takes "
                       f"whole topics; generate samples from prompts on at least two topics "
                       f"(the prompts' 'topic' field)")
    order = sorted(counts)
    # A string seed: the order depends on the run's seed alone, not on other uses of the generator.
    random.Random(f"topic-split:{seed}").shuffle(order)
    target = val_ratio * len(topics)
    chosen, rows = set(), 0
    for topic in order:
        if rows + counts[topic] <= target:
            chosen.add(topic)
            rows += counts[topic]
    if not chosen:  # every topic is larger than the target: hold out one of the smallest
        chosen.add(min(order, key=lambda t: counts[t]))
    return chosen


def split_by_topic(topics: Sequence[str], val_ratio: float, seed: int) -> TopicSplit:
    held_out = choose_validation_topics(topics, val_ratio, seed)
    return TopicSplit(
        train_rows=[i for i, t in enumerate(topics) if t not in held_out],
        val_rows=[i for i, t in enumerate(topics) if t in held_out],
        val_topics=sorted(held_out),
        train_topics=len(set(topics) - held_out),
    )


def dataset_topics(data_dir: Path) -> list[str]:
    """Each row's topic; data from before topics were recorded has one topic per row (its sample)."""
    from datasets import load_from_disk

    data = load_from_disk(str(data_dir)).with_format(None)
    if TOPIC_COLUMN in data.column_names:
        return [str(t) for t in data[TOPIC_COLUMN]]
    return [f"row-{i}" for i in range(len(data))]


def write_split_view(data_dir: Path, out_dir: Path, split: TopicSplit) -> Path:
    """Write out_dir/split_data (training rows first) and out_dir/split.json; return the view's folder."""
    from datasets import load_from_disk

    order = split.train_rows + split.val_rows
    view = out_dir / SPLIT_DIR
    source = data_dir / SAMPLES_DIR
    with atomic.atomic_dir(view) as tmp:
        load_from_disk(str(data_dir)).select(order).with_format("torch").save_to_disk(str(tmp))
        # tmp is a sibling of the final folder: links relative to it resolve the same after the rename.
        (tmp / SAMPLES_DIR).mkdir()
        for new_row, old_row in enumerate(order):
            link = sample_path(tmp / SAMPLES_DIR, new_row)
            os.symlink(os.path.relpath(sample_path(source, old_row), view / SAMPLES_DIR), link)
    atomic.write_json(out_dir / SPLIT_FILE, {**asdict(split), "train_data_ratio": split.train_data_ratio,
                                             "rows": {"train": len(split.train_rows), "val": len(split.val_rows)}})
    return view


def read_split(out_dir: Path) -> dict:
    path = out_dir / SPLIT_FILE
    if not path.is_file():
        raise RuntimeError(f"{path} is missing: prepare the run (runner.prepare) before building its arguments")
    return json.loads(path.read_text())


def split_summary(out_dir: Path) -> dict | None:
    """The validation topics and row counts of a prepared run, for its summary (None before one)."""
    if not (out_dir / SPLIT_FILE).is_file():
        return None
    split = read_split(out_dir)
    return {"val_topics": split["val_topics"], "train_topics": split["train_topics"], "rows": split["rows"]}
