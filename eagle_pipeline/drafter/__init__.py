"""The drafter folder: the one place that knows what an EAGLE-3 drafter folder is (docs/formats.md).

- layouts: the layouts and the one table of tensor names across them (`WEIGHT_NAMES`), the norm flags and how each
  layout and engine reads a missing one, the key that makes a config speculators' own, the weight files;
- tensors: the numbers that fix every tensor shape (`DraftDims`), the tensors a config implies and a folder holds;
- folder: the readers: `describe` (any folder), a speculators checkpoint, a flat folder's config, a flat folder to
  adopt or fine-tune, a folder's tensors;
- to_speculators: a flat folder written in speculators' layout (fine-tuning from one, replaying one offline);
- planned: the drafter stage 04 will train, planned from the run config: its dimensions and parameters.

Nothing here imports a stage, stage 05's checks (drafter_checks/) or the conversion to flat (convert.py). The MLA
drafter (`Eagle3DeepseekV2ForCausalLM`) is a second layer shape of the same folder, not another set of modules
(`layouts.layer_shape`; docs/formats.md, "The MLA drafter folder").
"""
