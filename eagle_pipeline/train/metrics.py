"""metrics.csv and loss_curves.png: a logging handler that records speculators' metric records, the
truncation of rows a resumed run logs again, and the plot drawn when a run ends."""

from __future__ import annotations

import csv
import logging
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle_pipeline import atomic
from eagle_pipeline.train.checkpoints import keep_checkpoints, mark_complete
from eagle_pipeline.train.predicted_acceptance import PREDICTED_LENGTH, CheckpointPredictor
from eagle_pipeline.train.settings import CHECKPOINTS

METRICS_CSV = "metrics.csv"
LOSS_PNG = "loss_curves.png"


def position_columns(train) -> list[str]:
    """Each draft position's accuracy, as speculators logs it: EAGLE-3's per ttt step, DFlash's per mask slot."""
    if train.family == "dflash":
        return [f"position_{k}_acc" for k in range(1, train.dflash.block_size)]
    return [f"full_acc_{k}" for k in range(train.ttt_steps)]


def metric_columns(train) -> list[str]:
    if train.family == "dflash":  # the whole block's accuracy, each slot's, and the expected accepted length
        per_position = ["full_acc", *position_columns(train), "eal"]
    else:
        per_position = [f"{name}_{k}" for name in ("loss", "full_acc", "cond_acc") for k in range(train.ttt_steps)]
    return ["split", "epoch", "step", "loss", *per_position, "lr", "tokens_per_s", PREDICTED_LENGTH]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """metrics.csv rows with numbers parsed; a row torn by a kill is dropped."""
    if not path.is_file():
        return []
    rows = []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        for raw in reader:
            if None in raw or any(v is None for v in raw.values()):
                continue
            try:
                row: dict[str, Any] = {"split": raw["split"], "epoch": int(raw["epoch"]), "step": int(raw["step"])}
                for key, value in raw.items():
                    if key not in row:
                        row[key] = float(value) if value != "" else None
            except (KeyError, ValueError):
                continue
            rows.append(row)
    return rows


def truncate_metrics(path: Path, resume_state: dict[str, Any] | None) -> None:
    """Drop rows that the resumed run will log again (everything after the checkpoint it resumes from)."""
    if not path.is_file():
        return
    if resume_state is None:
        path.unlink()
        return
    with open(path, newline="") as f:
        header = next(csv.reader(f), None)
    if header is None:
        path.unlink()
        return
    kept = [
        row
        for row in read_metrics(path)
        if (row["split"] == "train" and row["step"] <= resume_state["global_step"])
        or (row["split"] == "val" and row["epoch"] <= resume_state["epoch"])
    ]

    def write(tmp: Path) -> None:
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header)
            writer.writeheader()
            for row in kept:
                writer.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in header})

    atomic.write_with(path, write)


class MetricsRecorder(logging.Handler):
    """Receives speculators' metric records ("speculators.metrics" logger, dict messages).

    Train records -> metrics.csv rows (and tokens/step time for throughput); val records -> the
    checkpoint's predicted acceptance (with a `predictor`), a row, the checkpoint's validation.json, then
    best.json (by `select_by`) and pruning.
    """

    def __init__(self, out_dir: Path, columns: list[str], keep_last: int, select_by: str,
                 predictor: CheckpointPredictor | None = None):
        super().__init__(level=logging.INFO)
        self.out_dir = out_dir
        self.keep_last = keep_last
        self.select_by = select_by
        self.predictor = predictor
        self.columns = columns
        self.csv_path = out_dir / METRICS_CSV
        self.tokens = 0.0
        self.step_seconds = 0.0
        self.steps = 0
        if not self.csv_path.is_file():
            atomic.write_text(self.csv_path, ",".join(self.columns) + "\r\n")

    def emit(self, record: logging.LogRecord) -> None:
        message = record.msg
        if record.name != "speculators.metrics" or not isinstance(message, Mapping):
            return
        if getattr(record, "hparams", False):
            return
        if "train" in message:
            self._on_train_step(message)
        elif "val" in message:
            self._on_validation(message, int(getattr(record, "step", 0)))

    def _on_train_step(self, message: Mapping[str, Any]) -> None:
        profile = message.get("profile") or {}
        tokens_per_s = profile.get("tokens_per_s")
        if tokens_per_s is not None and profile.get("step_ms"):
            seconds = profile["step_ms"] / 1000.0
            self.tokens += tokens_per_s * seconds
            self.step_seconds += seconds
        self.steps += 1
        lr = message.get("lr")
        if isinstance(lr, Mapping):
            lr = next(iter(lr.values()), None)
        self._write(
            {
                **message["train"],
                "split": "train",
                "epoch": message.get("epoch"),
                "step": int(message["global_step"]) + 1,
                "lr": lr,
                "tokens_per_s": tokens_per_s,
            }
        )

    def _on_validation(self, message: Mapping[str, Any], step: int) -> None:
        epoch = int(message["epoch"])
        values = {key.removesuffix("_epoch"): value for key, value in message["val"].items()}
        # speculators saved this epoch's checkpoint before validating it, so it can be replayed now.
        if self.predictor is not None:
            prediction = self.predictor.predict(epoch)
            values.update(prediction)
            print(f"epoch {epoch}: predicted acceptance length {prediction[PREDICTED_LENGTH]} on "
                  f"{prediction['predicted_conversations']} held-out conversations ({prediction['prediction_s']} s)",
                  flush=True)
        self._write({**values, "split": "val", "epoch": epoch, "step": step})
        # Written last: the checkpoint is complete, prediction included.
        mark_complete(self.out_dir / CHECKPOINTS, epoch, {**values, "step": step})
        keep_checkpoints(self.out_dir, self.keep_last, self.select_by)

    def _write(self, row: Mapping[str, Any]) -> None:
        # Opened per row: speculators' logging.config.dictConfig closes every handler it finds, this one
        # included, while the handler stays attached and keeps receiving records.
        with open(self.csv_path, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow(
                {key: _csv_value(row.get(key)) for key in self.columns}
            )


def _csv_value(value: Any) -> Any:
    if value is None:
        return ""
    if isinstance(value, float) and not math.isfinite(value):
        return ""
    return value


def plot_metrics(csv_path: Path, png_path: Path, positions: list[str]) -> None:
    """Loss and per-position full accuracy, train per step and validation per epoch; with predictions, the
    predicted acceptance length of each validated checkpoint."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = read_metrics(csv_path)
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    predicted = [r for r in val if r.get(PREDICTED_LENGTH) is not None]
    figure = Figure(figsize=(16 if predicted else 11, 4.5))
    FigureCanvasAgg(figure)
    loss_axes, acc_axes, *predicted_axes = figure.subplots(1, 3 if predicted else 2)
    loss_axes.plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8, alpha=0.6, label="train")
    loss_axes.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", label="val")
    loss_axes.set(xlabel="optimizer step", ylabel="loss (sum over positions)", title="Loss")
    loss_axes.legend()
    for k, key in enumerate(positions):
        line = acc_axes.plot(
            [r["step"] for r in train], [r[key] for r in train], lw=0.8, alpha=0.4, label=f"train pos {k}"
        )[0]
        acc_axes.plot(
            [r["step"] for r in val], [r[key] for r in val], "o-", color=line.get_color(), label=f"val pos {k}"
        )
    acc_axes.set(xlabel="optimizer step", ylabel="full accuracy", title="Accuracy per draft position", ylim=(0, 1))
    acc_axes.legend(fontsize=7)
    if predicted:
        axes = predicted_axes[0]
        axes.plot([r["step"] for r in predicted], [r[PREDICTED_LENGTH] for r in predicted], "o-", color="C3")
        axes.set(xlabel="optimizer step", ylabel="mean acceptance length", ylim=(1, len(positions) + 1),
                 title="Predicted acceptance on held-out conversations")
    figure.tight_layout()
    atomic.write_with(png_path, lambda tmp: figure.savefig(tmp, format="png", dpi=110))
