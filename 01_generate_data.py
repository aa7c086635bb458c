"""Stage 01: synthetic training conversations, answered by the target itself through vLLM.

The drafter learns to predict what the target says, so the target writes the answers: each prompt is
rendered with the target's chat template and answered by vLLM's offline engine with the configured
sampling settings (reasoning on or off, through the template's own switch: eagle_pipeline/chat_template.py).
Each conversation keeps the token ids vLLM rendered for the prompt and the ids the target generated, so
stage 02 trains on exactly the sequence the model produced.

The prompts are data.prompts (`data.prompt_source: file`), or with `data.prompt_source: self` user turns
the target writes itself from its chat template's user header (eagle_pipeline/self_prompts.py), filtered
for duplicates, degenerate turns and overlap with the eval prompts (eagle_pipeline/prompt_filter.py).
That scales to any data.num_samples without a download (configs/tiny-10k.yaml).

A prompt file's prompts are rendered with the chat template and measured once: those that leave no room for
an answer within verifier.max_model_len, or nothing to train on within hidden_states.max_seq_len, are dropped
and listed (eagle_pipeline/prompt_fit.py), so that no prompt can stop the engine, and sample i answers the
i-th prompt that fits. A training prompt that asks what a held-out prompt asks is refused.

Embedded default (CPU, a few minutes):
    python 01_generate_data.py --config configs/tiny.yaml
Full scale (8 GPUs, see README "Running on a GPU host"):
    python 01_generate_data.py --config configs/kimi-k2.5-10k.yaml

Output in <data_root>/<run_name>/01_generate_data/:
    parts/part-*.jsonl   finished conversations, generation.batch_size a file (a crash loses at most those not yet
    written)
    dropped_prompts.jsonl   prompt_source file: the prompts dropped as too long (id, prompt tokens, reason)
    self_written/part-*.jsonl   prompt_source self: every sampled user turn and the filter's verdict
    conversations/       `datasets` dataset: sample_id, prompt_id, topic, messages, finish_reason, token counts,
                         prompt_token_ids, completion_token_ids
    states/hs_<i>.safetensors   hidden_states.one_pass: sample i's states, captured while it was answered (prompt +
                         answer less its last token, in stage 02's format), written before the part naming it
    manifest.json        inputs, counts, timings (written last)
"""

import json
import logging
import shutil
import time
from pathlib import Path

from eagle_pipeline import atomic, engine_starts, plots
from eagle_pipeline.answering import answer_in_flight
from eagle_pipeline.capture import ONE_PASS_REQUEST, connector_sample, let_the_connector_write, one_pass_engine_args
from eagle_pipeline.chat_template import chat_template_kwargs
from eagle_pipeline.config import RunConfig
from eagle_pipeline.embedded import EMBEDDED_PREFIX
from eagle_pipeline.engine import apply_engine_env, llm_kwargs, offline_engine, target_engine_fingerprint
from eagle_pipeline.errors import BadInput
from eagle_pipeline.fingerprint import file_fingerprint, value_fingerprint
from eagle_pipeline.outputs import read_manifest
from eagle_pipeline.plan.rehearsal import before_first_load, dry_run_lines
from eagle_pipeline.prompt_filter import PromptFilter
from eagle_pipeline.prompt_fit import (
    DROPPED_FILE,
    LengthLimits,
    check_resumed_samples,
    describe_dropped,
    require_enough,
    select_prompts,
    template_counter,
)
from eagle_pipeline.prompts import load_prompts, load_training_and_eval_prompts
from eagle_pipeline.samples import (
    STATES_DIR,
    planned_sample_layout,
    sample_files,
    sample_matches,
    sample_path,
    write_sample,
)
from eagle_pipeline.self_prompts import SELF_WRITTEN_DIR, attempt_stats, kept_prompts, write_prompts
from eagle_pipeline.stage import Stage, Start, main
from eagle_pipeline.verifier import Verifier, check_verifier_path

RECORD_FORMAT = 3
# Settings that change nothing in an answer: how the engine is fed, and what is dropped or warned about
# (a changed selection of prompts is caught per sample, check_resumed_samples).
NOT_GENERATION_INPUTS = ("batch_size", "refill", "min_answer_tokens", "max_truncated_share")
# What hidden_states.one_pass adds to the inputs: what the captured states depend on beyond the engine.
ONE_PASS_INPUTS = ("layer_ids", "storage_dtype")
log = logging.getLogger("eagle_pipeline")


def read_parts(parts_dir: Path, skip_torn: bool = False) -> dict[str, dict]:
    """The finished conversations in parts/, by sample id. `skip_torn` passes over lines that do not parse (a
    damaged part is then left to Stage.start, which removes it)."""
    done: dict[str, dict] = {}
    for part in sorted(parts_dir.glob("part-*.jsonl")):
        for line in part.read_text(errors="replace" if skip_torn else "strict").splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                if skip_torn:
                    continue
                raise
            done[record["sample_id"]] = record
    return done


def keep_paired(parts_dir: Path, states_dir: Path, done: dict[str, dict], num_states: int,
                hidden_size: int) -> dict[str, dict]:
    """One pass: the finished conversations whose states file holds their prompt + answer less its last token. A
    conversation without them leaves its part, states without a conversation are deleted: both are redone."""
    paired = {sid: r for sid, r in done.items() if sample_matches(sample_path(states_dir, int(sid[1:])), r[
        "prompt_token_ids"] + r["completion_token_ids"][:-1], num_states, hidden_size)}
    for row, path in sample_files(states_dir).items():
        if f"s{row:06d}" not in paired:
            path.unlink()
    for part in sorted(parts_dir.glob("part-*.jsonl")):
        lines = part.read_text().splitlines()
        kept = [line for line in lines if json.loads(line)["sample_id"] in paired]
        if len(kept) < len(lines):
            atomic.write_text(part, "".join(line + "\n" for line in kept)) if kept else part.unlink()
    return paired


def truncation_warning(finish_reasons: dict[str, int], samples: int, cfg: RunConfig) -> str | None:
    """The warning when more answers than generation.max_truncated_share stopped at the length limit."""
    cut = finish_reasons.get("length", 0)
    share = cut / samples if samples else 0.0
    if share <= cfg.generation.max_truncated_share:
        return None
    thinking = (" generation.reasoning is true, so thinking traces are being cut, often before any answer;"
                if cfg.generation.reasoning else "")
    return (f"{cut} of {samples} answers ({share:.0%}) stopped at the length limit, above "
            f"generation.max_truncated_share ({cfg.generation.max_truncated_share:.0%}):{thinking} "
            "the drafter learns from cut answers; raise generation.max_tokens "
            f"({cfg.generation.max_tokens}) and verifier.max_model_len if needed")


def run(stage: Stage, dry_run: bool) -> None:
    cfg = stage.cfg
    # -- inputs ------------------------------------------------------------------------------------
    check_verifier_path(cfg)
    prompts_path = cfg.resolve_path(cfg.data.prompts)
    eval_path = cfg.resolve_path(cfg.data.eval_prompts)
    self_written = cfg.data.prompt_source == "self"
    if self_written:  # written by the target once its engine runs, kept clear of the held-out prompts
        held_out = load_prompts(eval_path, cfg.data.prompt_field, "data.eval_prompts")
        prompts = None
        source = (f"user turns the target writes itself (temperature {cfg.data.self_written.temperature}), "
                  f"clear of {eval_path}")
    else:
        # The held-out file is checked here too, so that a bad one is refused before hours of generation.
        prompts, _ = load_training_and_eval_prompts(prompts_path, eval_path, cfg.data.prompt_field)
        all_prompts = prompts
        if cfg.data.num_samples > len(prompts):
            raise BadInput(
                f"data.num_samples: {cfg.data.num_samples} exceeds the {len(prompts)} prompts in {prompts_path}; "
                f"lower it or add prompts"
            )
        source = str(prompts_path)
    sample_ids = [f"s{i:06d}" for i in range(cfg.data.num_samples)]
    generation_dtype = cfg.generation.dtype or cfg.verifier.dtype  # the answering engine's; 02-06 keep verifier.dtype
    limits = LengthLimits.from_config(cfg)

    if dry_run:
        print(f"stage 01: generate {len(sample_ids)} conversations from {source}")
        print(f"  verifier {cfg.verifier.path} on {cfg.device}, tensor_parallel={cfg.verifier.tensor_parallel_size}, "
              f"expert_parallel={cfg.verifier.enable_expert_parallel}")
        print(f"  sampling temperature={cfg.generation.temperature} top_p={cfg.generation.top_p} "
              f"max_tokens={cfg.generation.max_tokens} reasoning={cfg.generation.reasoning} "
              f"dtype={generation_dtype}")
        if cfg.hidden_states.one_pass:
            print(f"  one pass: the answering engine also captures the hidden states (hidden_states.layer_ids "
                  f"{cfg.hidden_states.layer_ids or 'default'}) into {stage.dir / STATES_DIR}; stage 02 starts "
                  f"no engine")
        if not cfg.verifier.path.startswith(EMBEDDED_PREFIX):
            # A model folder's tokenizer is cheap to load and is where remote code breaks first (docs/engines.md);
            # an embedded model is converted on first use, which a dry run must not do.
            verifier = Verifier.from_config(cfg)
            template_kwargs = chat_template_kwargs(verifier.chat_template(), cfg.generation.reasoning,
                                                   cfg.generation.chat_template_kwargs)
            print(f"  tokenizer {type(verifier.tokenizer).__name__}, chat template arguments {template_kwargs}")
            if prompts is not None:
                selection = select_prompts(prompts, len(sample_ids), template_counter(
                    verifier.tokenizer, cfg.generation.system_prompt, template_kwargs), limits)
                require_enough(selection, len(sample_ids), source, limits)
                dropped = f"; {describe_dropped(selection, limits)}" if selection.dropped else ""
                print(f"  prompts: {len(selection.kept)} of the {selection.measured} measured fit{dropped}")
        elif prompts is not None:
            print("  prompt lengths: measured when the stage runs (the embedded model is converted on first use)")
        print(f"  output {stage.dir}")
        return

    verifier = Verifier.from_config(cfg)
    template_kwargs = chat_template_kwargs(verifier.chat_template(), cfg.generation.reasoning,
                                           cfg.generation.chat_template_kwargs)
    selection = None
    if not self_written:  # every prompt measured once; vLLM never sees one that cannot fit
        selection = select_prompts(prompts, len(sample_ids), template_counter(
            verifier.tokenizer, cfg.generation.system_prompt, template_kwargs), limits)
        require_enough(selection, len(sample_ids), source, limits)
        prompts = selection.kept
    generation = cfg.generation.model_dump(mode="json")
    for setting in NOT_GENERATION_INPUTS:
        generation.pop(setting)
    generation.pop("dtype")  # an input of its own below ("engine"), whichever section sets it
    if self_written:
        # What the prompts come from; their count is data.num_samples (counts), which may grow on a rerun.
        prompt_input = {"source": "self", "model": verifier.fingerprints()["verifier"], "seed": cfg.seed,
                        **cfg.data.self_written.model_dump(mode="json"), "eval_prompts": file_fingerprint(eval_path)
                        if eval_path.is_file() else value_fingerprint(held_out),
                        "system_prompt": cfg.generation.system_prompt}
    else:
        # All of them, not the ones this sample count uses: raising data.num_samples extends the run.
        prompt_input = file_fingerprint(prompts_path) if prompts_path.is_file() else value_fingerprint(all_prompts)
    inputs = {
        **verifier.fingerprints(),
        "prompts": prompt_input,
        "generation": value_fingerprint(generation),
        "engine": target_engine_fingerprint(cfg, generation_dtype),
        "seed": cfg.seed,
        "chat_template_kwargs": template_kwargs,
        # Version of the records in parts/: 2 added the prompt's and the completion's token ids, 3 the
        # prompt's topic (stage 04 validates on whole topics).
        "record_format": RECORD_FORMAT,
    }
    one_pass = cfg.hidden_states.one_pass
    if one_pass:  # only then, so that two-pass runs keep their recorded inputs
        layout = planned_sample_layout(cfg, verifier.num_layers, verifier.hidden_size, verifier.vocab_size)
        inputs.update(layer_ids=list(layout.layer_ids), storage_dtype=layout.storage_dtype.value)
    elif not stage.force:  # a finished one-pass run's answers serve a two-pass stage 02 as they are
        old = read_manifest(stage.dir) or {}
        if old.get("status") == "complete" and old["counts"].get("samples") == len(sample_ids):
            inputs.update({key: old["inputs"][key] for key in ONE_PASS_INPUTS if key in old["inputs"]})
    parts_dir, states_dir, scratch = stage.dir / "parts", stage.dir / STATES_DIR, stage.dir / "connector_scratch"

    def resumable() -> None:  # samples to resume or extend, tied to other prompts (--force starts over)
        if selection is not None and not stage.force:
            check_resumed_samples(read_parts(parts_dir, skip_torn=True), sample_ids, selection.kept, parts_dir)

    if stage.begin(inputs, samples=len(sample_ids), before_writing=resumable) is Start.ALREADY_COMPLETE:
        print(f"stage 01 already complete for these inputs: {stage.dir}")
        return
    if selection is not None:
        atomic.write_text(stage.dir / DROPPED_FILE, "".join(json.dumps(d) + "\n" for d in selection.dropped))
        if selection.dropped:
            print(f"stage 01: {describe_dropped(selection, limits)}; their ids are in {stage.dir / DROPPED_FILE}")

    # -- resume: which samples are already answered ------------------------------------------------
    parts_dir.mkdir(exist_ok=True)
    done = read_parts(parts_dir)
    if one_pass:  # the connector's files are named by request ids that mean nothing to this run
        shutil.rmtree(scratch, ignore_errors=True)
        done = keep_paired(parts_dir, states_dir, done, layout.num_hidden_states, layout.hidden_size)
    todo = [i for i, sid in enumerate(sample_ids) if sid not in done]
    print(f"stage 01: {len(done)} of {len(sample_ids)} conversations already done, {len(todo)} to generate")

    # -- self-written prompts, then generation with vLLM ------------------------------------------------
    gen_seconds = 0.0
    generated_tokens = 0
    written = None
    if self_written:
        prompt_filter = PromptFilter.against(held_out, cfg.data.self_written.min_words, cfg.data.self_written.max_words)
        kept, _ = kept_prompts(stage.dir / SELF_WRITTEN_DIR, prompt_filter)
        if len(kept) >= len(sample_ids):
            prompts = kept[: len(sample_ids)]
            written = {"stats": attempt_stats(stage.dir / SELF_WRITTEN_DIR)}
    if todo or prompts is None:
        from tqdm import tqdm
        from vllm import SamplingParams

        before_first_load(cfg, stage.number)
        apply_engine_env(cfg)
        engine_args = llm_kwargs(cfg, str(verifier.path), dtype=generation_dtype)
        if one_pass:
            engine_args.update(one_pass_engine_args(cfg, layout.layer_ids, verifier.num_layers, scratch))
        with engine_starts.timed("answering engine"):
            llm = offline_engine(**engine_args)
        if prompts is None:
            written = write_prompts(
                llm, verifier.tokenizer, cfg.data.self_written, wanted=len(sample_ids), run_seed=cfg.seed,
                batch_size=cfg.generation.batch_size, system_prompt=cfg.generation.system_prompt,
                template_kwargs=template_kwargs, prompt_filter=prompt_filter, folder=stage.dir / SELF_WRITTEN_DIR)
            prompts = written["prompts"]
            print(f"stage 01: {written['stats']['kept']} self-written prompts kept of {written['stats']['attempts']} "
                  f"written ({written['stats']['verdicts']})")
        params = SamplingParams(
            temperature=cfg.generation.temperature,
            top_p=cfg.generation.top_p,
            max_tokens=cfg.generation.max_tokens,
            seed=cfg.seed,
            **({"extra_args": ONE_PASS_REQUEST} if one_pass else {}),
        )
        t0 = time.monotonic()  # generation speed, without the engine's start-up
        system = [{"role": "system", "content": cfg.generation.system_prompt}] if cfg.generation.system_prompt else []
        conversations = [system + prompts[i]["messages"] for i in todo]
        # generation.batch_size conversations decode at once, topped up as each finishes; every batch_size
        # finished ones are written as a part, so a crash loses at most the conversations not yet written. In one
        # pass a conversation joins a part only once its states are in place, so that a crash can leave states
        # without a conversation (deleted on the rerun), never a conversation without states.
        finished: list[dict] = []
        pending: dict[int, tuple[dict, str]] = {}  # sample index -> (record, connector file not yet taken)

        def write_part(records: list[dict]) -> None:
            first = min(r["sample_id"] for r in records)
            atomic.write_text(parts_dir / f"part-{first}-{len(records):05d}.jsonl",
                              "".join(json.dumps(r) + "\n" for r in records))
            done.update({r["sample_id"]: r for r in records})

        def take_states(wait: bool = False) -> None:
            for i, (record, path) in list(pending.items()):
                ids = record["prompt_token_ids"] + record["completion_token_ids"][:-1]
                sample = connector_sample(path, ids, num_states=layout.num_hidden_states, wait=wait,
                                          where=f"{sample_ids[i]}'s states ({path})")
                if sample is not None:
                    write_sample(states_dir, i, sample, ids, num_states=layout.num_hidden_states,
                                 hidden_size=layout.hidden_size, storage_dtype=layout.storage_dtype)
                    finished.append(pending.pop(i)[0])

        with tqdm(total=len(todo), desc="generate", unit="conv") as bar:
            answers = answer_in_flight(llm, conversations, params, in_flight=cfg.generation.batch_size,
                                       chat_template_kwargs=template_kwargs, refill=cfg.generation.refill)
            for position, out in answers:
                i, messages, completion = todo[position], conversations[position], out.outputs[0]
                generated_tokens += len(completion.token_ids)
                record = {
                    "sample_id": sample_ids[i],
                    "prompt_id": prompts[i]["id"],
                    "topic": prompts[i]["topic"],
                    "messages": messages + [{"role": "assistant", "content": completion.text}],
                    "finish_reason": completion.finish_reason,
                    "prompt_tokens": len(out.prompt_token_ids),
                    "completion_tokens": len(completion.token_ids),
                    "prompt_token_ids": list(out.prompt_token_ids),
                    "completion_token_ids": list(completion.token_ids),
                }
                if one_pass:
                    pending[i] = (record, out.kv_transfer_params["hidden_states_path"])
                    take_states()
                else:
                    finished.append(record)
                bar.update(1)
                if len(finished) >= cfg.generation.batch_size:
                    write_part(finished)
                    finished = []
            if one_pass:
                let_the_connector_write(llm)
                take_states(wait=True)
            if finished:
                write_part(finished)
        shutil.rmtree(scratch, ignore_errors=True)
        gen_seconds = time.monotonic() - t0

    # -- the dataset, in sample-id order ------------------------------------------------------------
    from datasets import Dataset

    rows = [done[sid] for sid in sample_ids]
    for row in rows:  # datasets needs one schema; messages may carry extra keys in other sources
        row["messages"] = [{"role": m["role"], "content": m["content"]} for m in row["messages"]]
    with atomic.atomic_dir(stage.dir / "conversations") as tmp:
        Dataset.from_list(rows).save_to_disk(str(tmp))

    completion_tokens = [r["completion_tokens"] for r in rows]
    plots.histogram(completion_tokens, stage.dir / "response_lengths.png", "response length (tokens)", "tokens")
    counts = {
        "samples": len(rows),
        "generated_now": len(todo),
        "completion_tokens": sum(completion_tokens),
        "prompt_tokens": sum(r["prompt_tokens"] for r in rows),
        "finish_reasons": {k: sum(r["finish_reason"] == k for r in rows)
                           for k in sorted({r["finish_reason"] for r in rows})},
        "generation_seconds": round(gen_seconds, 1),
        "output_tokens_per_s": round(generated_tokens / gen_seconds, 1) if generated_tokens else None,
    }
    if written is not None:
        counts["self_written"] = written["stats"]
    dropped_note = ""
    if selection is not None:
        counts["dropped_prompts"] = len(selection.dropped)
        counts["dropped_by_reason"] = selection.reasons()
        if selection.dropped:
            dropped_note = f", {len(selection.dropped)} prompts dropped (ids in {DROPPED_FILE})"
    counts["truncated_share"] = round(counts["finish_reasons"].get("length", 0) / max(len(rows), 1), 4)
    warning = truncation_warning(counts["finish_reasons"], len(rows), cfg)
    if warning:
        log.warning("stage 01: %s", warning)
    stage.finish(counts,
                 output_fingerprint=value_fingerprint([(r["sample_id"], r["messages"][-1]["content"]) for r in rows]),
                 extra={"warnings": [warning]} if warning else None)
    print(
        f"stage 01 done: {len(rows)} conversations ({len(todo)} new), {counts['completion_tokens']} "
        f"response tokens, finish reasons {counts['finish_reasons']}{dropped_note}, "
        f"{counts['output_tokens_per_s']} output tok/s -> {stage.dir}"
    )


if __name__ == "__main__":
    main(1, __doc__, run, rehearsal=dry_run_lines)
