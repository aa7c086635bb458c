"""Stage 04: train the EAGLE-3 drafter with speculators' own Trainer (patched for CPU and Kimi, see patches/).

Reads stage 02's hidden states and stage 03's vocabulary map; the drafter's decoder shape is derived from
the verifier or given explicitly (`train.draft_shape`, e.g. Kimi-K2.5's released drafters: head_dim 128).
From scratch, or fine-tuned from `train.init_from`: a speculators folder, or a flat released drafter
(AQ-MedAI, SpecForge, stage 05's `vllm/`) rewritten once into speculators' layout under `init_from/`, its aux
layer ids converted from `train.init_from_convention` (docs/released_drafters.md). One checkpoint per epoch,
each replayed on held-out conversations as the engine would serve it; the best is marked by predicted
acceptance length (`train.select_by`, or by validation loss). Validation holds out whole topics (about
train.val_ratio of the samples) and, with `train.early_stop_patience`, training ends once that many epochs
bring no better checkpoint.
Killed and rerun, training resumes from the last complete checkpoint (optimizer and step included).
With hidden_states.mode: online the states are not read from stage 02 but captured live: stage 04 starts (or
connects to) vLLM capture servers and trains through speculators' own online dataset, which discards each
sample's states after use (eagle_pipeline/online/, docs/online.md).

Embedded default (CPU, minutes):
    python 04_train.py --config configs/tiny.yaml
Full scale (8 GPUs through torch.distributed.run, `train.num_gpus: 8`, `train.fsdp_shard: true` to shard the drafter):
    python 04_train.py --config configs/kimi-k2.5-10k.yaml

Output in <data_root>/<run_name>/04_train/: checkpoints/<epoch>/ (speculators format), best.json,
metrics.csv, loss_curves.png, tensorboard/, manifest.json (tokens/s, peak memory, final accuracies).
"""

import contextlib
from pathlib import Path

import numpy as np

from eagle_pipeline import released_drafter
from eagle_pipeline.chat_template import chat_template_kwargs
from eagle_pipeline.config.base import REPO_ROOT
from eagle_pipeline.datacheck import check_training_data
from eagle_pipeline.drafter.folder import FlatDrafter, check_weights_whole, is_speculators_drafter, read_flat_drafter
from eagle_pipeline.drafter.layouts import DFLASH, MLA
from eagle_pipeline.drafter.planned import drafter_params, planned_draft_dims
from eagle_pipeline.drafter.tensors import mla_attention_shapes
from eagle_pipeline.errors import BadInput
from eagle_pipeline.fingerprint import model_dir_fingerprint, value_fingerprint
from eagle_pipeline.online.disk import window_bound
from eagle_pipeline.online.failure import CaptureUnavailable, capture_failure
from eagle_pipeline.online.memory import run_plan_lines, trainer_memory_line
from eagle_pipeline.online.session import OnlineSession, check_named_endpoints, dataset_rows, plan_lines
from eagle_pipeline.online.settings import OnlineTraining
from eagle_pipeline.plan.disk import training_bytes
from eagle_pipeline.plan.rehearsal import before_first_load, dry_run_lines
from eagle_pipeline.samples import planned_sample_layout
from eagle_pipeline.stage import (
    Stage,
    Start,
    check_disk,
    is_complete,
    main,
    not_run_yet_note,
    read_manifest,
    require_complete,
    require_sample_layout,
    upstream_fingerprint,
)
from eagle_pipeline.train import launch, runner
from eagle_pipeline.train.checkpoints import stopped_early
from eagle_pipeline.train.draft_config import check_draft_shape, check_same_vocab_map
from eagle_pipeline.train.finite_guard import stopped_reason
from eagle_pipeline.train.inputs import check_inputs
from eagle_pipeline.train.settings import TrainRun, recorded_settings
from eagle_pipeline.train.topic_split import dataset_topics, split_by_topic
from eagle_pipeline.verifier import Verifier
from eagle_pipeline.vocab import mask_token_id

INIT_FROM_DIR = "init_from"  # a flat train.init_from in speculators' layout


def released_init(cfg, verifier: Verifier, layer_ids: list[int]) -> tuple[FlatDrafter | None, dict | None]:
    """A flat train.init_from checked against this run (target, aux layers, stage 03's vocabulary) before
    any work, and the layer-id record for the manifest; (None, None) for a speculators folder."""
    t = cfg.train
    init_from = cfg.resolve_path(t.init_from)
    if not (init_from / "config.json").exists():
        raise BadInput(f"train.init_from: {init_from} is not a drafter directory (no "
                       "config.json); point it at a speculators or released drafter")
    if is_speculators_drafter(init_from):
        check_weights_whole(init_from, "train.init_from")
        if t.init_from_convention == "sglang":
            raise BadInput(f"train.init_from_convention: sglang, but {init_from} is a speculators "
                           "drafter, whose ids are always HF indices (the vllm convention); leave it out")
        return None, None
    if t.family == "dflash":  # z-lab's flat layout
        return released_drafter.read_dflash_release(init_from, verifier_dir=verifier.path, layer_ids=list(layer_ids),
                                                    hidden_size=verifier.hidden_size, vocab_size=verifier.vocab_size,
                                                    convention=t.init_from_convention)
    drafter = read_flat_drafter(init_from, "train.init_from")
    released_drafter.check_against_target(drafter, hidden_size=verifier.hidden_size, vocab_size=verifier.vocab_size)
    released_drafter.check_draft_vocab_size(drafter, cfg.vocab.draft_vocab_size)
    convention = released_drafter.layer_id_convention(drafter, t.init_from_convention)
    ids = released_drafter.hf_layer_ids(drafter, convention)
    if ids != list(layer_ids):
        raise BadInput(f"train.init_from: {drafter.config_path}: eagle_config.eagle_aux_hidden_state_layer_ids "
                       f"{drafter.written_layer_ids} in the {convention} convention are HF layers {ids}, but "
                       f"this run captured {list(layer_ids)}; check train.init_from_convention, or set "
                       f"hidden_states.layer_ids: {ids} and rerun stage 02")
    vocab_dir = cfg.stage_dir("03_build_vocab_map")
    if (vocab_dir / "d2t.npy").is_file() and "d2t" in drafter.tensor_files:  # a full-vocabulary one has none
        check_same_vocab_map(drafter.tensor_files["d2t"], vocab_dir / "d2t.npy", vocab_dir / "t2d.npy")
    return drafter, {"convention": convention, "written": drafter.written_layer_ids, "hf": ids}


def dflash_mask_token(cfg, verifier: Verifier) -> int | None:
    """A DFlash run's mask token (vocab.mask_token_id), kept off the answers stage 03 counted once it has; None for
    EAGLE-3, which has none."""
    if cfg.train.family != "dflash":
        return None
    counts = cfg.stage_dir("03_build_vocab_map") / "token_counts.npy"
    g = cfg.generation
    kwargs = chat_template_kwargs(verifier.chat_template(), g.reasoning, g.chat_template_kwargs)
    return mask_token_id(verifier.tokenizer, verifier.vocab_size, kwargs, cfg.train.dflash.mask_token_id,
                         np.load(counts) if is_complete(cfg, 3) else None)


def run(stage: Stage, dry_run: bool) -> None:
    cfg = stage.cfg
    t = cfg.train
    verifier = Verifier.from_config(cfg)
    check_draft_shape(t, verifier.text_config())  # dry run too, and before --force deletes anything
    mask_token = dflash_mask_token(cfg, verifier)
    planning = dry_run and not (is_complete(cfg, 2) and is_complete(cfg, 3))
    if planning:  # a fresh host: the shapes and the disk from the config and the target alone
        layout = planned_sample_layout(cfg, verifier.num_layers, verifier.hidden_size, verifier.vocab_size)
    else:
        hidden_manifest, layout = require_sample_layout(cfg)
        vocab_manifest = require_complete(cfg, 3)
        stored_mode = hidden_manifest.get("hidden_states_mode", "offline")
        if stored_mode != cfg.hidden_states.mode:
            raise BadInput(f"hidden_states.mode: {cfg.hidden_states.mode}, but stage 02 prepared "
                           f"its data for mode {stored_mode}; rerun 02_extract_hidden.py --force "
                           f"with this config, or set mode: {stored_mode}")
    layer_ids = list(layout.layer_ids)
    dims = planned_draft_dims(cfg, verifier, len(layer_ids))
    hidden, heads, kv_heads = dims.hidden_size, dims.num_attention_heads, dims.num_key_value_heads
    head_dim, inter = dims.head_dim, dims.intermediate_size
    params = drafter_params(dims)
    need = training_bytes(cfg, verifier, layout)
    online = cfg.hidden_states.mode == "online"
    if t.num_gpus == 0:
        launcher = "in-process on the CPU"
    else:
        sharding = "sharded with FSDP" if t.fsdp_shard else "replicated"
        launcher = f"torch.distributed.run on {t.num_gpus} GPU(s), drafter {sharding}"

    if dry_run:
        family = "a DFlash" if t.family == "dflash" else "an EAGLE-3"
        print(f"stage 04: train {family} drafter {launcher}, {t.epochs} epochs, {t.optimizer}, {t.dtype}, lr {t.lr}")
        if planning:
            print(not_run_yet_note(cfg, 2 if not is_complete(cfg, 2) else 3))
        print(f"  verifier {verifier.path} ({verifier.architecture}); aux layer ids {layer_ids}; stage 02 stores "
              f"{layout.num_hidden_states} slots x {layout.hidden_size} x {layout.storage_dtype.bytes_per_value} B = "
              f"{layout.num_hidden_states * layout.hidden_size * layout.storage_dtype.bytes_per_value} B per token")
        fc = f"fc [{hidden}, {len(layer_ids) * verifier.hidden_size}]"
        head = f"gate/up [{inter}, {hidden}], lm_head [{cfg.vocab.draft_vocab_size}, {hidden}]"
        if dims.layer_shape == MLA:  # the target's MLA attention (vLLM's Eagle3DeepseekV2ForCausalLM)
            print(f"  drafter: MLA layer, hidden {hidden}, heads {heads}, q_lora_rank {dims.q_lora_rank}, "
                  f"kv_lora_rank {dims.kv_lora_rank}, qk_nope_head_dim {dims.qk_nope_head_dim} + qk_rope_head_dim "
                  f"{dims.qk_rope_head_dim}, v_head_dim {dims.v_head_dim}, intermediate {inter}, "
                  f"draft vocab {cfg.vocab.draft_vocab_size}, ~{params / 1e6:.1f}M parameters")
            attention = ", ".join(f"{name.split('.')[1]} {list(shape)}"
                                  for name, shape in mla_attention_shapes(dims, 2 * hidden).items() if len(shape) == 2)
            print(f"  shapes: {fc}, {attention}, {head}")
        else:
            d, attn_in = t.dflash, hidden if dims.layer_shape == DFLASH else 2 * hidden
            if dims.layer_shape == DFLASH:  # speculators' DFlashDraftModel, vLLM's DFlashQwen3ForCausalLM
                print(f"  DFlash: {dims.num_layers} Qwen3 layer(s) with full attention, block {d.block_size} "
                      f"({d.block_size - 1} drafts per pass), {d.max_anchors} anchors per pack, mask token "
                      f"{mask_token} ({verifier.tokenizer.convert_ids_to_tokens(mask_token)})")
            print(f"  drafter: hidden {hidden}, heads {heads}/{kv_heads} kv, head_dim {head_dim}, "
                  f"intermediate {inter}, draft vocab {cfg.vocab.draft_vocab_size}, ~{params / 1e6:.1f}M parameters")
            print(f"  shapes: {fc}, q_proj [{heads * head_dim}, {attn_in}], k/v_proj [{kv_heads * head_dim}, "
                  f"{attn_in}], o_proj [{hidden}, {heads * head_dim}], {head}")
        print(trainer_memory_line(cfg, verifier, len(layer_ids)))
        init_note = ""
        if t.init_from:
            _, record = released_init(cfg, verifier, layer_ids)
            if record:
                init_note = f" (flat, {record['convention']} ids {record['written']} = HF {record['hf']})"
        print(f"  init_from {t.init_from or '(scratch)'}{init_note}; "
              f"checkpoints ~{need / 1e9:.2f} GB under {stage.dir}")
        if online:
            print("\n".join(plan_lines(cfg, layout.num_hidden_states, layout.hidden_size, cfg.hidden_states.max_seq_len)
                            + run_plan_lines(cfg, verifier, layout)))
            if cfg.hidden_states.capture_endpoints:  # asked now, as the run asks them before it writes anything
                rows = None if planning else dataset_rows(cfg.stage_dir("02_extract_hidden") / "data")
                check_named_endpoints(cfg, verifier, layout, rows)
        return

    init_from = cfg.resolve_path(t.init_from) if t.init_from else None
    released, layer_id_record = released_init(cfg, verifier, layer_ids) if init_from else (None, None)
    inputs = {
        "hidden_states": upstream_fingerprint(hidden_manifest),
        "vocab_map": upstream_fingerprint(vocab_manifest),
        "d2t": vocab_manifest["output_fingerprint"],
        "verifier": verifier.fingerprints()["verifier"],
        "layer_ids": layer_ids,
        "draft_vocab_size": cfg.vocab.draft_vocab_size,
        **recorded_settings(t),
        "init_from": model_dir_fingerprint(init_from) if init_from else None,
        "seed": cfg.seed,
    }
    if mask_token is not None:  # chosen from the tokenizer, the template and the answers: recorded as chosen
        inputs["mask_token_id"] = mask_token
    if layer_id_record:  # only then, so that other runs keep their recorded inputs
        inputs["init_from_layer_ids"] = layer_id_record
    if online:  # fp8 in flight changes what the drafter learns from; where the states come from does not
        inputs["online_transfer"] = cfg.hidden_states.transfer
    vocab_dir = cfg.stage_dir("03_build_vocab_map")
    train_run = TrainRun(
        data_dir=cfg.stage_dir("02_extract_hidden") / "data",
        d2t_path=vocab_dir / "d2t.npy", t2d_path=vocab_dir / "t2d.npy",
        verifier_dir=verifier.path, out_dir=stage.dir, layer_ids=layer_ids, seed=cfg.seed,
        storage_dtype=layout.storage_dtype, device="cpu" if t.num_gpus == 0 else "cuda",
        init_from_dir=stage.dir / INIT_FROM_DIR if released else None,
        online=OnlineTraining.from_config(cfg.hidden_states) if online else None, mask_token_id=mask_token,
    )
    samples = hidden_manifest["counts"]["samples"]

    def ready_to_train() -> None:  # checked before anything is written
        in_flight = 0
        if online and cfg.hidden_states.transfer != "mooncake":  # a local server's states in flight land in stage.dir
            in_flight = window_bound(cfg, layout.num_hidden_states, layout.hidden_size, cfg.hidden_states.max_seq_len)
        check_disk(stage.dir, need + in_flight,
                   "drafter checkpoints" + (" and the states in flight" if in_flight else ""))
        if not online:  # an online run's states are checked as they arrive (speculators) and at each server's probe
            check_training_data(cfg.stage_dir("02_extract_hidden") / "data", layout.num_hidden_states,
                                layout.hidden_size, cfg.seed)
        elif cfg.hidden_states.capture_endpoints:  # servers elsewhere: the target, layer ids and connector each serves
            check_named_endpoints(cfg, verifier, layout, dataset_rows(train_run.data_dir))
        else:  # the capture server this stage starts, configured by vLLM's own code before it loads the target
            before_first_load(cfg, stage.number)
        check_inputs(t, train_run)  # the trainer checks these again; a refusal here leaves no "running" manifest

    if stage.begin(inputs, samples=samples, before_writing=ready_to_train) is Start.ALREADY_COMPLETE:
        # A finished run whose epoch count was raised continues training from its last checkpoint.
        done = read_manifest(stage.dir)["counts"].get("epochs_completed")
        if done == t.epochs or stopped_early(stage.dir, t.early_stop_patience, t.select_by):
            print(f"stage 04 already complete for these inputs: {stage.dir}")
            return

    if released and t.family == "dflash":
        written = released_drafter.write_dflash_release(released, Path(train_run.init_from_dir),
                                                        verifier_dir=verifier.path, layer_ids=layer_ids)
    elif released:
        written = released_drafter.write_speculators_folder(
            released, Path(train_run.init_from_dir), verifier_dir=verifier.path, layer_ids=layer_ids,
            ttt_steps=t.ttt_steps,
            vocab_map=(np.load(train_run.d2t_path), np.load(train_run.t2d_path)))
        print(f"train.init_from: {released.path} ({layer_id_record['convention']} ids {layer_id_record['written']} "
              f"= HF {layer_id_record['hf']}) -> {written['dir']} (speculators layout, the target's embedding)")
    session = contextlib.nullcontext()
    if online:  # eagle_pipeline/online/session.py, for the rows and the validation split runner.prepare makes
        rows = dataset_rows(train_run.data_dir)
        split = split_by_topic(dataset_topics(train_run.data_dir), t.val_ratio, cfg.seed)
        session = OnlineSession(cfg, stage.dir, train_run, verifier, layout, rows, split.val_rows)
    with session:  # online: capture servers up and checked, kept validation rows captured, states in flight watched
        if t.num_gpus == 0:
            summary = runner.train_drafter(t, train_run)
        else:
            command = launch.torchrun_command(t, train_run)
            print("running:", " ".join(command))
            # Each rank imports eagle_pipeline from the repository.
            returncode = launch.run_torchrun(command, cwd=REPO_ROOT)
            if returncode != 0:
                reason = stopped_reason(stage.dir)  # the ranks stopped themselves (a loss that is not finite)
                if reason:
                    raise BadInput(reason)
                if online and capture_failure(stage.dir):  # a capture server stayed away
                    raise CaptureUnavailable(capture_failure(stage.dir))
                raise RuntimeError(f"torch.distributed.run exited with {returncode}")
            summary = runner.finalize_training(t, train_run)

    final_val = summary.get("final_val") or {}
    counts = {
        "samples": hidden_manifest["counts"]["samples"],
        "epochs_completed": summary["epochs_completed"],
        "last_checkpoint": summary["last"]["checkpoint"],
        "best": summary["best"],
        "stopped_early": summary["stopped_early"],
        "validation_split": summary["split"],
        "final_val": final_val,
        "final_train": summary.get("final_train"),
        "train_tokens_per_s": summary.get("train_tokens_per_s"),
        "peak_rss_mb": summary.get("peak_rss_mb"),
        "drafter_parameters": params,
    }
    if online:
        counts["online"] = session.summary()
    stage.finish(counts, output_fingerprint=value_fingerprint([summary["last"], summary["best"]]))
    best = summary["best"] or {}
    val_loss, predicted = best.get("val_loss"), best.get("predicted_acceptance_length")
    chosen = (f"predicted acceptance length {predicted:.2f}, " if predicted is not None else "") + (
        f"val loss {val_loss:.4g}" if val_loss is not None else "no validation")
    print(f"stage 04 done: {summary['epochs_completed']} epochs, best checkpoint {best.get('checkpoint')} by "
          f"{best.get('selected_by')} ({chosen}), {summary.get('train_tokens_per_s')} tokens/s, "
          f"peak RSS {summary.get('peak_rss_mb')} MB -> {stage.dir}")


if __name__ == "__main__":
    main(4, __doc__, run, rehearsal=dry_run_lines)
