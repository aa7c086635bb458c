"""Offline prediction of what vLLM measures for a drafter: greedy speculative decoding replayed with its own forward.

A drafter can train well, convert cleanly, load in vLLM and still be accepted rarely because the engine
feeds it the wrong thing. Replaying temperature-0 speculative decoding on the target's greedy answers, with
the drafter fed exactly as vLLM feeds it, predicts the engine's acceptance counters; replaying it with a
known serving mistake (a variant) predicts what that mistake would measure. Modules:

- `simulate`: the chain-by-chain replay and vLLM's counters, for any drafter behind the `Drafter` protocol;
- `speculators_drafter`: a speculators EAGLE-3 checkpoint run with vLLM's serving-time inputs;
- `variants`: which hidden-state slots and config the engine uses, as named variants;
- `acceptance`: predictions over many conversations, as served and per variant;
- `flat_drafter`: a flat drafter folder read back into speculators' layout, to replay it;
- `diagnose`: the cause of a gap between served and predicted acceptance, from the variants' replays;
- `served`: stage 06's prediction: the replay's capture, the drafter as served, the diagnosis.
"""
