"""The drafter folder: the one place that knows what an EAGLE-3 drafter folder is. What layouts, tensors, folder and
to_speculators each hold is docs/formats.md's opening section; planned: the drafter stage 04 will train, planned
from the run config (its dimensions and parameters).

Nothing here imports a stage, stage 05's checks (drafter_checks/) or the conversion to flat (convert.py). The MLA
drafter (`Eagle3DeepseekV2ForCausalLM`) is a second layer shape of the same folder, not another set of modules
(`layouts.layer_shape`; docs/formats.md, "The MLA drafter folder").
"""
