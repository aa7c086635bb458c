"""Online training (hidden_states.mode: online): stage 04 trains through speculators' own online dataset, which
asks a vLLM capture server for each sample's hidden states, checks them, trains on them and deletes them
(docs/online.md). Stage 04's part, in order, is session.py; each module's docstring says what it owns.
"""
