"""Stage 05: turn the trained checkpoint into what vLLM (and SGLang) load, and prove it with vLLM itself.

The flat folder is docs/formats.md's ("The flat drafter folder"). Then five checks, written to verify.json and
printed as a table:
  1. shapes   every tensor against the config (and a reference drafter, e.g. a released Kimi one)
  2. config   parses with transformers.AutoConfig and vLLM's own config loader
  3. vllm_load vLLM's real drafter class (Eagle3LlamaForCausalLM, ...).load_weights accepts every key
  4. vllm_logits an MLA drafter: vLLM's Eagle3DeepseekV2ForCausalLM, run on the CPU with the folder's weights,
              computes the checkpoint's logits on held-out rows (docs/formats.md, "What vLLM computes")
  5. parity   the converted folder and the speculators checkpoint accept the same drafts per position:
              replayed offline on held-out conversations and the states stage 02 captured (no engine),
              or with convert.parity: vllm, served greedily by vLLM on eval prompts (two engine starts)

Embedded default (CPU, a few minutes):
    python 05_convert.py --config configs/tiny.yaml
Full scale:
    python 05_convert.py --config configs/kimi-k2.5-10k.yaml

Output in <data_root>/<run_name>/05_convert/: vllm/ (config.json, model.safetensors), sglang/ (when
convert.sglang), verify.json, manifest.json. The stage fails (exit 1) when any check fails.
"""

import sys

from eagle_pipeline import atomic, convert, drafter_checks
from eagle_pipeline.chat_template import chat_template_kwargs
from eagle_pipeline.engine import drafter_engine_settings, engine_env, llm_kwargs
from eagle_pipeline.errors import BadInput
from eagle_pipeline.fingerprint import file_fingerprint, value_fingerprint
from eagle_pipeline.plan.rehearsal import before_first_load, dry_run_lines
from eagle_pipeline.prompts import load_prompts
from eagle_pipeline.samples import planned_sample_layout
from eagle_pipeline.stage import (
    Stage,
    Start,
    is_complete,
    main,
    not_run_yet_note,
    require_complete,
    require_sample_layout,
    upstream_fingerprint,
)
from eagle_pipeline.train.predicted_acceptance import validation_conversations
from eagle_pipeline.verifier import Verifier


def print_plan(cfg, checkpoint, layer_ids, vocab_size: int, reference, note: str | None = None) -> None:
    """The dry run's lines: the conversion, `note`, the checks."""
    c = cfg.convert
    print(f"stage 05: convert {checkpoint} for vLLM{' and SGLang' if c.sglang else ''}; aux layer ids {layer_ids}, "
          f"target vocab {vocab_size}, draft vocab {cfg.vocab.draft_vocab_size}")
    if note:
        print(note)
    if c.parity == "replay":
        parity = (f"acceptance parity replayed offline on {c.parity_prompts} held-out conversations "
                  f"(tolerance {c.parity_tolerance}, no engine start)")
    else:
        parity = (f"acceptance parity served by vLLM on {c.parity_prompts} eval prompts (tolerance "
                  f"{c.parity_tolerance}, two engine starts)")
    print(f"  verify shapes{' against ' + str(reference) if reference else ''}, config, vLLM load_weights, "
          f"vLLM's logits (MLA and DFlash drafters), {parity}")


def run(stage: Stage, dry_run: bool) -> None:
    cfg = stage.cfg
    c = cfg.convert
    if dry_run and not is_complete(cfg, 4):
        verifier = Verifier.from_config(cfg)
        layout = planned_sample_layout(cfg, verifier.num_layers, verifier.hidden_size, verifier.vocab_size)
        print_plan(cfg, f"the best checkpoint under {cfg.stage_dir('04_train') / 'checkpoints'}",
                   list(layout.layer_ids), verifier.vocab_size, c.reference_dir, not_run_yet_note(cfg, 4))
        return
    trained = require_complete(cfg, 4)
    vocab = require_complete(cfg, 3)
    # Stage 04 records the draft vocabulary it trained with: a stage 03 rebuilt since (another vocabulary) leaves a
    # checkpoint whose d2t is not the run's.
    if trained["inputs"].get("d2t") != vocab["output_fingerprint"]:
        raise BadInput(f"{cfg.stage_dir('04_train')}: trained with another draft vocabulary (d2t) than "
                       f"{cfg.stage_dir('03_build_vocab_map')} now holds; rerun 04_train.py with --force, "
                       f"then this stage")
    best = trained["counts"].get("best") or {}
    checkpoint = cfg.stage_dir("04_train") / (best.get("checkpoint") or trained["counts"]["last_checkpoint"])
    verifier = Verifier.from_config(cfg)
    _, layout = require_sample_layout(cfg)
    layer_ids = list(layout.layer_ids)
    reference = cfg.resolve_path(c.reference_dir) if c.reference_dir else None
    if reference is not None and not (reference / "config.json").exists():
        raise BadInput(f"convert.reference_dir: {reference} has no config.json; point it at a drafter folder")

    if dry_run:
        print_plan(cfg, checkpoint, layer_ids, verifier.vocab_size, reference)
        return

    inputs = {
        "checkpoint": upstream_fingerprint(trained),
        "checkpoint_weights": trained["output_fingerprint"],
        "d2t": vocab["output_fingerprint"],
        "reference_dir": str(reference) if reference else None,
        "convert": value_fingerprint(c.model_dump(mode="json", exclude={"engine_timeout_s"})),
    }
    # Read before the manifest is written too: a bad prompt file is refused with the stage folder untouched.
    parity_prompts = None
    if c.parity == "vllm":
        parity_prompts = [p["messages"] for p in load_prompts(cfg.resolve_path(cfg.data.eval_prompts),
                                                              cfg.data.prompt_field,
                                                               "data.eval_prompts")[: c.parity_prompts]]

    dflash = cfg.train.family == "dflash"

    def before_writing() -> None:  # a checkpoint without weights, and an engine vLLM refuses, before any write
        convert.dflash_config(checkpoint, layer_ids) if dflash else convert.read_speculators_checkpoint(checkpoint)
        before_first_load(cfg, 5)

    if stage.begin(inputs, before_writing=before_writing) is Start.ALREADY_COMPLETE:
        print(f"stage 05 already complete for these inputs: {stage.dir}")
        return

    # -- convert ----------------------------------------------------------------------------------
    vllm_dir = stage.dir / "vllm"
    if dflash:  # the checkpoint itself, its config as vLLM must read it
        summary = convert.write_dflash_folder(checkpoint, vllm_dir, layer_ids)
    else:
        summary = convert.convert_for_vllm(checkpoint, vllm_dir, target_vocab_size=verifier.vocab_size,
                                           layer_ids=layer_ids)
    if c.sglang:
        summary["sglang"] = convert.convert_for_sglang(checkpoint, stage.dir / "sglang",
                                                       target_vocab_size=verifier.vocab_size,
                                                       layer_ids=layer_ids, target_num_layers=verifier.num_layers)
    print(f"converted {checkpoint} -> {vllm_dir}")

    # -- verify with vLLM's own code --------------------------------------------------------------

    parity_conversations = None
    if c.parity == "replay":
        parity_conversations = validation_conversations(cfg.stage_dir("02_extract_hidden") / "data",
                                                        cfg.stage_dir("04_train"), c.parity_prompts)

    expected = {
        "vocab_size": verifier.vocab_size,
        "draft_vocab_size": cfg.vocab.draft_vocab_size,
        "target_hidden_size": verifier.hidden_size,
        "eagle_config.eagle_aux_hidden_state_layer_ids": layer_ids,
    }
    if dflash:  # speculators' DFlash config: the layer's vocabulary, the ids, the mask token stage 04 trained with
        expected = {"transformer_layer_config.vocab_size": verifier.vocab_size,
                    "draft_vocab_size": cfg.vocab.draft_vocab_size, "aux_hidden_state_layer_ids": layer_ids,
                    "mask_token_id": trained["inputs"]["mask_token_id"], "sliding_window_non_causal": True}
    result = drafter_checks.verify_drafter(
        vllm_dir, target_dir=verifier.path, reference_dir=reference, expected=expected,
        parity_source_dir=checkpoint, parity_prompts=parity_prompts,
        num_speculative_tokens=cfg.serve.num_speculative_tokens,
        max_tokens=c.parity_max_tokens, tolerance=c.parity_tolerance,
        engine_kwargs={k: v for k, v in llm_kwargs(cfg, str(verifier.path)).items() if k != "model"},
        env=engine_env(cfg), timeout_s=c.engine_timeout_s, log_dir=stage.dir / "logs",
        drafter_settings=drafter_engine_settings(cfg), parity_conversations=parity_conversations,
        # The run's chat-template arguments (the thinking switch among them), as stages 01 and 06 render prompts.
        chat_template_kwargs=chat_template_kwargs(verifier.chat_template(), cfg.generation.reasoning,
                                                  cfg.generation.chat_template_kwargs) if c.parity == "vllm" else None,
    )
    atomic.write_json(stage.dir / "verify.json", result)
    drafter_checks.print_table(result)
    if not result["ok"]:
        failed = [name for name, check in result["checks"].items() if not check["ok"] and not check.get("skipped")]
        print(f"verification failed: {', '.join(failed)} (details in {stage.dir / 'verify.json'}, the vLLM jobs' "
              f"whole output in {stage.dir / 'logs'})", file=sys.stderr)
        sys.exit(1)

    counts = {"checkpoint": str(checkpoint.relative_to(cfg.run_dir)),
              "checks": {k: "skipped" if v.get("skipped") else v["ok"] for k, v in result["checks"].items()},
              "tensors": summary.get("tensors"), "sglang": c.sglang}
    stage.finish(counts, output_fingerprint=file_fingerprint(vllm_dir / "model.safetensors"))
    passed = [name for name, check in result["checks"].items() if check["ok"]]
    print(f"stage 05 done: {vllm_dir} verified ({', '.join(passed)}) -> {stage.dir / 'verify.json'}")


if __name__ == "__main__":
    main(5, __doc__, run, rehearsal=dry_run_lines)
