"""Stage 04: train an EAGLE-3 drafter with speculators' own trainer.

The training loop, data loader, losses and checkpointer are speculators 0.9.0's, driven through its CLI
entry point (`speculators.train.cli.main(TrainConfig.resolve(argv))`, the flags of `speculators train`).
This module only builds that argv and wraps the run:

  out_dir/
    train_spec.json       every setting of the run; a rerun refuses checkpoints made with other settings
    draft_config.json     the draft decoder (LlamaConfig), passed as --draft-config
    checkpoints/<epoch>/  speculators' checkpoints (model, optimizer, scheduler, training_state.json)
                          plus validation.json, written here once the epoch is validated
    best.json             the checkpoint with the lowest validation loss
    metrics.csv           loss and per-position accuracy (full_acc_k, cond_acc_k), train and val
    loss_curves.png       the same, plotted when the run ends
    run_stats.json        tokens/s, peak RSS and resume point of the latest invocation that trained
  log_dir (default out_dir/tensorboard): speculators' TensorBoard events

speculators saves a checkpoint at the end of each epoch (`training_state.json` is its last file) and
then validates it; this module records that validation as `validation.json` in the checkpoint folder. A
checkpoint is complete once both exist. A rerun after a kill deletes incomplete (torn) folders first, so
speculators resumes from the newest complete one, optimizer, scheduler and step included, and no epoch
goes unvalidated. After each validation only the newest `keep_last` complete checkpoints and the best
one (lowest validation loss) are kept.

Multi-GPU runs go through torchrun: `torchrun_command()` prepares the run and returns the command, which
runs this module (`python -m eagle_pipeline.training --spec out_dir/train_spec.json`) on every rank;
`finalize_training()` then writes best.json, the plot and the summary.
"""

from __future__ import annotations

import contextlib
import csv
import json
import logging
import math
import os
import resource
import shutil
import sys
import time
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from eagle_pipeline import atomic
from eagle_pipeline.errors import BadInput
from eagle_pipeline.fingerprint import file_fingerprint, model_dir_fingerprint, value_fingerprint

logger = logging.getLogger(__name__)

# The released Kimi-K2.5 EAGLE-3 drafters' decoder: one Llama layer, full attention.
KIMI_K25_DRAFT_SHAPE: dict[str, Any] = {
    "hidden_size": 7168,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "head_dim": 128,
    "intermediate_size": 18432,
    "rope_theta": 1e6,
    "num_hidden_layers": 1,
}

REQUIRED_SHAPE_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
OPTIONAL_SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "rope_theta",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
)
# The decoder fields that must agree between this run and a drafter it fine-tunes.
COMPARED_SHAPE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "hidden_act",
    "rope_theta",
    "layer_types",
)
NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")

CHECKPOINTS = "checkpoints"
SPEC_FILE = "train_spec.json"
DRAFT_CONFIG_FILE = "draft_config.json"
METRICS_CSV = "metrics.csv"
LOSS_PNG = "loss_curves.png"
BEST_FILE = "best.json"
RUN_STATS_FILE = "run_stats.json"
# speculators writes this last into a checkpoint folder (Trainer._save_training_state).
TRAINING_STATE = "training_state.json"
# Written here once speculators has validated the checkpoint: the checkpoint is complete.
COMPLETE_MARKER = "validation.json"
CHECKPOINT_FILES = ("config.json", "model.safetensors", "optimizer_state_dict.pt", "scheduler_state_dict.pt")
# Settings that may change between a run and its resumption.
RESUMABLE_CHANGES = ("epochs", "keep_last", "num_workers", "threads", "log_dir", "max_steps", "device")


@dataclass
class TrainSpec:
    data_dir: str
    d2t_path: str
    t2d_path: str
    verifier_dir: str
    out_dir: str
    layer_ids: list[int]
    draft_shape: dict[str, Any] | None = None
    init_from: str | None = None
    epochs: int = 6
    lr: float = 3e-4
    optimizer: str = "adamw"
    total_seq_len: int = 1024
    ttt_steps: int = 3
    ttt_step_loss_decay: float = 1.0
    train_ratio: float = 0.95
    keep_last: int = 2
    device: str = "cpu"
    dtype: str = "float32"
    num_workers: int = 1
    seed: int = 0
    log_dir: str | None = None
    threads: int | None = None
    max_steps: int | None = None
    norm_before_residual: bool = True
    norm_before_fc: bool = True
    fc_norm: bool = False
    norm_output: bool = True
    # "file": bf16 safetensors as stage 02 writes them; "fp8": hs_connectors' FP8-quantized files.
    hidden_states_backend: str = "file"
    # Multi-GPU only: shard the drafter with FSDP instead of replicating it on every GPU.
    fsdp_shard: bool = False
    # Filled by prepare(): fingerprints of the inputs that shape the run.
    inputs: dict[str, str] = field(default_factory=dict)

    @property
    def out(self) -> Path:
        return Path(self.out_dir)

    @property
    def checkpoint_dir(self) -> Path:
        return self.out / CHECKPOINTS

    @property
    def tensorboard_dir(self) -> Path:
        return Path(self.log_dir) if self.log_dir else self.out / "tensorboard"


def train_drafter(
    data_dir: str | os.PathLike,
    d2t_path: str | os.PathLike,
    t2d_path: str | os.PathLike,
    verifier_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    layer_ids: list[int] | tuple[int, ...],
    draft_shape: dict[str, Any] | None = None,
    init_from: str | os.PathLike | None = None,
    epochs: int = 6,
    lr: float = 3e-4,
    optimizer: str = "adamw",
    total_seq_len: int = 1024,
    ttt_steps: int = 3,
    ttt_step_loss_decay: float = 1.0,
    train_ratio: float = 0.95,
    keep_last: int = 2,
    device: str = "cpu",
    dtype: str = "float32",
    num_workers: int = 1,
    seed: int = 0,
    log_dir: str | os.PathLike | None = None,
    threads: int | None = None,
    max_steps: int | None = None,
    norm_before_residual: bool = True,
    norm_before_fc: bool = True,
    fc_norm: bool = False,
    norm_output: bool = True,
    hidden_states_backend: str = "file",
    fsdp_shard: bool = False,
) -> dict[str, Any]:
    """Train (or resume training) a drafter in this process and return the run summary.

    draft_shape None derives the decoder from the verifier (speculators' own derivation, full attention);
    a dict gives it explicitly (see KIMI_K25_DRAFT_SHAPE). init_from fine-tunes an existing speculators
    drafter, which must match this run's vocabulary map, aux layers, decoder shape and norm flags.
    """
    spec = make_spec(**locals())
    prepare(spec)
    if training_finished(spec):
        logger.info("Training in %s already finished; nothing to train.", spec.out)
    else:
        run_speculators(spec)
    return finalize_training(spec.out)


def make_spec(**kwargs: Any) -> TrainSpec:
    for name in ("data_dir", "d2t_path", "t2d_path", "verifier_dir", "out_dir", "init_from", "log_dir"):
        if kwargs.get(name) is not None:
            kwargs[name] = str(Path(kwargs[name]).expanduser().resolve())
    kwargs["layer_ids"] = [int(i) for i in kwargs["layer_ids"]]
    return TrainSpec(**kwargs)


def torchrun_command(nproc_per_node: int, **train_kwargs: Any) -> list[str]:
    """Prepare a multi-GPU run (same arguments as train_drafter) and return the torchrun command for it.

    Run the command from the repository root, then call finalize_training(out_dir) for the summary.
    """
    spec = make_spec(**{"device": "cuda", **train_kwargs})
    if spec.device != "cuda":
        raise BadInput("train.device: torchrun runs need device 'cuda'")
    prepare(spec)
    return [
        "torchrun",
        "--standalone",
        f"--nproc_per_node={int(nproc_per_node)}",
        "-m",
        "eagle_pipeline.training",
        "--spec",
        str(spec.out / SPEC_FILE),
    ]


# ---------------------------------------------------------------------------------------------------
# Preparation: validate inputs, write the draft config, repair the checkpoint folder.
# ---------------------------------------------------------------------------------------------------


def prepare(spec: TrainSpec) -> None:
    """Validate everything a run needs, then leave out_dir ready for speculators to start or resume."""
    verifier_text_config = _check_inputs(spec)
    draft_config = build_draft_config(spec, verifier_text_config)
    if spec.init_from:
        check_init_from(spec, draft_config)
    spec.inputs = {
        "d2t": file_fingerprint(spec.d2t_path),
        "t2d": file_fingerprint(spec.t2d_path),
        "verifier_config": file_fingerprint(Path(spec.verifier_dir) / "config.json"),
        "draft_config": value_fingerprint(draft_config),
    }
    if spec.init_from:
        spec.inputs["init_from"] = model_dir_fingerprint(spec.init_from)

    spec.out.mkdir(parents=True, exist_ok=True)
    atomic.sweep_temporaries(spec.out)
    removed = remove_torn_checkpoints(spec.checkpoint_dir)
    for name in removed:
        logger.warning("Removed incomplete checkpoint %s (the run was stopped while writing it).", name)
    _check_same_run(spec)
    atomic.write_json(spec.out / DRAFT_CONFIG_FILE, draft_config)
    atomic.write_json(spec.out / SPEC_FILE, asdict(spec))
    newest = newest_checkpoint(spec.checkpoint_dir)
    truncate_metrics(spec.out / METRICS_CSV, newest)


def _check_inputs(spec: TrainSpec) -> Any:
    """Raise BadInput for any input problem; return the verifier's text config."""
    if spec.device not in ("cpu", "cuda"):
        raise BadInput(f"train.device: {spec.device!r} is not one of 'cpu', 'cuda'")
    if spec.dtype not in ("float32", "bfloat16"):
        raise BadInput(f"train.dtype: {spec.dtype!r} is not one of 'float32', 'bfloat16'")
    if spec.hidden_states_backend not in ("file", "fp8"):
        raise BadInput(f"hidden_states.storage_dtype: backend {spec.hidden_states_backend!r} is not 'file' or 'fp8'")
    if spec.optimizer not in ("adamw", "muon"):
        raise BadInput(f"train.optimizer: {spec.optimizer!r} is not one of 'adamw', 'muon'")
    for name in ("epochs", "keep_last", "total_seq_len", "ttt_steps"):
        if int(getattr(spec, name)) < 1:
            raise BadInput(f"train.{name}: must be at least 1, got {getattr(spec, name)}")
    if not 0.0 < spec.ttt_step_loss_decay <= 1.0:
        raise BadInput(f"train.ttt_step_loss_decay: must be in (0, 1], got {spec.ttt_step_loss_decay}")
    if not 0.0 < spec.train_ratio < 1.0:
        raise BadInput(f"train.train_ratio: must be between 0 and 1 (exclusive), got {spec.train_ratio}")
    if spec.norm_before_fc and spec.fc_norm:
        raise BadInput("train.norm_before_fc and train.fc_norm: speculators allows only one of them; set one false")
    if spec.fsdp_shard and spec.device != "cuda":
        raise BadInput("train.fsdp_shard: needs device 'cuda' and torchrun")
    if spec.max_steps is not None and spec.max_steps < 1:
        raise BadInput(f"train.max_steps: must be at least 1, got {spec.max_steps}")

    verifier = Path(spec.verifier_dir)
    if not (verifier / "config.json").is_file():
        raise BadInput(f"verifier.path: {verifier} has no config.json; point it at a Hugging Face model folder")
    text_config = _verifier_text_config(verifier)
    num_layers = int(text_config.num_hidden_layers)
    if not spec.layer_ids or len(set(spec.layer_ids)) != len(spec.layer_ids):
        raise BadInput(f"hidden_states.layer_ids: need distinct layer ids, got {spec.layer_ids}")
    if min(spec.layer_ids) < 0 or max(spec.layer_ids) > num_layers:
        raise BadInput(
            f"hidden_states.layer_ids: {spec.layer_ids} must lie in [0, {num_layers}] for this "
            f"{num_layers}-layer verifier"
        )

    d2t, t2d = _load_vocab_map(spec.d2t_path, spec.t2d_path)
    if t2d.shape[0] != int(text_config.vocab_size):
        raise BadInput(
            f"{spec.t2d_path}: has {t2d.shape[0]} entries but the verifier's vocabulary has "
            f"{text_config.vocab_size}; rebuild the vocab map for this verifier"
        )

    _check_training_data(spec, int(text_config.hidden_size))
    return text_config


def _verifier_text_config(verifier: Path) -> Any:
    from patches import speculators_cpu

    speculators_cpu.apply()  # registers kimi_k2 configs
    from speculators.models.utils import get_verifier_config

    try:
        return get_verifier_config(str(verifier))
    except (OSError, ValueError, KeyError) as exc:
        raise BadInput(f"verifier.path: cannot read {verifier / 'config.json'}: {exc}") from exc


def _load_vocab_map(d2t_path: str, t2d_path: str) -> tuple[np.ndarray, np.ndarray]:
    for path in (d2t_path, t2d_path):
        if not Path(path).is_file():
            raise BadInput(f"{path}: vocab map file is missing; run stage 03 (build_vocab_map) first")
    d2t = np.load(d2t_path)
    t2d = np.load(t2d_path)
    if d2t.ndim != 1 or d2t.dtype != np.int64:
        raise BadInput(f"{d2t_path}: expected a 1-D int64 array (offsets), got {d2t.dtype} {d2t.shape}")
    if t2d.ndim != 1 or t2d.dtype != np.bool_:
        raise BadInput(f"{t2d_path}: expected a 1-D bool array, got {t2d.dtype} {t2d.shape}")
    if int(t2d.sum()) != d2t.shape[0]:
        raise BadInput(
            f"{t2d_path}: marks {int(t2d.sum())} tokens but {d2t_path} has {d2t.shape[0]}; "
            f"the two files come from different vocab maps, rebuild them together"
        )
    if not np.array_equal(np.flatnonzero(t2d), np.arange(d2t.shape[0]) + d2t):
        raise BadInput(f"{d2t_path}: draft ids do not map onto the tokens marked in {t2d_path}; rebuild both")
    return d2t, t2d


def _check_training_data(spec: TrainSpec, hidden_size: int) -> None:
    from datasets import load_from_disk
    from safetensors import safe_open

    data = Path(spec.data_dir)
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
    rows = len(dataset)
    if rows - int(rows * spec.train_ratio) < 1 or int(rows * spec.train_ratio) < 1:
        raise BadInput(
            f"train.train_ratio: {spec.train_ratio} of {rows} samples leaves an empty train or validation "
            f"split; generate more samples or change the ratio"
        )
    first = data / "hidden_states" / "hs_0.safetensors"
    if not first.is_file():
        raise BadInput(f"{first}: hidden states are missing; run stage 02 first")
    with safe_open(str(first), framework="pt") as f:
        shape = f.get_slice("hidden_states").get_shape()
    if len(shape) != 3 or shape[1] != len(spec.layer_ids) + 1 or shape[2] != hidden_size:
        raise BadInput(
            f"{first}: hidden_states has shape {shape}, expected [seq, {len(spec.layer_ids) + 1}, {hidden_size}] "
            f"for layer ids {spec.layer_ids} plus the final layer; the data was captured with other layer "
            f"ids or another verifier, rerun stage 02"
        )


def build_draft_config(spec: TrainSpec, verifier_text_config: Any) -> dict[str, Any]:
    """The draft decoder as a LlamaConfig dict: explicit from spec.draft_shape, or derived from the verifier."""
    from transformers import LlamaConfig

    if spec.draft_shape is None:
        from speculators.train.cli import create_transformer_layer_config

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = create_transformer_layer_config(
                verifier_name_or_path=spec.verifier_dir,
                num_layers=1,
                draft_arch="llama",
                hidden_act="silu",
                sliding_window=2048,
                # vLLM serves EAGLE-3 drafters with full attention: train them that way.
                full_attention_indices=[0],
            )
        return config.to_dict()

    unknown = set(spec.draft_shape) - set(REQUIRED_SHAPE_KEYS) - set(OPTIONAL_SHAPE_KEYS)
    if unknown:
        raise BadInput(
            f"train.draft_shape: unknown keys {sorted(unknown)}; allowed: "
            f"{sorted(REQUIRED_SHAPE_KEYS + OPTIONAL_SHAPE_KEYS)}"
        )
    missing = set(REQUIRED_SHAPE_KEYS) - set(spec.draft_shape)
    if missing:
        raise BadInput(f"train.draft_shape: missing keys {sorted(missing)}")
    shape = dict(spec.draft_shape)
    verifier_hidden = int(verifier_text_config.hidden_size)
    hidden = int(shape.get("hidden_size", verifier_hidden))
    if hidden != verifier_hidden:
        raise BadInput(
            f"train.draft_shape.hidden_size: {hidden} differs from the verifier's hidden size "
            f"{verifier_hidden}; an EAGLE-3 drafter must match it"
        )
    heads, kv_heads = int(shape["num_attention_heads"]), int(shape["num_key_value_heads"])
    if heads % kv_heads:
        raise BadInput(
            f"train.draft_shape: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
        )
    layers = int(shape.get("num_hidden_layers", 1))
    rope_theta = float(shape.get("rope_theta", _verifier_rope_theta(verifier_text_config)))
    config = LlamaConfig(
        vocab_size=int(verifier_text_config.vocab_size),
        hidden_size=hidden,
        intermediate_size=int(shape["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=int(shape["head_dim"]),
        hidden_act=str(shape.get("hidden_act", "silu")),
        max_position_embeddings=int(
            shape.get("max_position_embeddings", verifier_text_config.max_position_embeddings)
        ),
        rms_norm_eps=float(shape.get("rms_norm_eps", getattr(verifier_text_config, "rms_norm_eps", 1e-6))),
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        layer_types=["full_attention"] * layers,
    )
    return config.to_dict()


def _verifier_rope_theta(text_config: Any) -> float:
    params = getattr(text_config, "rope_parameters", None) or {}
    if isinstance(params, Mapping) and "rope_theta" in params:
        return float(params["rope_theta"])
    return float(getattr(text_config, "rope_theta", 10000.0))


def _shape_of(layer_config: Mapping[str, Any]) -> dict[str, Any]:
    """The compared decoder fields, read through transformers so that omitted defaults are filled in."""
    from transformers import AutoConfig

    config = type(AutoConfig.for_model(layer_config.get("model_type", "llama"))).from_dict(dict(layer_config))
    shape = {key: getattr(config, key, None) for key in COMPARED_SHAPE_KEYS if key != "rope_theta"}
    if shape["head_dim"] is None:
        shape["head_dim"] = config.hidden_size // config.num_attention_heads
    if shape["layer_types"] is not None:
        shape["layer_types"] = list(shape["layer_types"])
    shape["rope_theta"] = _verifier_rope_theta(config)
    return shape


def check_init_from(spec: TrainSpec, draft_config: Mapping[str, Any]) -> None:
    """Raise BadInput unless the drafter in spec.init_from fits this run exactly."""
    from safetensors import safe_open

    source = Path(spec.init_from)
    config_path, weights_path = source / "config.json", source / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise BadInput(f"train.init_from: {source} needs config.json and model.safetensors (a speculators drafter)")
    config = json.loads(config_path.read_text())
    if config.get("speculators_model_type") != "eagle3":
        raise BadInput(
            f"train.init_from: {config_path} is not a speculators EAGLE-3 config "
            f"(speculators_model_type={config.get('speculators_model_type')!r}); convert it with "
            f"`speculators convert` first"
        )

    differences = []
    theirs, ours = _shape_of(config.get("transformer_layer_config", {})), _shape_of(draft_config)
    for key in COMPARED_SHAPE_KEYS:
        if theirs.get(key) != ours.get(key):
            differences.append(f"{key} {theirs.get(key)} vs {ours.get(key)}")
    their_ids = config.get("eagle_aux_hidden_state_layer_ids")
    if their_ids is not None and list(their_ids) != list(spec.layer_ids):
        differences.append(f"layer_ids {their_ids} vs {spec.layer_ids}")
    for flag in NORM_FLAGS:
        if bool(config.get(flag, False)) != bool(getattr(spec, flag)):
            differences.append(f"{flag} {bool(config.get(flag, False))} vs {bool(getattr(spec, flag))}")
    if differences:
        raise BadInput(
            f"train.init_from: {source} has another drafter shape than this run (theirs vs ours): "
            f"{'; '.join(differences)}"
        )

    d2t, t2d = np.load(spec.d2t_path), np.load(spec.t2d_path)
    with safe_open(str(weights_path), framework="pt") as f:
        keys = set(f.keys())
        their_d2t = f.get_tensor("d2t").numpy() if "d2t" in keys else None
        their_t2d = f.get_tensor("t2d").numpy() if "t2d" in keys else None
    if their_d2t is None or their_t2d is None:
        raise BadInput(
            f"train.init_from: {weights_path} has no d2t/t2d (a full-vocabulary drafter) but this run uses a "
            f"{d2t.shape[0]}-token draft vocabulary; use the drafter's own vocab map"
        )
    if their_d2t.shape != d2t.shape:
        raise BadInput(
            f"train.init_from: its draft vocabulary has {their_d2t.shape[0]} tokens, this run's "
            f"{spec.d2t_path} has {d2t.shape[0]}; train with the drafter's own d2t.npy/t2d.npy"
        )
    if not np.array_equal(their_t2d.astype(bool), t2d) or not np.array_equal(their_d2t.astype(np.int64), d2t):
        differing = int((np.flatnonzero(their_t2d.astype(bool)) != np.flatnonzero(t2d)).sum())
        raise BadInput(
            f"train.init_from: its draft vocabulary maps {differing} of {d2t.shape[0]} draft ids to other "
            f"target tokens than {spec.d2t_path}; train with the drafter's own d2t.npy/t2d.npy"
        )


def _check_same_run(spec: TrainSpec) -> None:
    """Refuse to resume checkpoints that another configuration produced."""
    if newest_checkpoint(spec.checkpoint_dir) is None:
        return
    spec_path = spec.out / SPEC_FILE
    if not spec_path.is_file():
        raise BadInput(
            f"{spec.out}: holds checkpoints but no {SPEC_FILE}; use an empty output folder or delete it"
        )
    previous = json.loads(spec_path.read_text())
    current = asdict(spec)
    changed = sorted(
        key
        for key in set(previous) | set(current)
        if key not in RESUMABLE_CHANGES and previous.get(key) != current.get(key)
    )
    if changed:
        raise BadInput(
            f"{spec.out}: its checkpoints were trained with other settings ({', '.join(changed)} changed); "
            f"use a new output folder or delete {spec.checkpoint_dir} to start over"
        )


# ---------------------------------------------------------------------------------------------------
# Checkpoint folder: completeness, torn folders, pruning, best.
# ---------------------------------------------------------------------------------------------------


def _epoch_dirs(checkpoint_dir: Path) -> list[Path]:
    if not checkpoint_dir.is_dir():
        return []
    return sorted(
        (p for p in checkpoint_dir.iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit()),
        key=lambda p: int(p.name),
    )


def read_training_state(epoch_dir: Path) -> dict[str, Any] | None:
    """speculators' training_state.json plus the validation loss if the checkpoint is complete, else None."""
    files = (*CHECKPOINT_FILES, TRAINING_STATE, COMPLETE_MARKER)
    if not all((epoch_dir / name).is_file() for name in files):
        return None
    try:
        state = json.loads((epoch_dir / TRAINING_STATE).read_text())
        validation = json.loads((epoch_dir / COMPLETE_MARKER).read_text())
    except (json.JSONDecodeError, OSError):
        return None
    if state.get("epoch") != int(epoch_dir.name) or "global_step" not in state or "loss" not in validation:
        return None
    return {**state, "val_loss": validation["loss"]}


def complete_checkpoints(checkpoint_dir: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """epoch -> training state of every complete checkpoint."""
    found = {}
    for epoch_dir in _epoch_dirs(Path(checkpoint_dir)):
        state = read_training_state(epoch_dir)
        if state is not None:
            found[int(epoch_dir.name)] = state
    return found


def newest_checkpoint(checkpoint_dir: str | os.PathLike) -> dict[str, Any] | None:
    complete = complete_checkpoints(checkpoint_dir)
    return complete[max(complete)] if complete else None


def _delete_dir(path: Path) -> None:
    # Rename first, so a kill during the delete leaves a .tmp- name that the next run sweeps.
    trash = path.with_name(f"{atomic.TMP_PREFIX}deleted-{path.name}")
    shutil.rmtree(trash, ignore_errors=True)
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_dangling_links(checkpoint_dir: Path) -> None:
    for link in checkpoint_dir.iterdir():
        if link.is_symlink() and not link.exists():
            link.unlink()


def remove_torn_checkpoints(checkpoint_dir: str | os.PathLike) -> list[str]:
    """Delete checkpoint folders that a kill left incomplete; speculators would resume from them."""
    checkpoint_dir = Path(checkpoint_dir)
    removed = []
    for epoch_dir in _epoch_dirs(checkpoint_dir):
        if read_training_state(epoch_dir) is None:
            _delete_dir(epoch_dir)
            removed.append(epoch_dir.name)
    if checkpoint_dir.is_dir():
        _remove_dangling_links(checkpoint_dir)
    return removed


def best_checkpoint(out_dir: Path) -> dict[str, Any] | None:
    """The complete checkpoint with the lowest validation loss (earliest on ties)."""
    best = None
    for epoch, state in sorted(complete_checkpoints(out_dir / CHECKPOINTS).items()):
        if best is None or state["val_loss"] < best["val_loss"]:
            best = {
                "epoch": epoch,
                "step": state["global_step"],
                "val_loss": state["val_loss"],
                "checkpoint": f"{CHECKPOINTS}/{epoch}",
            }
    return best


def keep_checkpoints(out_dir: Path, keep_last: int) -> None:
    """Write best.json, then delete complete checkpoints other than the newest keep_last and the best."""
    best = best_checkpoint(out_dir)
    if best is not None:
        atomic.write_json(out_dir / BEST_FILE, best)
    complete = sorted(complete_checkpoints(out_dir / CHECKPOINTS))
    keep = set(complete[-keep_last:])
    if best is not None:
        keep.add(best["epoch"])
    for epoch in complete:
        if epoch not in keep:
            _delete_dir(out_dir / CHECKPOINTS / str(epoch))
    if (out_dir / CHECKPOINTS).is_dir():
        _remove_dangling_links(out_dir / CHECKPOINTS)


def training_finished(spec: TrainSpec) -> bool:
    newest = newest_checkpoint(spec.checkpoint_dir)
    if newest is None:
        return False
    if spec.max_steps is not None and newest["global_step"] >= spec.max_steps:
        return True
    return newest["epoch"] >= spec.epochs - 1 and newest.get("local_step", 0) == 0


# ---------------------------------------------------------------------------------------------------
# Metrics: a logging handler on speculators' metric records -> metrics.csv, epoch-end bookkeeping.
# ---------------------------------------------------------------------------------------------------


def metric_columns(ttt_steps: int) -> list[str]:
    per_position = [f"{name}_{k}" for name in ("loss", "full_acc", "cond_acc") for k in range(ttt_steps)]
    return ["split", "epoch", "step", "loss", *per_position, "lr", "tokens_per_s"]


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

    Train records -> metrics.csv rows (and tokens/step time for throughput); val records -> a row, the
    checkpoint's validation.json, then best.json and pruning.
    """

    def __init__(self, spec: TrainSpec):
        super().__init__(level=logging.INFO)
        self.spec = spec
        self.columns = metric_columns(spec.ttt_steps)
        self.csv_path = spec.out / METRICS_CSV
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
        self._write({**values, "split": "val", "epoch": epoch, "step": step})
        # speculators saved this epoch's checkpoint before validating it: mark it complete.
        atomic.write_json(self.spec.checkpoint_dir / str(epoch) / COMPLETE_MARKER, {**values, "step": step})
        keep_checkpoints(self.spec.out, self.spec.keep_last)

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


# ---------------------------------------------------------------------------------------------------
# Running speculators.
# ---------------------------------------------------------------------------------------------------


def speculators_argv(spec: TrainSpec) -> list[str]:
    """The `speculators train` flags for this run."""
    d2t = np.load(spec.d2t_path, mmap_mode="r")
    on_cpu = spec.device == "cpu"
    argv = [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", spec.verifier_dir,
        "--data-path", spec.data_dir,
        "--hidden-states-backend", spec.hidden_states_backend,
        "--save-path", str(spec.checkpoint_dir),
        "--d2t-path", spec.d2t_path,
        "--t2d-path", spec.t2d_path,
        "--draft-vocab-size", str(d2t.shape[0]),
        "--target-layer-ids", *[str(i) for i in spec.layer_ids],
        # EAGLE-3 does not use a mask token; giving one skips loading the verifier's tokenizer
        # (Kimi's needs remote code).
        "--mask-token-id", "0",
        "--epochs", str(spec.epochs),
        "--lr", str(spec.lr),
        "--optimizer", spec.optimizer,
        "--total-seq-len", str(spec.total_seq_len),
        "--ttt-steps", str(spec.ttt_steps),
        "--ttt-step-loss-decay", str(spec.ttt_step_loss_decay),
        "--train-data-ratio", str(spec.train_ratio),
        "--hidden-states-dtype", spec.dtype,
        "--num-workers", str(spec.num_workers),
        "--seed", str(spec.seed),
        # Hidden states all come from stage 02; a missing file is an error, not a request to a vLLM server.
        "--on-missing", "raise",
        # flex attention has no CPU backward; the fused loss needs a Triton GPU driver.
        "--draft-attn-impl", "sdpa" if on_cpu else "simple_flex_attention",
        "--loss-implementation", "eager" if on_cpu else "fused",
        "--checkpoint-freq", "1",
        "--log-freq", "1",
        "--logger", "tensorboard",
        "--log-dir", str(spec.tensorboard_dir),
        "--run-name", "train",
        "--norm-before-residual" if spec.norm_before_residual else "--no-norm-before-residual",
        "--norm-before-fc" if spec.norm_before_fc else "--no-norm-before-fc",
        "--norm-output" if spec.norm_output else "--no-norm-output",
    ]
    # --fc-norm is a plain switch (off by default): it can only be given when on.
    if spec.fc_norm:
        argv.append("--fc-norm")
    if spec.max_steps is not None:
        argv += ["--max-steps", str(spec.max_steps)]
    if spec.fsdp_shard:
        argv.append("--fsdp-shard")
    if spec.init_from:
        argv += ["--from-pretrained", spec.init_from]
    else:
        argv += ["--draft-config", str(spec.out / DRAFT_CONFIG_FILE)]
    return argv


@contextlib.contextmanager
def _thread_settings(threads: int) -> Iterator[None]:
    """Run with `threads` torch threads and undo speculators' OMP/MKL/OpenBLAS=1 env defaults afterwards.

    speculators' loader sets those variables (setdefault) for its spawned workers; left in place they
    would pin every later child process of this one (vLLM included) to a single thread.
    """
    import torch

    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    saved_env = {name: os.environ.get(name) for name in names}
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(saved_threads)
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def run_speculators(spec: TrainSpec) -> None:
    """Run speculators' trainer for a prepared spec in this process (one rank under torchrun)."""
    import torch

    from patches import speculators_cpu

    speculators_cpu.apply()
    if spec.device == "cpu" and torch.accelerator.is_available():
        raise BadInput("train.device: 'cpu' was asked for but this host has an accelerator; set it to 'cuda'")
    if spec.device == "cuda" and not torch.accelerator.is_available():
        raise BadInput("train.device: 'cuda' was asked for but this host has no accelerator; set it to 'cpu'")

    from speculators.train.cli import main
    from speculators.train.config import TrainConfig
    from speculators.train.logger import setup_root_logger

    argv = speculators_argv(spec)
    # Under torchrun the ranks of a node share its cores.
    threads = spec.threads or max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    resumed_from = newest_checkpoint(spec.checkpoint_dir)
    recorder = MetricsRecorder(spec) if _rank() == 0 else None
    root = logging.getLogger()
    # speculators' console handler (set up here so its basicConfig is not skipped) rewrites dict messages
    # into text; the recorder must see them first.
    setup_root_logger()
    if recorder is not None:
        root.handlers.insert(0, recorder)
    started = time.perf_counter()
    try:
        with _thread_settings(threads), warnings.catch_warnings():
            # fp32 training on the CPU: torch reports that autocast to fp32 is a no-op, once per call site.
            warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
            # speculators always asks its loaders for pinned memory, which means nothing without an accelerator.
            warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator")
            main(TrainConfig.resolve(argv))
    finally:
        if recorder is not None:
            root.removeHandler(recorder)
    if recorder is not None:
        wall = time.perf_counter() - started
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        # Step time covers fetching the batch, forward, backward and optimizer; not validation or saving.
        per_rank = recorder.tokens / recorder.step_seconds if recorder.step_seconds else None
        atomic.write_json(
            spec.out / RUN_STATS_FILE,
            {
                "steps": recorder.steps,
                "train_tokens": int(round(recorder.tokens)) * world_size,
                "train_step_seconds": round(recorder.step_seconds, 3),
                # Rank 0's throughput times the number of ranks (every rank trains on its own batches).
                "train_tokens_per_s": None if per_rank is None else round(per_rank * world_size, 1),
                "wall_s": round(wall, 2),
                # This process only: dataloader workers are separate processes.
                "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                "world_size": world_size,
                "resumed_from": None
                if resumed_from is None
                else {"epoch": resumed_from["epoch"], "step": resumed_from["global_step"]},
                "threads": threads,
                "argv": argv,
            },
        )


# ---------------------------------------------------------------------------------------------------
# Finishing: best marker, pruning, plot, summary.
# ---------------------------------------------------------------------------------------------------


def plot_metrics(csv_path: Path, png_path: Path, ttt_steps: int) -> None:
    """Loss and per-position full accuracy, train per step and validation per epoch."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = read_metrics(csv_path)
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    figure = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(figure)
    loss_axes, acc_axes = figure.subplots(1, 2)
    loss_axes.plot([r["step"] for r in train], [r["loss"] for r in train], lw=0.8, alpha=0.6, label="train")
    loss_axes.plot([r["step"] for r in val], [r["loss"] for r in val], "o-", label="val")
    loss_axes.set(xlabel="optimizer step", ylabel="loss (sum over positions)", title="Loss")
    loss_axes.legend()
    for k in range(ttt_steps):
        key = f"full_acc_{k}"
        line = acc_axes.plot(
            [r["step"] for r in train], [r[key] for r in train], lw=0.8, alpha=0.4, label=f"train pos {k}"
        )[0]
        acc_axes.plot(
            [r["step"] for r in val], [r[key] for r in val], "o-", color=line.get_color(), label=f"val pos {k}"
        )
    acc_axes.set(xlabel="optimizer step", ylabel="full accuracy", title="Accuracy per draft position", ylim=(0, 1))
    acc_axes.legend(fontsize=7)
    figure.tight_layout()
    atomic.write_with(png_path, lambda tmp: figure.savefig(tmp, format="png", dpi=110))


def finalize_training(out_dir: str | os.PathLike) -> dict[str, Any]:
    """Mark the best checkpoint, prune, plot, and return the run summary."""
    out = Path(out_dir)
    spec = TrainSpec(**json.loads((out / SPEC_FILE).read_text()))
    keep_checkpoints(out, spec.keep_last)
    complete = complete_checkpoints(spec.checkpoint_dir)
    if not complete:
        raise RuntimeError(f"training left no complete checkpoint in {spec.checkpoint_dir}")
    last_epoch = max(complete)
    rows = read_metrics(out / METRICS_CSV)
    if rows:
        plot_metrics(out / METRICS_CSV, out / LOSS_PNG, spec.ttt_steps)
    run_stats = json.loads((out / RUN_STATS_FILE).read_text()) if (out / RUN_STATS_FILE).is_file() else {}
    last_train = next((r for r in reversed(rows) if r["split"] == "train"), None)
    last_val = next((r for r in reversed(rows) if r["split"] == "val"), None)
    return {
        "out_dir": str(out),
        "checkpoints": [f"{CHECKPOINTS}/{epoch}" for epoch in sorted(complete)],
        "last": {"epoch": last_epoch, "step": complete[last_epoch]["global_step"],
                 "checkpoint": f"{CHECKPOINTS}/{last_epoch}"},
        "best": json.loads((out / BEST_FILE).read_text()) if (out / BEST_FILE).is_file() else None,
        "epochs_completed": last_epoch + 1,
        "final_train": last_train,
        "final_val": last_val,
        "metrics_csv": METRICS_CSV,
        "loss_curves_png": LOSS_PNG if (out / LOSS_PNG).is_file() else None,
        "tensorboard_dir": str(spec.tensorboard_dir),
        "this_run": run_stats,
        "train_tokens_per_s": run_stats.get("train_tokens_per_s"),
        "peak_rss_mb": run_stats.get("peak_rss_mb"),
    }


def _main(argv: list[str]) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="Run one training rank (torchrun) or a whole run from a spec.")
    parser.add_argument("--spec", required=True, help="train_spec.json written by prepare()")
    args = parser.parse_args(argv)
    values = json.loads(Path(args.spec).read_text())
    known = {f.name for f in fields(TrainSpec)}
    spec = TrainSpec(**{k: v for k, v in values.items() if k in known})
    if "LOCAL_RANK" in os.environ:
        run_speculators(spec)  # prepared by torchrun_command(); finalize_training() runs afterwards
        return 0
    inputs = {k: v for k, v in asdict(spec).items() if k != "inputs"}
    summary = train_drafter(**inputs)
    print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
