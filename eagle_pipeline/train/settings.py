"""What a training run needs besides its settings (the config's `train` section): paths, layer ids,
seed, storage dtype, device; and which settings may change when a run resumes."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from eagle_pipeline.config import TrainConfig
from eagle_pipeline.online.settings import OnlineTraining
from eagle_pipeline.samples import StorageDtype

# TrainConfig fields that may change between a run and its resumption without invalidating its
# checkpoints; every other setting is recorded in the stage manifest, which refuses a change. The selection
# settings choose among checkpoints and never change one; a change applies from the next validation on.
RESUMABLE_SETTINGS = ("epochs", "early_stop_patience", "keep_last", "num_workers", "threads", "select_by",
                      "predict_conversations")
# Settings added after runs were finished with the pipeline: recorded only when changed from their defaults, so that
# those runs stay complete for their unchanged inputs.
RECORDED_WHEN_SET = ("init_from_convention", "family", "dflash")

CHECKPOINTS = "checkpoints"
SPLIT_DIR = "split_data"  # the training data reordered so validation topics come last (topic_split.py)
TENSORBOARD = "tensorboard"


@dataclass
class TrainRun:
    """Where a training run reads and writes, and what it trains for; its settings come separately."""

    data_dir: Path  # stage 02's dataset with hidden_states/
    d2t_path: Path
    t2d_path: Path
    verifier_dir: Path
    out_dir: Path
    layer_ids: list[int]  # the verifier layers whose hidden states the drafter reads
    seed: int
    storage_dtype: StorageDtype  # how stage 02 stored the hidden states
    device: Literal["cpu", "cuda"]
    max_steps: int | None = None  # stop after this many optimizer steps (short runs)
    # train.init_from rewritten in speculators' layout when it is a flat released drafter (released_drafter.py).
    init_from_dir: Path | None = None
    # hidden_states.mode: online: the capture servers every rank asks for states (eagle_pipeline/online/).
    online: OnlineTraining | None = None
    mask_token_id: int | None = None  # a DFlash drafter's (vocab.mask_token_id)

    def __post_init__(self) -> None:
        for name in ("data_dir", "d2t_path", "t2d_path", "verifier_dir", "out_dir"):
            setattr(self, name, Path(os.fspath(getattr(self, name))).expanduser().resolve())
        if self.init_from_dir is not None:
            self.init_from_dir = Path(os.fspath(self.init_from_dir)).expanduser().resolve()
        self.layer_ids = [int(i) for i in self.layer_ids]
        self.storage_dtype = StorageDtype(self.storage_dtype)
        if isinstance(self.online, dict):  # read back from launch.json
            self.online = OnlineTraining(**self.online)

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / CHECKPOINTS

    @property
    def split_dir(self) -> Path:
        return self.out_dir / SPLIT_DIR

    @property
    def tensorboard_dir(self) -> Path:
        return self.out_dir / TENSORBOARD

    def to_json(self) -> dict[str, Any]:
        return {key: str(value) if isinstance(value, (Path, StorageDtype)) else value
                for key, value in asdict(self).items()}


def draft_positions(train: TrainConfig) -> int:
    """The draft tokens a drafter of this run proposes per step: EAGLE-3's ttt steps, a DFlash block's mask slots."""
    return train.dflash.block_size - 1 if train.family == "dflash" else train.ttt_steps


def recorded_settings(train: TrainConfig) -> dict[str, Any]:
    """The settings a run's stage manifest records, one input each ("train.lr"), so that a rerun with a
    changed one is refused naming it; the resumable ones are left out."""
    values, defaults = train.model_dump(mode="json"), TrainConfig().model_dump(mode="json")
    return {f"train.{name}": value for name, value in values.items()
            if name not in RESUMABLE_SETTINGS and not (name in RECORDED_WHEN_SET and value == defaults[name])}
