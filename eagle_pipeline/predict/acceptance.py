"""Predicted engine acceptance for a drafter over a set of conversations, as served and under serving variants.

Each sample is (token ids, hidden_states [seq, n_aux + 1, H] in stage 02's layout, prompt length): the
prompt followed by the target's greedy answer, and the target's states for that whole sequence. The numbers
returned are the ones `eagle_pipeline.serve.spec_metrics` computes from vLLM's counters, so a prediction and
a measurement of the same conversations at temperature 0 can be compared directly: a drafter the engine
serves correctly should measure close to `as_served`; a measurement near one of the mistake variants
instead points at that mistake.

Beside the counts, each summary carries `first_draft_kl`, speculators' training loss at draft position 0 (why it
tells the reading a drafter was trained under: docs/measurements.md, "Which reading the drafter was trained under").
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from eagle_pipeline.predict.simulate import AcceptanceCounts, Drafter, simulate_sequence
from eagle_pipeline.predict.speculators_drafter import SpeculatorsDrafter, checkpoint_flags, load_drafter, mla_attention
from eagle_pipeline.predict.variants import Sample, Variant, serving_inputs, standard_variants

Norm = Callable[[torch.Tensor], torch.Tensor]


def add_first_draft_fit(counts: AcceptanceCounts, drafter: Drafter, hidden_states: torch.Tensor,
                        prompt_len: int) -> None:
    """Add the last simulated sequence's first-draft KL (rows P-1 .. N-3, the answer's) to `counts`.

    Only a drafter that can score its context pass (`context_kl`, SpeculatorsDrafter) adds anything.
    """
    score = getattr(drafter, "context_kl", None)
    if score is None:
        return
    kl = score(hidden_states[:, -1].float())
    if kl is None:
        return
    rows = kl[prompt_len - 1: -1]
    counts.first_draft_kl_sum += float(rows.sum())
    counts.first_draft_kl_rows += int(rows.numel())


def simulate_samples(drafter: Drafter, samples: Iterable[Sample], num_speculative_tokens: int, *,
                     aux_slots: Sequence[int] | None = None, final_norm: Norm | None = None,
                     record_chains: bool = False) -> AcceptanceCounts:
    """Counts of any Drafter over the samples; the engine's inputs picked from each sample by `aux_slots`."""
    counts = AcceptanceCounts(num_speculative_tokens, chains=[] if record_chains else None)
    for index, (token_ids, hidden_states, prompt_len) in enumerate(samples):
        aux = serving_inputs(hidden_states, None if aux_slots is None else tuple(aux_slots), final_norm)
        simulate_sequence(drafter, torch.as_tensor(token_ids), aux, int(prompt_len), num_speculative_tokens,
                          counts, sequence=index)
        add_first_draft_fit(counts, drafter, hidden_states, int(prompt_len))
    return counts


def _model(drafter_dir):
    return load_drafter(drafter_dir) if isinstance(drafter_dir, (str, os.PathLike)) else drafter_dir


def target_final_norm(model, final_norm: Norm | None = None) -> Norm | None:
    """The target's final norm: as given, else the drafter's copy (`verifier_norm`) when it was loaded."""
    if final_norm is not None:
        return final_norm
    norm = getattr(model, "verifier_norm", None)
    return norm if norm is not None and torch.isfinite(norm.weight).all() else None


def predict_acceptance(drafter_dir: str | os.PathLike | Any, samples: Iterable[Sample], num_speculative_tokens: int,
                       d2t: Any = "checkpoint", *, aux_slots: Sequence[int] | None = None,
                       norm_flags: dict[str, bool] | None = None, final_slot_post_norm: bool = False,
                       final_norm: Norm | None = None, record_chains: bool = False) -> dict[str, Any]:
    """Predicted vLLM acceptance of a speculators drafter (a checkpoint folder or a loaded model) at temperature 0.

    `d2t`: "checkpoint" (the drafter's own map), None (no map: identity) or the array the engine loads.
    `aux_slots`, `norm_flags`, `final_slot_post_norm`: see eagle_pipeline.predict.variants; the defaults are
    the drafter served as trained. Returns `AcceptanceCounts.summary()`, plus `chains` [(sample, start row,
    accepted)] with `record_chains`.
    """
    model = _model(drafter_dir)
    norm = None
    if final_slot_post_norm:
        norm = target_final_norm(model, final_norm)
        if norm is None:
            raise ValueError("final_slot_post_norm needs the target's final norm: pass final_norm, or load the "
                             "drafter with its verifier")
    drafter = SpeculatorsDrafter(model, d2t=d2t, norm_flags=norm_flags)
    counts = simulate_samples(drafter, samples, num_speculative_tokens, aux_slots=aux_slots, final_norm=norm,
                              record_chains=record_chains)
    result = counts.summary()
    if record_chains:
        result["chains"] = counts.chains
    return result


def simulate_variants(drafter_dir: str | os.PathLike | Any, samples: Iterable[Sample], num_speculative_tokens: int,
                      variants: Sequence[Variant] | None = None, d2t: Any = "checkpoint", *,
                      final_norm: Norm | None = None) -> dict[str, dict[str, Any]]:
    """Predictions for each named variant (default: `standard_variants`), keyed by name.

    Variants without their own samples share one pass over `samples`, so it may be a one-shot iterator.
    """
    model = _model(drafter_dir)
    samples_iter = iter(samples)
    first = next(samples_iter, None)
    if first is None:
        raise ValueError("no samples to simulate")
    if variants is None:
        variants = standard_variants(first[1].shape[1], checkpoint_flags(model),
                                     mla_attention(model.config.transformer_layer_config))
    names = [v.name for v in variants]
    if len(set(names)) != len(names):
        raise ValueError(f"variant names repeat: {names}")
    norm = target_final_norm(model, final_norm)
    if norm is None and any(v.final_slot_post_norm for v in variants):
        raise ValueError("a post-norm variant needs the target's final norm: pass final_norm, or load the "
                         "drafter with its verifier")
    shared = [v for v in variants if v.samples is None]
    counts = {v.name: AcceptanceCounts(num_speculative_tokens) for v in variants}
    drafters = {v.name: SpeculatorsDrafter(model, d2t=None if v.drop_d2t else d2t, norm_flags=dict(v.norm_flags),
                                           attention=dict(v.attention)) for v in variants}

    def run(variant: Variant, index: int, sample: Sample) -> None:
        token_ids, hidden_states, prompt_len = sample
        aux = serving_inputs(hidden_states, variant.aux_slots, norm if variant.final_slot_post_norm else None)
        simulate_sequence(drafters[variant.name], torch.as_tensor(token_ids), aux, int(prompt_len),
                          num_speculative_tokens, counts[variant.name], sequence=index)
        if not variant.drop_d2t:  # the KL is taken over the draft vocabulary: blind to the map itself
            add_first_draft_fit(counts[variant.name], drafters[variant.name], hidden_states, int(prompt_len))

    for index, sample in enumerate(itertools.chain([first], samples_iter)):
        for variant in shared:
            run(variant, index, sample)
    for variant in variants:
        if variant.samples is not None:
            for index, sample in enumerate(variant.samples):
                run(variant, index, sample)
    return {v.name: {"variant": describe(v), **counts[v.name].summary()} for v in variants}


def describe(variant: Variant) -> dict[str, Any]:
    return {"name": variant.name, "aux_slots": None if variant.aux_slots is None else list(variant.aux_slots),
            "final_slot_post_norm": variant.final_slot_post_norm, "norm_flags": dict(variant.norm_flags),
            "drop_d2t": variant.drop_d2t, "attention": dict(variant.attention),
            "own_samples": variant.samples is not None}
