"""Running a training: prepare the output folder, run speculators' Trainer in this process (one rank
under torch.distributed.run), and summarise the result."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import resource
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from eagle_pipeline import atomic
from eagle_pipeline.config import TrainConfig, resolve_path
from eagle_pipeline.errors import BadInput
from eagle_pipeline.online.failure import online_rank
from eagle_pipeline.online.kept import KEPT_DIR, link_kept_states
from eagle_pipeline.online.settings import speculators_flags, with_flags
from eagle_pipeline.train.checkpoints import (
    BEST_FILE,
    complete_checkpoints,
    keep_checkpoints,
    newest_checkpoint,
    remove_torn_checkpoints,
    stopped_early,
    training_finished,
)
from eagle_pipeline.train.draft_config import DRAFT_CONFIG_FILE, build_draft_config, check_init_from
from eagle_pipeline.train.early_stop import EarlyStopping, StopTraining
from eagle_pipeline.train.finite_guard import STOPPED_FILE, NonFiniteLossGuard
from eagle_pipeline.train.inputs import check_inputs
from eagle_pipeline.train.metrics import (
    LOSS_PNG,
    METRICS_CSV,
    MetricsRecorder,
    metric_columns,
    plot_metrics,
    position_columns,
    read_metrics,
    truncate_metrics,
)
from eagle_pipeline.train.predicted_acceptance import CheckpointPredictor
from eagle_pipeline.train.settings import CHECKPOINTS, TrainRun, draft_positions
from eagle_pipeline.train.stop import GracefulStop
from eagle_pipeline.train.topic_split import dataset_topics, read_split, split_by_topic, split_summary, write_split_view

logger = logging.getLogger(__name__)

RUN_STATS_FILE = "run_stats.json"


def train_drafter(train: TrainConfig, run: TrainRun) -> dict[str, Any]:
    """Train (or resume training) a drafter in this process and return the run summary (the decoder and what
    train.init_from must match: train/draft_config.py)."""
    prepare(train, run)
    if training_finished(run.checkpoint_dir, train.epochs, run.max_steps, train.early_stop_patience, train.select_by):
        logger.info("Training in %s already finished; nothing to train.", run.out_dir)
    else:
        run_speculators(train, run)
    return finalize_training(train, run)


def prepare(train: TrainConfig, run: TrainRun) -> None:
    """Validate everything a run needs, then leave out_dir ready for speculators to start or resume."""
    verifier_text_config = check_inputs(train, run)
    draft_config = build_draft_config(train, run, verifier_text_config)
    if train.init_from:
        check_init_from(train, run, draft_config)
    split = split_by_topic(dataset_topics(run.data_dir), train.val_ratio, run.seed)
    run.out_dir.mkdir(parents=True, exist_ok=True)
    atomic.sweep_temporaries(run.out_dir)
    for name in remove_torn_checkpoints(run.checkpoint_dir):
        logger.warning("Removed incomplete checkpoint %s (the run was stopped while writing it).", name)
    atomic.write_json(run.out_dir / DRAFT_CONFIG_FILE, draft_config)
    view = write_split_view(run.data_dir, run.out_dir, split)
    if run.online is not None:  # stage 02 stored no states: the view links only the validation rows kept online
        link_kept_states(view, split.train_rows + split.val_rows, run.out_dir / KEPT_DIR)
    truncate_metrics(run.out_dir / METRICS_CSV, newest_checkpoint(run.checkpoint_dir))


def speculators_argv(train: TrainConfig, run: TrainRun) -> list[str]:
    """The `speculators train` flags for this run."""
    d2t = np.load(run.d2t_path, mmap_mode="r")
    on_cpu = run.device == "cpu"
    argv = [
        "--speculator-type", train.family,
        "--verifier-name-or-path", str(run.verifier_dir),
        # Stage 02's data with the validation topics last (topic_split.py); the ratio puts the boundary there.
        "--data-path", str(run.split_dir),
        "--hidden-states-backend", run.storage_dtype.speculators_backend,
        "--save-path", str(run.checkpoint_dir),
        "--d2t-path", str(run.d2t_path),
        "--t2d-path", str(run.t2d_path),
        "--draft-vocab-size", str(d2t.shape[0]),
        "--target-layer-ids", *[str(i) for i in run.layer_ids],
        "--epochs", str(train.epochs),
        "--lr", str(train.lr),
        "--optimizer", train.optimizer,
        "--total-seq-len", str(train.total_seq_len),
        "--train-data-ratio", repr(read_split(run.out_dir)["train_data_ratio"]),
        "--hidden-states-dtype", train.dtype,
        "--num-workers", str(train.num_workers),
        "--seed", str(run.seed),
        # Hidden states all come from stage 02; a missing file is an error, not a request to a vLLM server.
        "--on-missing", "raise",
        # flex attention has no CPU backward, and an MLA layer's attention takes dense masks on every device
        # (patches/speculators_ttt_attention.py); the fused loss needs a Triton GPU driver.
        "--draft-attn-impl", "sdpa" if on_cpu or train.draft_layer == "mla" else "simple_flex_attention",
        "--loss-implementation", "eager" if on_cpu else "fused",
        "--checkpoint-freq", "1",
        "--log-freq", "1",
        "--logger", "tensorboard",
        "--log-dir", str(run.tensorboard_dir),
        "--run-name", "train",
    ]
    if train.family == "dflash":  # a given mask token also spares speculators the verifier's tokenizer
        d = train.dflash
        argv += ["--block-size", str(d.block_size), "--max-anchors", str(d.max_anchors),
                 "--mask-token-id", str(run.mask_token_id)]
    else:
        argv += [
            # EAGLE-3 does not use a mask token; giving one skips loading the verifier's tokenizer
            # (Kimi's needs remote code).
            "--mask-token-id", "0",
            "--ttt-steps", str(train.ttt_steps),
            "--ttt-step-loss-decay", str(train.ttt_step_loss_decay),
            "--norm-before-residual" if train.norm_before_residual else "--no-norm-before-residual",
            "--norm-before-fc" if train.norm_before_fc else "--no-norm-before-fc",
            "--norm-output" if train.norm_output else "--no-norm-output",
        ]
        # --fc-norm is a plain switch (off by default): it can only be given when on.
        if train.fc_norm:
            argv.append("--fc-norm")
    if run.max_steps is not None:
        argv += ["--max-steps", str(run.max_steps)]
    if train.fsdp_shard:
        argv.append("--fsdp-shard")
    if train.init_from:
        argv += ["--from-pretrained", str(run.init_from_dir or resolve_path(train.init_from))]
    else:
        argv += ["--draft-config", str(run.out_dir / DRAFT_CONFIG_FILE)]
    if run.online is not None:  # speculators' online dataset asks the capture servers for every other sample
        argv = with_flags(argv, speculators_flags(run.online, _rank()))
    return argv


def torch_threads(train: TrainConfig, run: TrainRun) -> int:
    """train.threads on the CPU; otherwise (and by default) this rank's share of the node's cores."""
    if run.device == "cpu" and train.threads:
        return train.threads
    return max(1, len(os.sched_getaffinity(0)) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


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


# How long a rank may wait at a collective: long enough for rank 0's replay of a Kimi-sized checkpoint on the
# CPU (train.predict_conversations held-out conversations), which NCCL's default 10 minutes may not cover.
PROCESS_GROUP_TIMEOUT_S = 3 * 3600


def run_speculators(train: TrainConfig, run: TrainRun) -> None:
    """Run speculators' trainer for a prepared run in this process (one rank under torch.distributed.run)."""
    import torch

    from patches import (
        speculators_capture_stop,
        speculators_cpu,
        speculators_mla,
        speculators_packing,
        speculators_sample_check,
        speculators_stop,
        speculators_ttt_attention,
        torch_process_group_timeout,
    )

    # Rank 0 replays each epoch's checkpoint while the other ranks wait at their next collective.
    torch_process_group_timeout.apply(PROCESS_GROUP_TIMEOUT_S)
    speculators_cpu.apply()
    # An MLA drafter's layer (train.draft_layer: mla), registered with speculators; inert for Llama drafters.
    speculators_mla.apply()
    speculators_packing.apply(train.packing)
    speculators_ttt_attention.apply()
    # Online: a capture server that stays away stops training at the first sample it fails.
    speculators_capture_stop.apply()
    # Every sample read from stage 02's files: no token row all zero or constant in any slot.
    speculators_sample_check.apply()
    # A stop (SIGTERM, Ctrl-C) keeps every epoch whose training ended (eagle_pipeline/train/stop.py).
    graceful = GracefulStop()
    speculators_stop.apply(graceful)
    # speculators trains on the accelerator whenever there is one.
    if run.device == "cpu" and torch.accelerator.is_available():
        raise BadInput("train.num_gpus: 0 trains on the CPU but this host has an accelerator; "
                       "set it to the GPUs to use")
    if run.device == "cuda" and not torch.accelerator.is_available():
        raise BadInput("train.num_gpus: GPU training was asked for but this host has no accelerator; set it to 0")

    from speculators.train.cli import main
    from speculators.train.config import TrainConfig as SpeculatorsTrainConfig
    from speculators.train.logger import setup_root_logger

    argv = speculators_argv(train, run)
    threads = torch_threads(train, run)
    resumed_from = newest_checkpoint(run.checkpoint_dir)
    predictor = None
    if train.predict_conversations:
        predictor = CheckpointPredictor(run.data_dir, run.out_dir, run.checkpoint_dir, train.predict_conversations,
                                        draft_positions(train), train.family)
    recorder = (MetricsRecorder(run.out_dir, metric_columns(train), train.keep_last, train.select_by, predictor)
                if _rank() == 0 else None)
    early_stop = None
    if train.early_stop_patience is not None:
        best_file = run.out_dir / BEST_FILE
        best = json.loads(best_file.read_text()) if resumed_from is not None and best_file.is_file() else None
        early_stop = EarlyStopping(train.early_stop_patience, best,
                                   predictor if train.select_by == "predicted_acceptance" else None)
    guard = NonFiniteLossGuard(run.out_dir, train.init_from, write_reason=_rank() == 0)
    (run.out_dir / STOPPED_FILE).unlink(missing_ok=True)
    root = logging.getLogger()
    # speculators' console handler (set up here so its basicConfig is not skipped) rewrites dict messages
    # into text; the recorder must see them first.
    setup_root_logger()
    # The guard first (a non-finite validation must not mark its checkpoint complete), then the recorder (an
    # epoch is marked validated before early stopping may end the run after it), then a deferred stop.
    handlers = [h for h in (guard, recorder, early_stop, graceful) if h is not None]
    for handler in reversed(handlers):
        root.handlers.insert(0, handler)
    started = time.perf_counter()
    try:
        with _thread_settings(threads), warnings.catch_warnings():
            # fp32 training on the CPU: torch reports that autocast to fp32 is a no-op, once per call site.
            warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
            # speculators always asks its loaders for pinned memory, which means nothing without an accelerator.
            warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator")
            try:
                with graceful, online_rank(run.online, run.out_dir, _rank()):
                    main(SpeculatorsTrainConfig.resolve(argv))
            except StopTraining as stop:
                logger.info("Stopped early: %s.", stop)
                from speculators.train.distributed import maybe_destroy_distributed

                maybe_destroy_distributed()
            except BadInput as refused:  # a rank's refusal (a flat sample) is what stage 04 reports for its ranks
                if not (run.out_dir / STOPPED_FILE).exists():
                    atomic.write_json(run.out_dir / STOPPED_FILE, {"reason": " ".join(str(refused).splitlines())})
                raise
    finally:
        speculators_stop.apply(None)
        for handler in handlers:
            root.removeHandler(handler)
    if recorder is not None:
        wall = time.perf_counter() - started
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
        # Step time covers fetching the batch, forward, backward and optimizer; not validation or saving.
        per_rank = recorder.tokens / recorder.step_seconds if recorder.step_seconds else None
        atomic.write_json(
            run.out_dir / RUN_STATS_FILE,
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


def finalize_training(train: TrainConfig, run: TrainRun) -> dict[str, Any]:
    """Mark the best checkpoint, prune, plot, and return the run summary."""
    out = run.out_dir
    keep_checkpoints(out, train.keep_last, train.select_by)
    complete = complete_checkpoints(run.checkpoint_dir)
    if not complete:
        raise RuntimeError(f"training left no complete checkpoint in {run.checkpoint_dir}")
    last_epoch = max(complete)
    rows = read_metrics(out / METRICS_CSV)
    if rows:
        plot_metrics(out / METRICS_CSV, out / LOSS_PNG, position_columns(train))
    run_stats = json.loads((out / RUN_STATS_FILE).read_text()) if (out / RUN_STATS_FILE).is_file() else {}
    last_train = next((r for r in reversed(rows) if r["split"] == "train"), None)
    last_val = next((r for r in reversed(rows) if r["split"] == "val"), None)
    return {
        "out_dir": str(out),
        "checkpoints": [f"{CHECKPOINTS}/{epoch}" for epoch in sorted(complete)],
        "last": {"epoch": last_epoch, "step": complete[last_epoch]["global_step"],
                 "checkpoint": f"{CHECKPOINTS}/{last_epoch}"},
        "best": json.loads((out / BEST_FILE).read_text()) if (out / BEST_FILE).is_file() else None,
        "stopped_early": stopped_early(out, train.early_stop_patience, train.select_by),
        "split": split_summary(out),
        "epochs_completed": last_epoch + 1,
        "final_train": last_train,
        "final_val": last_val,
        "metrics_csv": METRICS_CSV,
        "loss_curves_png": LOSS_PNG if (out / LOSS_PNG).is_file() else None,
        "tensorboard_dir": str(run.tensorboard_dir),
        "this_run": run_stats,
        "train_tokens_per_s": run_stats.get("train_tokens_per_s"),
        "peak_rss_mb": run_stats.get("peak_rss_mb"),
    }
