"""Online training (hidden_states.mode: online, docs/online.md); stage 04's part, in order, is session.py."""
