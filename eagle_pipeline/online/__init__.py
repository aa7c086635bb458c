"""Online training (hidden_states.mode: online, docs/online.md): stage 04 trains through speculators' own online
dataset (`speculators.train.data.ArrowDataset` with a vLLM endpoint and `on_missing="generate"`), which asks a
vLLM capture server for each sample's hidden states, checks them, trains on them and deletes them.

- settings.py    what every training rank needs (endpoints, transfer, window, retries) and speculators' flags for it
- servers.py     capture servers this host starts (vLLM's server with the capture method), kept up by a supervisor
- mooncake.py    a Mooncake master and store this host starts when the transfer is mooncake
- client.py      one capture round trip through speculators' client and the run's transfer
- endpoints.py   each capture server checked for the target, the layer ids and the connector before training
- kept.py        the few validation rows whose states are captured once and kept (replay, stage 05's parity)
- disk.py        the disk the states in flight hold, sampled while training runs (its peak goes in the manifest)
- failure.py     a capture server that stays away stops training with one message naming it
- session.py     stage 04's online part, in order: services, servers, checks, kept rows, disk watch, summary
- memory.py      whether a target and its trainer share the GPUs (co-located) or take turns (time-sliced), and
                 the capture server's share and sequences that follow
- serve_capture.py  `python -m eagle_pipeline.online.serve_capture`: a capture server for trainers elsewhere
"""
