"""Offline prediction of what vLLM measures for a drafter: greedy speculative decoding replayed with its own forward.

A drafter can train well, convert cleanly, load in vLLM and still be accepted rarely because the engine
feeds it the wrong thing. Replaying temperature-0 speculative decoding on the target's greedy answers, with
the drafter fed exactly as vLLM feeds it, predicts the engine's acceptance counters; replaying it with a
known serving mistake (a variant) predicts what that mistake would measure. Modules:

- `simulate`: the chain-by-chain replay and vLLM's counters, for any drafter behind the `Drafter` protocol;
- `speculators_drafter`: a speculators EAGLE-3 checkpoint run with vLLM's serving-time inputs;
- `variants`: which hidden-state slots and config the engine uses, as named variants;
- `acceptance`: predictions over many conversations, as served and per variant.
"""

from eagle_pipeline.predict.acceptance import predict_acceptance, simulate_samples, simulate_variants
from eagle_pipeline.predict.simulate import AcceptanceCounts, Drafter, draft_table, simulate_sequence, walk_chains
from eagle_pipeline.predict.speculators_drafter import SpeculatorsDrafter, load_drafter, teacher_forced_drafts
from eagle_pipeline.predict.variants import Variant, serving_inputs, shifted_slots, standard_variants

__all__ = [
    "AcceptanceCounts", "Drafter", "SpeculatorsDrafter", "Variant", "draft_table", "load_drafter",
    "predict_acceptance", "serving_inputs", "shifted_slots", "simulate_samples", "simulate_sequence",
    "simulate_variants", "standard_variants", "teacher_forced_drafts", "walk_chains",
]
