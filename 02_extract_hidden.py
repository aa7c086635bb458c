"""Stage 02: the target's auxiliary hidden states for every training conversation, captured through vLLM.

Each conversation's sequence is the token ids stage 01 recorded from vLLM: the rendered prompt and the
target's completion (loss mask = 1 on the completion; eagle_pipeline/sequences.py). It is run through
vLLM's `extract_hidden_states` speculative method, which hands the residual stream at the aux layer ids
(HF `hidden_states` indices, default (2, L//2, L-3)) plus the final layer (pre-norm) to a hidden-states KV
connector. Output is speculators' offline format, read unchanged by its trainer.

Embedded default (CPU, a few minutes):
    python 02_extract_hidden.py --config configs/tiny.yaml
Full scale (8 GPUs; ~57 KB per token for Kimi-K2.5, ~0.8 TB for 10k samples):
    python 02_extract_hidden.py --config configs/kimi-k2.5-10k.yaml

Output in <data_root>/<run_name>/02_extract_hidden/:
    data/                         arrow dataset: sample_id, topic, input_ids, loss_mask, seq_len (row i <-> hs_i)
    data/hidden_states/hs_<i>.safetensors   hidden_states [seq, n_aux+1, H], token_ids [seq]
    manifest.json                 inputs (verifier, tokenizer, chat template, layer ids, ...), counts, tokens/s
A sample's file is checked (token ids, shape, finite values) before it is written, atomically; the first batch's
states are checked for meaning (eagle_pipeline/state_meaning.py) before the rest is captured; a rerun keeps every
file whose token ids still match its row and captures the rest.
With hidden_states.mode: online it writes data/ without hidden_states: stage 04 captures the states live from vLLM
capture servers and discards them after use (docs/online.md). With hidden_states.one_pass it starts no engine: stage
01 captured each conversation's states while it answered, all but the answer's last token (which no forward pass
ran), so row i is prompt + answer less that token, and hs_<i> is linked to (or, cut at max_seq_len, written from)
stage 01's states/hs_<i>, under the same checks (docs/one_pass.md).
"""

import contextlib
import os
import shutil
import time
from pathlib import Path

from eagle_pipeline import atomic, plots
from eagle_pipeline.capture import HiddenStateCapture, capture_memory_line, capture_sizing
from eagle_pipeline.engine import apply_engine_env, capture_engine_kwargs, target_engine_fingerprint
from eagle_pipeline.errors import BadInput
from eagle_pipeline.fingerprint import value_fingerprint
from eagle_pipeline.plan.disk import amount, later_stages_bytes, plan_run, same_disk
from eagle_pipeline.plan.rehearsal import before_first_load, dry_run_lines
from eagle_pipeline.samples import (
    SAMPLES_DIR,
    STATES_DIR,
    estimate_bytes,
    planned_sample_layout,
    sample_files,
    sample_from_stored,
    sample_matches,
    sample_path,
    write_sample,
)
from eagle_pipeline.sequences import training_sequence
from eagle_pipeline.stage import (
    STAGES,
    Stage,
    Start,
    check_disk,
    is_complete,
    main,
    not_run_yet_note,
    require_complete,
    upstream_fingerprint,
)
from eagle_pipeline.verifier import Verifier


def write_dataset(rows: list[dict], data_dir: Path) -> None:
    """Write the arrow dataset into data_dir beside hidden_states/, replacing any older dataset files."""
    from datasets import Dataset

    data_dir.mkdir(parents=True, exist_ok=True)
    with atomic.atomic_dir(data_dir.parent / "dataset.staging") as tmp:
        # speculators' loader indexes rows as tensors: the torch format is stored with the dataset.
        Dataset.from_list(rows).with_format("torch").save_to_disk(str(tmp))
        new_files = {p.name for p in tmp.iterdir()}
        for old in data_dir.glob("data-*.arrow"):
            if old.name not in new_files:
                old.unlink()
        # state.json names the arrow files, so it moves last: a torn move leaves the old state readable.
        for name in sorted(new_files, key=lambda n: n == "state.json"):
            os.replace(tmp / name, data_dir / name)


def samples_to_capture(rows: list[dict], hs_dir: Path, num_states: int, hidden_size: int) -> list[int]:
    """Rows whose file is missing or no longer matches the row (token ids, shape, whole); reads only."""
    from tqdm import tqdm

    return [i for i, row in enumerate(tqdm(rows, desc="check existing", unit="file", leave=False))
            if not sample_matches(sample_path(hs_dir, i), row["input_ids"], num_states, hidden_size)]


# Where one pass's states come from, and so what a failed check asks for.
ONE_PASS_RERUN = "rerun stage 01 with --force (its answering engine captured them in one pass), then stage 02"


def check_first_batch(hs_dir: Path, rows: list[dict], batch: list[int], head, layer_ids: list[int], num_layers: int, *,
                      greedy: bool, model_runner: str, rerun: str = "rerun stage 02") -> dict:
    """The meaning check on the first batch captured, before the rest: a systematic fault of the capture path (a
    slot lost or shifted) shows in every batch, and at full scale the whole capture costs hours and a terabyte
    first. On a failure the batch's files are removed, so that a rerun captures them again."""
    from eagle_pipeline.state_meaning import check_stage02_samples

    other = ("" if model_runner == "v1" else
             ", or capture with vLLM's V1 model runner, whose capture "
             "path is the tested one (verifier.model_runner: v1)")
    fix = (f"stage 02 stopped after its first batch ({len(batch)} samples, their files removed): check the engine's "
           f"settings (docs/engines.md, \"Engine settings\"){other}, and {rerun}")
    try:
        return check_stage02_samples(hs_dir, rows, head, layer_ids, num_layers, greedy=greedy, among=batch, fix=fix)
    except BadInput:
        for row_index in batch:
            sample_path(hs_dir, row_index).unlink(missing_ok=True)
        raise


def plan_without_conversations(stage: Stage) -> None:
    """Dry run on a fresh host: the shapes and the disk bound from the config and the target alone."""
    cfg = stage.cfg
    verifier = Verifier.from_config(cfg)
    layout = planned_sample_layout(cfg, verifier.num_layers, verifier.hidden_size, verifier.vocab_size)
    if cfg.hidden_states.mode == "online":
        return print_online_plan(stage, verifier, layout, num_samples=cfg.data.num_samples,
                                 note=not_run_yet_note(cfg, 1))
    max_tokens = cfg.data.num_samples * cfg.hidden_states.max_seq_len
    need = estimate_bytes(max_tokens, layout.num_hidden_states, layout.hidden_size, layout.storage_dtype)
    print(f"stage 02: capture hidden states of {cfg.data.num_samples} conversations")
    print(not_run_yet_note(cfg, 1))
    print(f"  verifier {verifier.path} ({verifier.architecture}, {verifier.num_layers} layers, "
          f"hidden {layout.hidden_size}), tensor_parallel={cfg.verifier.tensor_parallel_size}, "
          f"expert_parallel={cfg.verifier.enable_expert_parallel}")
    print(f"  aux layer ids {list(layout.layer_ids)} + final layer {verifier.num_layers}; stored "
          f"as {layout.storage_dtype} [seq, {layout.num_hidden_states}, {layout.hidden_size}]")
    if cfg.hidden_states.one_pass:
        return print("  one pass: stage 01 captures and stores them while it answers (its disk plan); stage 02 links "
                     "its files to them and starts no engine")
    later, what = later_stages_bytes(cfg, verifier, layout)
    expected = plan_run(cfg, verifier, layout).stage(2)
    print(f"  disk: ~{amount(expected.bytes)} of hidden states {expected.detail} ({need / max_tokens / 1e3:.1f} "
          f"KB/token), at most ~{need / 1e9:.1f} GB (every conversation at hidden_states.max_seq_len "
          f"{cfg.hidden_states.max_seq_len}), under {stage.dir}; stage 02 also reserves {what}")
    print(capture_memory_line(cfg, layout.num_hidden_states, layout.hidden_size,
                              cfg.hidden_states.max_seq_len) + " (at most)")


def run(stage: Stage, dry_run: bool) -> None:
    cfg = stage.cfg
    if dry_run and not is_complete(cfg, 1):
        return plan_without_conversations(stage)
    upstream = require_complete(cfg, 1)
    hs_cfg = cfg.hidden_states
    verifier = Verifier.from_config(cfg)
    layout = planned_sample_layout(cfg, verifier.num_layers, verifier.hidden_size, verifier.vocab_size)
    layer_ids, num_states, hidden_size = list(layout.layer_ids), layout.num_hidden_states, layout.hidden_size
    one_pass = hs_cfg.one_pass
    captured = {key: upstream["inputs"].get(key) for key in ("layer_ids", "storage_dtype")}
    if one_pass and captured != {"layer_ids": layer_ids, "storage_dtype": layout.storage_dtype.value}:
        what = ("answered without hidden_states.one_pass" if captured["layer_ids"] is None else
                f"captured layers {captured['layer_ids']} as {captured['storage_dtype']} in one pass")
        raise BadInput(f"{cfg.stage_dir(STAGES[1])}: stage 01 {what}, the config asks for layers {layer_ids} as "
                       f"{layout.storage_dtype}; rerun 01_generate_data.py with --force (a new pass), or set "
                       f"hidden_states.one_pass: false to capture them here from the same answers")

    # -- token ids and loss masks ---------------------------------------------------------------------
    from datasets import load_from_disk

    conversations_dir = cfg.stage_dir("01_generate_data") / "conversations"
    conversations = load_from_disk(str(conversations_dir))
    if "completion_token_ids" not in conversations.column_names:
        raise BadInput(f"{conversations_dir}: has no token ids (made by an older "
                       "stage 01); rerun 01_generate_data.py with --force")
    rows = []
    for conv in conversations:
        answer = conv["completion_token_ids"][:-1] if one_pass else conv["completion_token_ids"]
        ids, mask = training_sequence(conv["prompt_token_ids"], answer, max_len=hs_cfg.max_seq_len)
        # The topic lets stage 04 validate on whole topics; conversations from before it was recorded are
        # each their own topic.
        topic = conv.get("topic") or conv["prompt_id"]
        rows.append({"sample_id": conv["sample_id"], "topic": topic, "input_ids": ids, "loss_mask": mask,
                     "seq_len": len(ids)})
    total_tokens = sum(r["seq_len"] for r in rows)
    need = estimate_bytes(total_tokens, num_states, hidden_size, hs_cfg.storage_dtype)

    if dry_run and hs_cfg.mode == "online":
        return print_online_plan(stage, verifier, layout, rows)
    if dry_run:
        source = "rows from stage 01's one-pass states, no engine," if one_pass else "capture hidden states"
        print(f"stage 02: {source} of {len(rows)} conversations ({total_tokens} tokens)")
        print(f"  verifier {verifier.path} ({verifier.architecture}, {verifier.num_layers} layers, "
              f"hidden {hidden_size}), tensor_parallel={cfg.verifier.tensor_parallel_size}, "
              f"expert_parallel={cfg.verifier.enable_expert_parallel}")
        print(f"  aux layer ids {layer_ids} + final layer {verifier.num_layers}; stored as {hs_cfg.storage_dtype} "
              f"[seq, {num_states}, {hidden_size}]")
        later, what = later_stages_bytes(cfg, verifier, layout)
        print(f"  disk needed ~{need / 1e9:.2f} GB ({need / max(total_tokens, 1) / 1e3:.1f} "
              f"KB/token) under {stage.dir}, plus {what} reserved")
        if not one_pass:
            print(capture_memory_line(cfg, num_states, hidden_size, max((r["seq_len"] for r in rows), default=1)))
        return

    inputs = {
        "conversations": upstream_fingerprint(upstream),
        **verifier.fingerprints(),
        "layer_ids": layer_ids,
        "engine": target_engine_fingerprint(cfg, cfg.verifier.dtype),
        "storage_dtype": hs_cfg.storage_dtype,
        "max_seq_len": hs_cfg.max_seq_len,
    }
    if hs_cfg.mode == "online" or one_pass:  # only then, so that two-pass offline runs keep their recorded inputs
        inputs["mode"] = "online" if hs_cfg.mode == "online" else "one pass"
    data_dir = stage.dir / "data"
    hs_dir = data_dir / SAMPLES_DIR

    # Where stage 02 fills the disk that stages 04 and 06 write to next, their share is reserved now.
    later, later_what = later_stages_bytes(cfg, verifier, layout)
    if not same_disk(hs_dir, cfg.stage_dir("04_train")):
        later, later_what = 0, "nothing for later stages (they write to another disk)"

    def disk_needed(todo: list[int]) -> int:  # one pass links every row not cut at max_seq_len: no bytes
        written = [i for i in todo if not one_pass or rows[i]["seq_len"] == hs_cfg.max_seq_len]
        return estimate_bytes(sum(rows[i]["seq_len"] for i in written), num_states, hidden_size,
                              hs_cfg.storage_dtype) + later

    def room_for_samples() -> None:  # a want of disk is refused before anything is written
        if hs_cfg.mode == "offline":
            todo = samples_to_capture(rows, hs_dir, num_states, hidden_size)
            check_disk(hs_dir, disk_needed(todo), f"hidden states for {len(todo)} samples and {later_what}")

    if stage.begin(inputs, samples=len(rows), before_writing=room_for_samples) is Start.ALREADY_COMPLETE:
        print(f"stage 02 already complete for these inputs: {stage.dir}")
        return

    hs_dir.mkdir(parents=True, exist_ok=True)
    write_dataset(rows, data_dir)
    if hs_cfg.mode == "online":
        return finish_online(stage, rows, verifier, layout)

    # -- resume: keep files whose token ids still match their row -------------------------------------
    # Again after start(), which removes recorded files that no longer match the manifest.
    todo = samples_to_capture(rows, hs_dir, num_states, hidden_size)
    for row_index in todo:
        sample_path(hs_dir, row_index).unlink(missing_ok=True)
    for row_index, stray in sample_files(hs_dir).items():  # rows beyond the current sample count
        if row_index >= len(rows):
            stray.unlink()
    todo_tokens = sum(rows[i]["seq_len"] for i in todo)
    check_disk(hs_dir, disk_needed(todo), f"hidden states for {len(todo)} samples and {later_what}")
    print(f"stage 02: {len(rows) - len(todo)} of {len(rows)} samples "
          f"already captured, {len(todo)} to capture ({todo_tokens} tokens)")

    # -- capture with vLLM, its first batch checked for meaning before the rest ------------------------
    from eagle_pipeline.state_meaning import check_stage02_samples, target_head_for

    head = target_head_for(verifier)  # read once, for the first batch and for the end
    greedy = cfg.generation.temperature == 0
    capture_seconds = 0.0
    if todo:
        from tqdm import tqdm

        sizes = {"num_states": num_states, "hidden_size": hidden_size, "storage_dtype": hs_cfg.storage_dtype}
        if one_pass:  # stage 01's states, checked and linked: no engine
            engine, states = contextlib.nullcontext(), cfg.stage_dir(STAGES[1]) / STATES_DIR
        else:
            before_first_load(cfg, stage.number)
            apply_engine_env(cfg)
            engine = HiddenStateCapture(
                verifier.path, layer_ids, num_layers=verifier.num_layers, storage_path=stage.dir / "connector_scratch",
                **capture_sizing(max(rows[i]["seq_len"] for i in todo)), **capture_engine_kwargs(cfg),
            )
        with engine, tqdm(total=todo_tokens, desc="capture", unit="tok", unit_scale=True) as bar:
            t0 = time.monotonic()
            for start in range(0, len(todo), hs_cfg.batch_size):
                batch = todo[start : start + hs_cfg.batch_size]
                if one_pass:
                    for i in batch:
                        sample_from_stored(sample_path(states, i), hs_dir, i, rows[i]["input_ids"], **sizes)
                else:
                    for i, sample in zip(batch, engine.capture([rows[i]["input_ids"] for i in batch])):
                        write_sample(hs_dir, i, sample, rows[i]["input_ids"], **sizes)
                bar.update(sum(rows[i]["seq_len"] for i in batch))
                if start == 0:
                    check_first_batch(hs_dir, rows, batch, head, layer_ids, verifier.num_layers, greedy=greedy,
                                      model_runner=cfg.verifier.model_runner,
                                      **({"rerun": ONE_PASS_RERUN} if one_pass else {}))
            capture_seconds = time.monotonic() - t0
        shutil.rmtree(stage.dir / "connector_scratch", ignore_errors=True)

    # -- meaning: whole, finite files of the right shape may still hold the wrong layer or position ----
    meaning = check_stage02_samples(hs_dir, rows, head, layer_ids, verifier.num_layers, greedy=greedy,
                                    **({"fix": f"stage 01's one-pass states are wrong; {ONE_PASS_RERUN}"}
                                       if one_pass else {}))

    # -- summary --------------------------------------------------------------------------------------
    stored = sum(sample_path(hs_dir, i).stat().st_size for i in range(len(rows)))
    counts = dataset_counts(stage, rows, verifier, layout, captured_now=len(todo), stored_bytes=stored) | {
        "bytes_per_token": round(stored / max(total_tokens, 1), 1),
        "capture_seconds": round(capture_seconds, 1),
        "capture_tokens_per_s": round(todo_tokens / capture_seconds, 1) if capture_seconds else None,
        "meaning_check": meaning,
    }
    stage.finish(counts, output_fingerprint=value_fingerprint([r["input_ids"] for r in rows]),
                 extra={"resolved": layout.to_json()})
    print(
        f"stage 02 done: {len(rows)} samples ({len(todo)} captured now), {total_tokens} tokens, {stored / 1e6:.1f} "
        f"MB ({counts['bytes_per_token']} B/token), {counts['capture_tokens_per_s']} tokens/s -> {stage.dir}"
    )


def print_online_plan(stage: Stage, verifier: Verifier, layout, rows: list[dict] | None = None,
                      num_samples: int | None = None, note: str | None = None) -> None:
    """Dry run of an online run: the dataset only; the states are stage 04's to capture."""
    size = (f"{len(rows)} conversations ({sum(r['seq_len'] for r in rows)} tokens)" if rows
            else f"{num_samples} conversations")
    print(f"stage 02: the training dataset of {size}, no hidden states "
          f"(hidden_states.mode: online: stage 04 captures them live and discards them)")
    if note:
        print(note)
    print(f"  verifier {verifier.path} ({verifier.architecture}, {verifier.num_layers} layers, hidden "
          f"{layout.hidden_size}); aux layer ids {list(layout.layer_ids)} + final layer {verifier.num_layers}, which "
          f"stage 04's capture servers will hand over as [seq, {layout.num_hidden_states}, {layout.hidden_size}]")
    print(f"  disk: the dataset only (token ids and loss masks) under {stage.dir}")


def dataset_counts(stage: Stage, rows: list[dict], verifier: Verifier, layout, *, captured_now: int,
                   stored_bytes: int) -> dict:
    """The manifest counts of the dataset in either mode, its sequence-length plot drawn."""
    plots.histogram([r["seq_len"] for r in rows], stage.dir / "sequence_lengths.png", "training sequence length",
                    "tokens")
    return {
        "samples": len(rows),
        "captured_now": captured_now,
        "tokens": sum(r["seq_len"] for r in rows),
        "assistant_tokens": sum(sum(r["loss_mask"]) for r in rows),
        "target_vocab_size": verifier.vocab_size,
        "hidden_size": layout.hidden_size,
        "layer_ids": list(layout.layer_ids),
        "num_hidden_states": layout.num_hidden_states,
        "stored_bytes": stored_bytes,
    }


def finish_online(stage: Stage, rows: list[dict], verifier: Verifier, layout) -> None:
    """An online run's stage 02 ends with the dataset: token ids and loss masks, in the format stage 04 reads,
    and no states (stage 04 asks its capture servers for them; eagle_pipeline/online/)."""
    counts = dataset_counts(stage, rows, verifier, layout, captured_now=0, stored_bytes=0)
    stage.finish(counts, output_fingerprint=value_fingerprint([r["input_ids"] for r in rows]),
                 extra={"resolved": layout.to_json(), "hidden_states_mode": "online"})
    print(f"stage 02 done: {len(rows)} samples, {counts['tokens']} tokens, no hidden states stored "
          f"(hidden_states.mode: online) -> {stage.dir}")


if __name__ == "__main__":
    main(2, __doc__, run, rehearsal=dry_run_lines)
