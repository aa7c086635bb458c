"""The drafter folder: the one place that knows what an EAGLE-3 drafter folder is.

- layouts: the layouts (speculators' checkpoint, the flat `LlamaForCausalLMEagle3` folder vLLM loads, SGLang's)
  and the one table of tensor names across them (`WEIGHT_NAMES`), the norm flags and how each layout and
  engine reads a missing one, the key that makes a config speculators' own, the `model.` export prefix;
- tensors: the numbers that fix every tensor shape (`DraftDims`), the tensors a config implies and the ones a
  folder holds (safetensors headers), and how the two differ;
- folder: the readers: `describe` (any folder: layout, dims, flags, aux ids as each engine reads them, tensor
  files), a speculators checkpoint, a flat folder to adopt or fine-tune, a flat folder as vLLM reads it;
- to_speculators: a flat folder written in speculators' layout (fine-tuning from one, replaying one offline).

Nothing here imports a stage, stage 05's checks (drafter_checks/, which runs vLLM's jobs on these) or the
conversion to flat (convert.py, which writes through this table).

speculators 0.9 ships a flat-to-speculators converter (`speculators/convert/eagle/eagle3_converter.py`,
`speculators convert`). to_speculators does not use it, because it does not do the same thing: it builds the
whole `Eagle3Speculator` and loads the tensors with `strict=False`, only logging missing and unexpected keys,
so an absent `embed_tokens` stays randomly initialised instead of the target's (see to_speculators); it renames
`midlayer.*` only (not further `layers.<i>`, nor the `model.` export prefix); it reads rope from
`rope_theta`/`rope_scaling` only and fills every absent dimension with a default (vocabulary 128000, draft
vocabulary 32000, 8 key/value heads) instead of refusing; it fixes the speculative token count at 3 and
writes in place, not atomically. What it does use, speculators' own config classes (`Eagle3SpeculatorConfig`,
`SpeculatorsConfig`, `VerifierConfig`, `LlamaConfig`), to_speculators uses too.

The MLA drafter vLLM serves as `Eagle3DeepseekV2ForCausalLM` (`midlayer.self_attn.{q_a_proj, q_a_layernorm,
q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}` beside the same `fc`, `norm`, `lm_head`, layer
norms and mlp) is a second layer shape of the same folder, not another set of modules: `layouts.layer_shape` names
it, `DraftDims` carries its MLA dimensions, `tensors.expected_tensor_specs` its tensors (and
`tensors.split_fused_tensors` reads a fused `fused_qkv_a_proj` as its two projections), and the two config writers
(convert.mla_flat_config, to_speculators.mla_decoder_config) have an MLA branch (docs/formats.md, "The MLA
drafter folder").
"""
