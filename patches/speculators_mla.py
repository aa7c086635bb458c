"""An EAGLE-3 drafter whose decoder layer is the target's MLA attention, trained in speculators' own Trainer.
Targets speculators 0.9.0 (and transformers 5.19's DeepSeek-V3 modules).

speculators 0.9.0 builds a drafter's layers from `model_definitions.model_classes[transformer_layer_config.
model_type]` and knows "llama" and "qwen3". `apply()` registers "deepseek_v3" there: a `ModelComponents` whose
first layer is speculators' `Eagle3FirstLayerMixin` over transformers' `DeepseekV3DecoderLayer`, with the MLA
input projections (`q_a_proj`, or `q_proj` without a query latent, and `kv_a_proj_with_mqa`) widened to
2 x hidden for `cat([embeds, hidden])`, a `hidden_norm`, and the dense SwiGLU MLP; later layers, the norms and
the rotary embedding are transformers' `DeepseekV3DecoderLayer`, `DeepseekV3RMSNorm`, `DeepseekV3RotaryEmbedding`.
It also wraps `Eagle3DraftModel.__init__` so that such a drafter never gets speculators' flex-attention default:
its attention is computed with dense masks (SDPA, or patches/speculators_ttt_attention.py's `block_attention`
during training, which handles query/key width 192 and value width 128 on every device).

What the layer computes, against vLLM 0.32's `Eagle3DeepseekV2ForCausalLM` (vllm/model_executor/models/
deepseek_eagle3.py, deepseek_v2.py, layers/mla.py, layers/rotary_embedding/deepseek_scaling_rope.py), which is
what serves the drafter; tests/test_mla_drafter.py computes vLLM's formulas independently and compares:

- First-layer input: vLLM `input_size=2 * hidden_size if layer_idx == 0` (deepseek_eagle3.py:82) sizes
  `fused_qkv_a_proj` = [q_a_proj; kv_a_proj_with_mqa] (deepseek_v2.py:1051-1065; without q_lora_rank, `q_proj`
  and `kv_a_proj_with_mqa`, 1090-1097 and 1058-1065), no bias; here the same two Linear layers over 2 x hidden.
  vLLM fuses the pair only at load (deepseek_eagle3.py:258-267), the checkpoint keeps them apart.
- Norm and residual order: vLLM norms the embedding with `input_layernorm` and the hidden part with
  `hidden_norm`, the residual being the hidden part before its norm, or after it with `norm_before_residual`
  (deepseek_eagle3.py:99-131); speculators' `Eagle3FirstLayerMixin.forward` does exactly that. After attention
  vLLM's fused add-norm `post_attention_layernorm(hidden, residual)` and the final `norm(hidden, residual)`
  (deepseek_eagle3.py:143, 251) are the mixin's `residual + attn`, `post_attention_layernorm`, `residual + mlp`
  and speculators' final `norm`; `norm_output` picks the post-norm state as the next step's input in both
  (deepseek_eagle3.py:253-256; speculators core.py `forward`).
- Latent norms: vLLM builds `q_a_layernorm` and `kv_a_layernorm` with `eps=config.rms_norm_eps`
  (deepseek_v2.py:1082, 1098); transformers' with its default 1e-6. The layer here takes the config's eps.
- Attention: q = q_b_proj(q_a_layernorm(q_a_proj(x))) split [qk_nope | qk_rope] per head, the latent
  kv_a_proj_with_mqa(x) split [kv_lora_rank | qk_rope], the first part normed and expanded by kv_b_proj into
  per-head [k_nope | v], the rope part one key shared by every head (layers/mla.py:183-231); transformers'
  `DeepseekV3Attention.forward` and `expand_kv` are the same with the latent cached, as vLLM caches it.
- Softmax scale: qk_head_dim ** -0.5 (deepseek_v2.py:1044) times yarn_get_mscale(factor, mscale_all_dim) ** 2
  for YaRN (1129-1136); transformers' `yarn_apply_mscale` is the same product (skipped when mscale_all_dim is
  0, where vLLM's factor is 1.0 too).
- RoPE on the qk_rope slice only, of width qk_rope_head_dim (vLLM `get_rope(qk_rope_head_dim, ...)`,
  deepseek_v2.py:1122-1127). transformers' `DeepseekV3Config` sets head_dim = qk_rope_head_dim, so speculators'
  rotary embedding (built from a copy of the layer config with twice the hidden size, core.py `__init__`)
  has that width: the doubled hidden size only enters a rotary width through hidden_size // heads, which
  head_dim overrides.
- Interleaved RoPE: vLLM rotates with `is_neox_style=False` (deepseek_v2.py:1126), i.e. `rotate_gptj`, pairs
  (x0, x1), (x2, x3), ... each at one frequency (deepseek_scaling_rope.py:158-167); transformers'
  `apply_rotary_pos_emb_interleave` (`rope_interleave: true`) rotates the same pairs and writes them out
  de-interleaved, the same permutation for queries and keys, so every score is the same.
- YaRN frequencies and cos/sin scale: vLLM's `DeepseekScalingRotaryEmbedding` (deepseek_scaling_rope.py:73-101,
  correction range from beta_fast/beta_slow over original_max_position_embeddings, truncated) and cos/sin times
  yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim) (52-55, 110-111); transformers'
  `_compute_yarn_parameters` computes the same frequencies and the same factor where both mscale and
  mscale_all_dim are set or mscale is 1. `rope_mismatch` names the rope settings where the two differ (an
  explicit attention_factor, which also turns vLLM's rope into deepseek_llama_scaling without the softmax
  mscale, deepseek_v2.py:1115-1121; truncate false; a rope type vLLM reads as YaRN); stage 04 refuses them.
- MLP: dense SiLU(gate) * up then down (vLLM `DeepseekV2MLP`, deepseek_v2.py:278-287, always dense for EAGLE-3,
  deepseek_eagle3.py:85-92); transformers' `DeepseekV3MLP`, which the first layer keeps whatever
  first_k_dense_replace says.

The upstream functions relied on are fingerprinted (`UPSTREAM_SOURCE_SHA256`); `apply` refuses another
speculators version or a changed source. `VLLM_SOURCE_SHA256` fingerprints the vLLM code the list above cites;
tests/test_mla_drafter.py checks it (`apply` does not import vLLM).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch
from speculators.models.base_components import ModelComponents
from speculators.models.eagle3.model_definitions import Eagle3FirstLayerMixin
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3MLP,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)

from patches.speculators_cpu import _register_kimi_k2_config, check_version, require_unchanged_sources

# speculators' model_classes key, and the transformer_layer_config.model_type of an MLA drafter's checkpoint.
REGISTRY_KEY = "deepseek_v3"
# The same layer under Kimi's name. vLLM renames transformers' DeepseekV3Config itself to "kimi_k2" in any
# process that has read a Kimi config (vllm/transformers_utils/config.py, _register_config_class sets the class
# attribute), so a DeepseekV3Config serialised after that (stage 05's read-back of its flat folder, the
# replay of one) says "kimi_k2".
REGISTRY_KEYS = (REGISTRY_KEY, "kimi_k2")
# The attention implementations that take dense masks; anything else (flex attention) is replaced by "sdpa".
DENSE_MASK_ATTENTION = ("sdpa", "eager")

_TF = "transformers.models.deepseek_v3.modeling_deepseek_v3"
UPSTREAM_SOURCE_SHA256: dict[str, str] = {
    # The first-layer forward the MLA layer inherits: split [embeds | hidden], input_layernorm / hidden_norm,
    # norm_before_residual, attention, residual, post_attention_layernorm, MLP, residual.
    "speculators.models.eagle3.model_definitions:Eagle3FirstLayerMixin.forward":
        "92cde18a7629aecf7bae8f30c2143da408662c83deae2d26b5149262e7e05946",
    # Wrapped (dense masks for MLA). Builds the layers from model_classes[model_type], the rotary embedding
    # from a copy of the layer config with twice the hidden size, the norms from norm_class.
    "speculators.models.eagle3.core:Eagle3DraftModel.__init__":
        "788dcc47a9fce45d0d132653f5668baf185b8c1fede463918a28b240350be25a",
    # Calls the layers with the rotary embedding's cos/sin, the cache and the mask; norm_output.
    "speculators.models.eagle3.core:Eagle3DraftModel.forward":
        "f682b266d1b18786842b8d031697e9e396acc1d710ed55b343ef6fd5d3a48df0",
    "speculators.models.utils:flatten_rope_parameters":
        "6f347a257f105ac790017c4d1bce25dfbdbaaa7601839ff49a66544db96a6771",
    # Reads a checkpoint's transformer_layer_config through the config class of its model_type.
    "speculators.models.eagle3.config:Eagle3SpeculatorConfig.validate_transformer_config":
        "c1e994760b8946b51b72766fea73fce3f3b7efb3221ae16c9cf9ea6edd43411b",
    "speculators.models.base_components:ModelComponents":
        "faf80f7339ef42d032db8e08dc334b5502aff570eea969d985986867147e98ee",
    # transformers' MLA layer, as the list in the docstring describes it.
    f"{_TF}:DeepseekV3Attention.__init__": "3aef62456a38b86cd5e5db228c087d7f7b463ba64c965ca70148d7565d811b3f",
    f"{_TF}:DeepseekV3Attention.forward": "d51be5973c10f50356175dd8822ef97d1c09d17a5da620923d8761098287c66b",
    f"{_TF}:DeepseekV3Attention.expand_kv": "44c910b29abd67abf13f3fe01e304bb0d947c3a6d1b43b2e12e1cca8c11e0ed6",
    f"{_TF}:DeepseekV3DecoderLayer.__init__": "83b2207d7120b356cc74b742432b22f720255ca291d72a590f7e6543c64d2c0d",
    f"{_TF}:DeepseekV3MLP.forward": "03df2d7685cf8446594448cbd33ef676a2b088779d99d9803abe3bed2ec7ad9b",
    f"{_TF}:DeepseekV3RMSNorm.forward": "790fa612e4fa57acfcbea31da45f92ba91f9016f7260ef539f61c5530ba06a5f",
    f"{_TF}:DeepseekV3RotaryEmbedding.__init__": "d7e58e73f9587b1332e86f96e8796383b9165befcc045dd11d4daad5b047f85a",
    f"{_TF}:DeepseekV3RotaryEmbedding.forward": "d5289777a85ea890f1c715511474f81f73c06b29d3d0792a37d8ad7347683445",
    f"{_TF}:apply_rotary_pos_emb_interleave": "8ed90f4983a65a1e83ec329c093ecfb785c3254d0fc229a6c77226f4f53aeeba",
    f"{_TF}:yarn_apply_mscale": "4ef036930f05b466dbb6b83d74286f958dfffa61c7f1e42b547816eed358c054",
    f"{_TF}:yarn_get_mscale": "1ef61394fdbf2127e24ac2a05377035828f766a01fa3359d8dbced98979a65f6",
    "transformers.models.deepseek_v3.configuration_deepseek_v3:DeepseekV3Config.__post_init__":
        "4c0c6c15d5d4cfd18aa97126758ebafa2c32109a8111ec232c6d72c91af0a141",
    "transformers.modeling_rope_utils:_compute_yarn_parameters":
        "19637b57845378007dd8fa9741e565b4fe3669541d046fee5b7d520a0dbf2cf1",
}

# The vLLM 0.32.0 code the docstring's correspondences cite (checked by tests/test_mla_drafter.py).
_VLLM = "vllm.model_executor"
VLLM_SOURCE_SHA256: dict[str, str] = {
    f"{_VLLM}.models.deepseek_eagle3:DeepseekV2Eagle3DecoderLayer":
        "5f60caede30628665a63d3f6a4fd7fdb0d50fffcc88a1bff1acb6cba9cb35821",
    f"{_VLLM}.models.deepseek_eagle3:DeepseekV2Eagle3Model":
        "1dc16f1f0016829b28581e24db598bded3e24b2226145629b11dbf5ac5d1538f",
    f"{_VLLM}.models.deepseek_v2:DeepseekV2MLAAttention.__init__":
        "68c10ff1a269337342b9637d6f929310dd827851a6ae52adb2b23eb6e3bfe3e5",
    f"{_VLLM}.models.deepseek_v2:DeepseekV2MLP": "79e275dd06bcdf7aa6b8b7ec5d5fff688f2abcf315f14fd94395f91c2a756960",
    f"{_VLLM}.layers.mla:MultiHeadLatentAttentionWrapper.forward":
        "5d22cac76653845841563782d1e3547205d26b73f1871238845709fe63209b44",
    f"{_VLLM}.layers.rotary_embedding.deepseek_scaling_rope:DeepseekScalingRotaryEmbedding":
        "a5b80712d3079ec1eb12aaf16957bfde961fab196337c6f8575566b364ca53f6",
    f"{_VLLM}.layers.rotary_embedding.common:rotate_gptj":
        "83449ed2ad21f4dc6537951cc3fbb0af1ad9420157db4114e49d296311715932",
    f"{_VLLM}.layers.rotary_embedding.common:yarn_find_correction_range":
        "b251a9918572670df36bedff4742be7480097438bca7db64edb4643980adafd1",
    f"{_VLLM}.layers.rotary_embedding:get_rope": "eae42f62bf00b0e8e14b14da17e7c9b9cc513f107764fd3aa080ee400595f3bb",
}

_installed = False


class DeepseekV3DecoderEagle3FirstLayer(Eagle3FirstLayerMixin, DeepseekV3DecoderLayer):  # type: ignore[misc]
    """The drafter's first layer: DeepSeek-V3's MLA decoder layer reading cat([embeds, hidden]) (2 x hidden)."""

    def __init__(self, config, layer_idx: int, norm_before_residual: bool = False):
        super().__init__(config, layer_idx)
        hidden, attention = config.hidden_size, self.self_attn
        self.norm_before_residual = norm_before_residual
        self.hidden_norm = DeepseekV3RMSNorm(hidden, eps=config.rms_norm_eps)
        # vLLM's EAGLE-3 layer is always dense (its MLP, not MoE), whatever first_k_dense_replace says.
        if not isinstance(self.mlp, DeepseekV3MLP):
            self.mlp = DeepseekV3MLP(config)
        if attention.q_lora_rank is None:
            attention.q_proj = torch.nn.Linear(2 * hidden, attention.num_heads * attention.qk_head_dim, bias=False)
        else:
            attention.q_a_proj = torch.nn.Linear(2 * hidden, attention.q_lora_rank, bias=config.attention_bias)
            attention.q_a_layernorm.variance_epsilon = config.rms_norm_eps
        attention.kv_a_proj_with_mqa = torch.nn.Linear(2 * hidden, attention.kv_lora_rank + attention.qk_rope_head_dim,
                                                       bias=config.attention_bias)
        attention.kv_a_layernorm.variance_epsilon = config.rms_norm_eps


COMPONENTS = ModelComponents(
    first_layer_class=DeepseekV3DecoderEagle3FirstLayer,
    decoder_layer_class=DeepseekV3DecoderLayer,
    norm_class=DeepseekV3RMSNorm,
    rotary_emb_class=DeepseekV3RotaryEmbedding,
)


def is_mla_layer_config(layer_config: Any) -> bool:
    return getattr(layer_config, "model_type", None) in REGISTRY_KEYS


def _get_mscale(scale: float, mscale: float) -> float:
    # vLLM's and transformers' yarn_get_mscale.
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_mismatch(rope_parameters: Mapping[str, Any] | None) -> str | None:
    """Why transformers' DeepSeek-V3 rope and softmax scale would differ from vLLM's MLA drafter for these rope
    parameters (a verifier's `rope_parameters`, rope_theta included), or None where they agree."""
    params = dict(rope_parameters or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "yarn":
        # deepseek_v2.py:1115-1121: every other rope type becomes deepseek_yarn (or deepseek_llama_scaling).
        return f"rope type {rope_type!r}: vLLM's MLA layer computes every scaled rope as DeepSeek's YaRN"
    if "attention_factor" in params:
        return ("an explicit attention_factor: vLLM's MLA layer ignores it for cos/sin, and at 1.0 drops the softmax "
                "mscale (deepseek_llama_scaling)")
    if params.get("truncate", True) is not True:
        return "truncate false: vLLM's DeepSeek YaRN always truncates the correction range"
    factor = params.get("factor")
    if factor is None:
        return "no YaRN factor: vLLM's DeepSeek YaRN needs one"
    mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
    # transformers' _compute_yarn_parameters against vLLM's DeepseekScalingRotaryEmbedding (defaults 1 and 0).
    ours = _get_mscale(factor, mscale) / _get_mscale(factor, mscale_all_dim) if mscale and mscale_all_dim \
        else _get_mscale(factor, 1)
    vllm = _get_mscale(factor, 1 if mscale is None else mscale) / _get_mscale(factor, mscale_all_dim or 0)
    if not math.isclose(ours, vllm, rel_tol=1e-12):
        return f"mscale {mscale} with mscale_all_dim {mscale_all_dim}: cos/sin scale {ours} here, {vllm} in vLLM"
    return None


def apply() -> None:
    """Register the MLA layer under "deepseek_v3" and install the dense-mask wrapper once; refuses another
    speculators version or changed sources."""
    global _installed
    check_version()
    require_unchanged_sources(UPSTREAM_SOURCE_SHA256, "patches/speculators_mla.py")
    if _installed:
        return
    from speculators.models.eagle3 import core, model_definitions

    # core.py imported this very dict by name, so the key is visible to Eagle3DraftModel.
    for key in REGISTRY_KEYS:
        model_definitions.model_classes[key] = COMPONENTS
    # A checkpoint that says "kimi_k2" loads in a process where vLLM has not registered the name.
    _register_kimi_k2_config()
    upstream_init = core.Eagle3DraftModel.__init__

    @functools.wraps(upstream_init)
    def __init__(self, config, *args, **kwargs):
        layer_config = config.transformer_layer_config
        # Flex attention is not used for MLA drafters: the masks are built dense (core.py __init__ picks
        # create_mask for "sdpa"), the attention function sees query/key width 192 and value width 128.
        if is_mla_layer_config(layer_config) and layer_config._attn_implementation not in DENSE_MASK_ATTENTION:
            layer_config._attn_implementation = "sdpa"
        upstream_init(self, config, *args, **kwargs)

    core.Eagle3DraftModel.__init__ = __init__
    _installed = True
