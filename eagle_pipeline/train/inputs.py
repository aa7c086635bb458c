"""Checks, before anything is written, that a run's inputs fit together: the verifier, the layer ids,
the vocabulary map and stage 02's training data. Each problem is a BadInput naming the file or field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle_pipeline.config import TrainConfig
from eagle_pipeline.errors import BadInput
from eagle_pipeline.layer_ids import check_layer_ids
from eagle_pipeline.samples import SAMPLES_DIR, sample_path
from eagle_pipeline.train.draft_config import check_draft_shape
from eagle_pipeline.train.settings import TrainRun
from eagle_pipeline.vocab_map import load_vocab_map


def check_inputs(train: TrainConfig, run: TrainRun) -> Any:
    """Raise BadInput for any input problem; return the verifier's text config."""
    if run.max_steps is not None and run.max_steps < 1:
        raise BadInput(f"max_steps: must be at least 1, got {run.max_steps}")

    verifier = run.verifier_dir
    if not (verifier / "config.json").is_file():
        raise BadInput(f"verifier.path: {verifier} has no config.json; point it at a Hugging Face model folder")
    text_config = verifier_text_config(verifier)
    num_layers = int(text_config.num_hidden_layers)
    check_layer_ids(run.layer_ids, num_layers)

    check_draft_shape(train, text_config)
    load_vocab_map(run.d2t_path, run.t2d_path, vocab_size=int(text_config.vocab_size))

    _check_training_data(train, run, int(text_config.hidden_size))
    return text_config


def verifier_text_config(verifier: Path) -> Any:
    from patches import speculators_cpu

    speculators_cpu.apply()  # registers kimi_k2 configs
    from speculators.models.utils import get_verifier_config

    try:
        return get_verifier_config(str(verifier))
    except (OSError, ValueError, KeyError) as exc:
        raise BadInput(f"verifier.path: cannot read {verifier / 'config.json'}: {exc}") from exc


def _check_training_data(train: TrainConfig, run: TrainRun, hidden_size: int) -> None:
    from datasets import load_from_disk
    from safetensors import safe_open

    data = run.data_dir
    try:
        dataset = load_from_disk(str(data))
    except (FileNotFoundError, ValueError) as exc:
        raise BadInput(f"{data}: not a datasets.save_to_disk folder ({exc}); run stage 02 first") from exc
    missing = {"input_ids", "loss_mask", "seq_len"} - set(dataset.column_names)
    if missing:
        raise BadInput(f"{data}: the training data lacks columns {sorted(missing)}; rerun stage 02")
    if dataset.format["type"] != "torch":
        raise BadInput(
            f"{data}: the data set must be saved in torch format (dataset.set_format('torch') before "
            f"save_to_disk), as speculators' prepare-data does; rerun stage 02"
        )
    # Both splits are non-empty by construction (topic_split.py), given two topics; that is checked there.
    if run.online is not None:  # no stored states: the capture servers are checked instead (eagle_pipeline/online/)
        return
    first = sample_path(data / SAMPLES_DIR, 0)
    if not first.is_file():
        raise BadInput(f"{first}: hidden states are missing; run stage 02 first")
    with safe_open(str(first), framework="pt") as f:
        shape = f.get_slice("hidden_states").get_shape()
    if len(shape) != 3 or shape[1] != len(run.layer_ids) + 1 or shape[2] != hidden_size:
        raise BadInput(
            f"{first}: hidden_states has shape {shape}, expected [seq, {len(run.layer_ids) + 1}, {hidden_size}] "
            f"for layer ids {run.layer_ids} plus the final layer; the data was captured with other layer "
            f"ids or another verifier, rerun stage 02"
        )
