"""Stage 06's prediction: the drafter replayed offline on the very answers the no-speculation server gave.

The served run at temperature 0 returns, with `return_token_ids`, each prompt's ids and the target's greedy
answer ids. Their hidden states are captured through stage 02's path (`HiddenStateCapture`) at every layer
some reading of the drafter needs (eagle_pipeline.predict.diagnose: its ids, ids -/+ 1, the target's
defaults; no more), checked for meaning (eagle_pipeline/state_meaning.py), and the drafter is replayed on
them under each reading, so the predicted figures and the served ones count the same drafts of the same
conversations, and a gap can be given a cause. Which drafter is replayed: `trained_plan`, `folder_plan`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from eagle_pipeline.capture import HiddenStateCapture, capture_sizing
from eagle_pipeline.config import RunConfig
from eagle_pipeline.drafter.folder import read_config, read_flat_config
from eagle_pipeline.drafter.layouts import (
    drafter_mode,
    flat_norm_flags,
    is_dflash_config,
    speculators_norm_flags,
    weight_files,
)
from eagle_pipeline.engine import apply_engine_env, capture_engine_kwargs
from eagle_pipeline.layer_ids import default_layer_ids, vllm_read_aux_ids
from eagle_pipeline.predict import diagnose as dx
from eagle_pipeline.predict.blocks import load_block_drafter, predict_block_acceptance


def served_checkpoint(cfg: RunConfig, trained: dict[str, Any]) -> Path:
    """The stage 04 checkpoint stage 05 converted: the best one, else the last."""
    best = trained["counts"].get("best") or {}
    return cfg.stage_dir("04_train") / (best.get("checkpoint") or trained["counts"]["last_checkpoint"])


@dataclass
class ReplayPlan:
    """The drafter to replay and how: a speculators checkpoint, its readings, the d2t the engine applies."""

    checkpoint: Path
    readings: list[dx.Reading]
    reference: str
    d2t: Any  # "checkpoint" or None (the folder has none: the engine's identity)
    findings: list[dict]
    block: bool = False  # a DFlash drafter, replayed as vLLM's DFlashProposer drafts its blocks (predict/blocks.py)


def trained_plan(checkpoint: Path, layer_ids: Sequence[int], num_layers: int, findings: list[dict]) -> ReplayPlan:
    """The stage 04 checkpoint stage 05 converted, read with its ids and flags as trained."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    if is_dflash_config(config):
        return block_plan(checkpoint, layer_ids, num_layers, "as_trained", findings)
    flags = speculators_norm_flags(config)
    has_d2t = int(config.get("draft_vocab_size") or 0) != int(config["transformer_layer_config"]["vocab_size"])
    return ReplayPlan(Path(checkpoint), dx.readings(layer_ids, num_layers, flags, has_d2t=has_d2t,
                                                    attention=checkpoint_attention(checkpoint)),
                      "as_trained", "checkpoint", findings)


def block_plan(checkpoint: Path, layer_ids: Sequence[int], num_layers: int, reference: str,
               findings: list[dict]) -> ReplayPlan:
    """A DFlash drafter's readings: its ids and their neighbours, and causal attention inside the block."""
    return ReplayPlan(Path(checkpoint), dx.readings(layer_ids, num_layers, {}, has_d2t=False, reference=reference,
                                                    attention={"causal": False}), reference, None, findings, True)


def checkpoint_attention(checkpoint: Path) -> dict[str, bool]:
    """An MLA drafter's attention as its speculators checkpoint says it was trained (or, converted from a flat
    folder, as the folder declares it); {} for a Llama-shaped drafter."""
    from eagle_pipeline.predict.speculators_drafter import mla_attention

    return mla_attention(json.loads((Path(checkpoint) / "config.json").read_text())["transformer_layer_config"])


def folder_plan(drafter_dir: Path, verifier_dir: Path, num_layers: int, vocab_size: int, device: str,
                scratch_dir: Path, num_speculative_tokens: int) -> ReplayPlan:
    """A flat folder read as vLLM reads it: the ids the runner of `device` takes, the declared flags."""
    from eagle_pipeline.predict.flat_drafter import write_speculators_checkpoint

    config = read_config(drafter_dir) or {}
    if is_dflash_config(config):  # a speculators DFlash folder is its own checkpoint
        return block_plan(drafter_dir, config["aux_hidden_state_layer_ids"], num_layers, "as_declared",
                          dx.config_findings(config, num_layers=num_layers, target_vocab_size=vocab_size,
                                             has_d2t=True))
    config = read_flat_config(drafter_dir)
    has_d2t = "d2t" in weight_files(drafter_dir)
    read = vllm_read_aux_ids(config)["v1" if device == "cpu" else "v2"] or default_layer_ids(num_layers)
    findings = dx.config_findings(config, num_layers=num_layers, target_vocab_size=vocab_size, has_d2t=has_d2t)
    checkpoint = write_speculators_checkpoint(drafter_dir, verifier_dir, scratch_dir / "drafter",
                                              speculative_tokens=num_speculative_tokens)
    return ReplayPlan(checkpoint,
                      dx.readings(read, num_layers, flat_norm_flags(config), has_d2t=has_d2t, reference="as_declared",
                                  attention=checkpoint_attention(checkpoint)),
                      "as_declared", "checkpoint" if has_d2t else None, findings)


def capture_states(cfg: RunConfig, verifier_dir: Path, layer_ids: Sequence[int], num_layers: int,
                   sequences: Sequence[Sequence[int]], scratch_dir: Path) -> list[torch.Tensor]:
    """hidden_states [seq, len(layer_ids) + 1, H] per sequence, through stage 02's capture path, with an engine
    sized for the longest sequence."""
    apply_engine_env(cfg)
    with HiddenStateCapture(verifier_dir, list(layer_ids), num_layers=num_layers, storage_path=scratch_dir / "capture",
                            **capture_sizing(max(len(s) for s in sequences)), **capture_engine_kwargs(cfg)) as capture:
        return [sample["hidden_states"] for sample in capture.capture(sequences)]


def replay(plan: ReplayPlan, samples: list, captured_ids: Sequence[int], num_layers: int,
           num_speculative_tokens: int) -> dict[str, dict[str, Any]]:
    """The replay summary under every reading, keyed by reading name."""
    from eagle_pipeline.predict.acceptance import simulate_variants
    from eagle_pipeline.predict.speculators_drafter import load_drafter

    variants = [dx.as_variant(r, captured_ids, num_layers) for r in plan.readings]
    if plan.block:
        model = load_block_drafter(plan.checkpoint)
        return {v.name: predict_block_acceptance(model, samples, num_speculative_tokens, aux_slots=v.aux_slots,
                                                 causal=v.attention.get("causal", False)) for v in variants}
    return simulate_variants(load_drafter(plan.checkpoint), samples, num_speculative_tokens, variants, d2t=plan.d2t)


def predict_served(plan: ReplayPlan, token_ids: Sequence[tuple[Sequence[int] | None, Sequence[int] | None]],
                   num_speculative_tokens: int, num_layers: int, capture) -> dict[str, Any]:
    """Predicted acceptance under every reading of `plan` on (prompt ids, answer ids) pairs.

    `capture(layer_ids)` returns (hidden states per sequence, the captured ids): a fresh capture or the
    baseline's stored one. Returns the reference's summary as `predicted_*` fields, `readings` (every
    reading's summary) and timings.
    """
    pairs = [(list(p), list(c)) for p, c in token_ids if p is not None and c is not None]
    if not pairs:
        return {"predicted_mean_acceptance_length": None, "prediction_note": "the server returned no token ids"}
    started = time.monotonic()
    states, captured_ids = capture(dx.capture_ids(plan.readings, num_layers))
    capture_s = time.monotonic() - started
    samples = [(torch.as_tensor(p + c), h.float(), len(p)) for (p, c), h in zip(pairs, states)]
    results = replay(plan, samples, captured_ids, num_layers, num_speculative_tokens)
    reference = results[plan.reference]
    return {
        **{k: v for k, v in reference.items() if k.startswith("predicted")},
        "num_drafts": reference.get("num_drafts"),
        # By served answer (the pairs above, which keep the prompts' order where every answer came with its ids).
        "per_prompt_mean_acceptance_length": reference.get("per_sequence_mean_acceptance_length"),
        "per_prompt_num_drafts": reference.get("per_sequence_num_drafts"),
        "readings": {name: {k: r.get(k) for k in ("predicted_mean_acceptance_length",
                                                  "predicted_per_position_acceptance",
                                                  "num_drafts", "first_draft_kl")} for name, r in results.items()},
        "prediction_capture_s": round(capture_s, 1),
        "prediction_s": round(time.monotonic() - started, 1),
    }


def diagnosis(plan: ReplayPlan, report: dict[str, Any], prediction: dict[str, Any]) -> dict[str, Any] | None:
    """The verdict with a cause (eagle_pipeline.predict.diagnose) for a report with the drafter served and predicted;
    the engine facts of the served run (report["engine"]) are what an engine verdict names."""
    modes = report.get("modes", {})
    served = modes.get(drafter_mode(modes)) or {}
    if not served.get("per_position_acceptance") or not prediction.get("readings"):
        return None
    texts = {r.name: r.text for r in plan.readings}
    result = dx.diagnose(served["per_position_acceptance"], served.get("num_drafts"), prediction["readings"], texts,
                         plan.reference, plan.findings, engine=report.get("engine"))
    result["layer_convention"] = dx.layer_convention(prediction["readings"], plan.reference)
    return result
