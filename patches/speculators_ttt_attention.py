"""The drafter's attention during training on the CPU (an MLA drafter's on every device), computed over the keys
it can see. Targets speculators 0.9.0 (and transformers 5.19's attention-function interface).

speculators trains an EAGLE-3 drafter with test-time training (TTT): each of `ttt_steps` passes runs the
decoder layer over the whole packed batch of L tokens again, and its keys and values are appended to one
cache, so step k attends over (k + 1) * L keys. Its mask (`create_combined_mask_mod`, extended each step by
`extend_dense_mask_for_draft_tokens`) lets token i see the step-0 keys of its own document up to i, and,
of every later block, only key i: the draft positions it has itself produced. With
`--draft-attn-impl sdpa` (the CPU setting: flex attention has no CPU backward) torch's attention kernel is
handed that dense [L, (k + 1) L] mask and computes every score, masked or not: three steps cost 6 L^2 scores
for about 1.5 L^2 + 3 L that count (attention's share of a step: docs/measurements.md).

`block_attention` computes the same attention from the structure: the step-0 block as one masked matmul
(the mask's first L columns as built), each later block as one dot product per token (its diagonal), one
softmax in float32 over both, as transformers' eager attention does. No score of a later block off its
diagonal is formed, so that part of the mask is not read. The arithmetic is eager attention's, so results
agree with the fused kernel's to rounding (tests/test_ttt_attention.py: outputs and gradients against
transformers' SDPA path on speculators' own masks), not bit for bit.

`apply()` wraps `Eagle3DraftModel.forward`: for a drafter built with `sdpa` attention, on a host without an
accelerator or, on every host, when its layer is MLA (patches/speculators_mla.py), its layers use
`block_attention` for the length of that call and SDPA again afterwards. An MLA layer's queries and keys are
qk_nope_head_dim + qk_rope_head_dim wide (192 for Kimi-K2.5) and its values v_head_dim (128): speculators'
flex-attention path is not used for it (patches/speculators_mla.py builds MLA drafters with dense masks), and
SDPA given the dense [L, (k + 1) L] mask computes every score behind it on a GPU as on the CPU;
`block_attention` takes the value width from the values and forms only the scores that count, one tested
arithmetic on every device. Nothing else changes:
`eagle_pipeline/predict/` (which drives the layers with a KV cache of its own) and a Llama drafter on a GPU
host (flex attention with block masks, compiled) keep upstream's attention.

The functions relied on are fingerprinted; `apply` refuses another speculators version or a changed
source, and tests/test_ttt_attention.py fails on the same condition.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from patches.speculators_cpu import check_version, require_unchanged_sources
from patches.speculators_mla import is_mla_layer_config

ATTENTION_NAME = "eagle3_ttt_blocks"

UPSTREAM_SOURCE_SHA256: dict[str, str] = {
    # Wrapped. Runs the TTT steps: keys and values appended to one DynamicCache, the dense mask extended
    # by one diagonal block per step, every layer's attention called with the layer config's implementation.
    "speculators.models.eagle3.core:Eagle3DraftModel.forward":
        "f682b266d1b18786842b8d031697e9e396acc1d710ed55b343ef6fd5d3a48df0",
    # Chooses the dense boolean mask (create_mask) for "sdpa"; the layers share the layer config.
    "speculators.models.eagle3.core:Eagle3DraftModel.__init__":
        "788dcc47a9fce45d0d132653f5668baf185b8c1fede463918a28b240350be25a",
    # The mask's structure: (causal and same document) or the token itself; later blocks diagonal only.
    "speculators.models.eagle3.attention:create_combined_mask_mod":
        "79f3165e7b34b605332bcd850448e6e7e927c2c5f4d6e63e6c6a0cc824c9db0d",
    "speculators.models.eagle3.attention:extend_dense_mask_for_draft_tokens":
        "704945d4ecea19ae1879ece230b14dad9f3405a1a0e35b21345cec87b0138e0d",
    # transformers' Llama attention (the drafter's layer type): hands the mask and the cached keys to the
    # attention function its config names.
    "transformers.models.llama.modeling_llama:LlamaAttention.forward":
        "dc6807936ef6103d2675e82361b9c82359d43356a331140bbb1a974595522bff",
    # transformers' MLA attention (an MLA drafter's layer): expands the cached latent into per-head keys
    # (qk_nope + qk_rope wide) and values (v_head_dim wide) and hands them to the function its config names.
    "transformers.models.deepseek_v3.modeling_deepseek_v3:DeepseekV3Attention.forward":
        "d51be5973c10f50356175dd8822ef97d1c09d17a5da620923d8761098287c66b",
}

_installed = False


def _sdpa(*args, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(*args, **kwargs)


def block_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention-function interface: query [B, H, L, D], key [B, KV, S, D] and value [B, KV, S, Dv]
    with S = steps * L (Dv = D for Llama, v_head_dim for MLA), a boolean mask [1 or B, 1, L, S]; returns
    ([B, L, H, Dv], None). Anything that is not a TTT step (no boolean mask, S not a multiple of L, dropout, a
    mask per head) goes to transformers' SDPA."""
    batch, heads, length, head_dim = query.shape
    kv_heads, value_dim = key.shape[1], value.shape[-1]
    steps, remainder = divmod(key.shape[2], length)
    if (attention_mask is None or attention_mask.dtype != torch.bool or attention_mask.shape[1] != 1
            or attention_mask.shape[-1] != key.shape[2] or remainder or dropout or heads % kv_heads):
        return _sdpa(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    group = heads // kv_heads
    scale = head_dim ** -0.5 if scaling is None else scaling
    # Query heads that share a key head are stacked along the rows, so keys are never repeated.
    grouped_query = query.reshape(batch, kv_heads, group, length, head_dim)
    context_scores = torch.matmul(grouped_query.reshape(batch, kv_heads, group * length, head_dim),
                                  key[:, :, :length].transpose(-1, -2)).view(batch, kv_heads, group, length, length)
    context_scores = context_scores.masked_fill(~attention_mask[:, :, None, :, :length], float("-inf"))
    # Block j >= 1: token i sees only its own key i there.
    draft_scores = [(grouped_query * key[:, :, None, j * length:(j + 1) * length]).sum(-1, keepdim=True)
                    for j in range(1, steps)]
    scores = torch.cat([context_scores, *[s.to(context_scores.dtype) for s in draft_scores]], dim=-1) * scale
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    output = torch.matmul(weights[..., :length].reshape(batch, kv_heads, group * length, length),
                          value[:, :, :length]).view(batch, kv_heads, group, length, value_dim)
    for j in range(1, steps):
        output = output + weights[..., length + j - 1:length + j] * value[:, :, None, j * length:(j + 1) * length]
    return output.reshape(batch, heads, length, value_dim).transpose(1, 2).contiguous(), None


def uses_block_attention(model) -> bool:
    """Whether this drafter's training forward takes `block_attention`: SDPA chosen, and no accelerator or an
    MLA layer."""
    return model._attn_impl == "sdpa" and (not torch.accelerator.is_available()
                                           or is_mla_layer_config(model.config.transformer_layer_config))


@contextmanager
def _layers_on_block_attention(model) -> Iterator[None]:
    layer_config = getattr(model, "_block_attention_layer_config", None)
    if layer_config is None:
        # A copy, so that the model's own config (saved with every checkpoint) keeps "sdpa".
        layer_config = copy.copy(model.config.transformer_layer_config)
        layer_config._attn_implementation = ATTENTION_NAME
        model._block_attention_layer_config = layer_config
    attentions = [layer.self_attn for layer in model.layers]
    configs = [attention.config for attention in attentions]
    for attention in attentions:
        attention.config = layer_config
    try:
        yield
    finally:
        for attention, config in zip(attentions, configs, strict=True):
            attention.config = config


def apply() -> None:
    """Install the forward wrapper once (it decides per call); refuses another speculators or changed sources."""
    global _installed
    check_version()
    require_unchanged_sources(UPSTREAM_SOURCE_SHA256, "patches/speculators_ttt_attention.py")
    if _installed:
        return
    from speculators.models.eagle3.core import Eagle3DraftModel
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, block_attention)
    upstream_forward = Eagle3DraftModel.forward

    @functools.wraps(upstream_forward)
    def forward(self, *args, **kwargs):
        if not uses_block_attention(self):
            return upstream_forward(self, *args, **kwargs)
        with _layers_on_block_attention(self):
            return upstream_forward(self, *args, **kwargs)

    Eagle3DraftModel.forward = forward
    _installed = True
