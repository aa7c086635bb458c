"""Offline prediction of what vLLM measures for a drafter: greedy speculative decoding replayed with its own forward.

A drafter can train well, convert cleanly, load in vLLM and still be accepted rarely because the engine
feeds it the wrong thing. Replaying temperature-0 speculative decoding on the target's greedy answers, with
the drafter fed exactly as vLLM feeds it, predicts the engine's acceptance counters; replaying it with a
known serving mistake (a variant) predicts what that mistake would measure.
"""
