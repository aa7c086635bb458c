"""patches/speculators_ttt_attention.py: the drafter's training attention computed block by block gives what
transformers' SDPA gives on speculators' own TTT masks, outputs and gradients; the drafter's whole training
forward takes it on a CPU host only, and its saved config and the layers after the call are as shipped."""

from __future__ import annotations

import pytest
import torch

from patches import speculators_ttt_attention
from patches.upstream import source_sha256

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's shape: grouped-query attention, 3 heads per key


def ttt_mask(document_ids: torch.Tensor, steps: int) -> torch.Tensor:
    """speculators' dense mask for TTT step `steps - 1`, built by its own functions."""
    from speculators.models.eagle3.attention import create_combined_mask_mod, extend_dense_mask_for_draft_tokens
    from torch.nn.attention.flex_attention import create_mask

    length = document_ids.shape[0]
    mask = create_mask(create_combined_mask_mod(document_ids, length), None, None, length, length, device="cpu")
    for _ in range(steps - 1):
        mask = extend_dense_mask_for_draft_tokens(mask, length)
    return mask


def packed_document_ids() -> torch.Tensor:
    # Three conversations packed into one batch, then padding (-1), as speculators' collate builds it.
    return torch.tensor([0] * 23 + [1] * 40 + [2] * 17 + [-1] * 8)


def attention_module(groups: int) -> torch.nn.Module:
    """What an attention function reads of its layer: transformers' Llama attention sets these two."""
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, groups
    return module


@pytest.mark.parametrize("qualified_name", sorted(speculators_ttt_attention.UPSTREAM_SOURCE_SHA256))
def test_upstream_source_is_the_one_the_patch_was_written_for(qualified_name):
    assert (source_sha256(qualified_name)
            == speculators_ttt_attention.UPSTREAM_SOURCE_SHA256[qualified_name])


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_block_attention_equals_sdpa_on_speculators_ttt_masks(steps):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(steps)
    document_ids = packed_document_ids()
    length = document_ids.shape[0]
    mask = ttt_mask(document_ids, steps)
    assert mask.shape == (1, 1, length, steps * length) and mask.dtype == torch.bool
    module = attention_module(HEADS // KV_HEADS)
    inputs = [torch.randn(1, HEADS, length, HEAD_DIM), torch.randn(1, KV_HEADS, steps * length, HEAD_DIM),
              torch.randn(1, KV_HEADS, steps * length, HEAD_DIM)]
    upstream = [x.clone().requires_grad_() for x in inputs]
    blocks = [x.clone().requires_grad_() for x in inputs]
    expected, _ = sdpa_attention_forward(module, *upstream, mask, scaling=HEAD_DIM ** -0.5)
    found, _ = speculators_ttt_attention.block_attention(module, *blocks, mask, scaling=HEAD_DIM ** -0.5)
    assert found.shape == expected.shape == (1, length, HEADS, HEAD_DIM)
    torch.testing.assert_close(found, expected, rtol=1e-5, atol=1e-5)
    upstream_weights = torch.randn_like(expected)
    (expected * upstream_weights).sum().backward()
    (found * upstream_weights).sum().backward()
    for a, b in zip(blocks, upstream, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5)


def test_anything_but_a_ttt_step_goes_to_sdpa_unchanged():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    module = attention_module(2)
    query, key, value = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 7, 8), torch.randn(1, 2, 7, 8)
    causal_over_cache = torch.ones(5, 7, dtype=torch.bool).tril(2)[None, None]  # 7 keys for 5 queries
    for mask in (None, causal_over_cache):
        expected, _ = sdpa_attention_forward(module, query, key, value, mask)
        found, _ = speculators_ttt_attention.block_attention(module, query, key, value, mask)
        assert torch.equal(found, expected)


def tiny_drafter(tmp_path):
    """A speculators Eagle3DraftModel of a small Llama shape with SDPA attention (the CPU training setting)."""
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    shape = dict(vocab_size=256, hidden_size=96, intermediate_size=128, num_attention_heads=6, num_key_value_heads=2,
                 max_position_embeddings=256, tie_word_embeddings=False)
    layer_config = LlamaConfig(num_hidden_layers=1, **shape)
    layer_config._attn_implementation = "sdpa"
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=256, eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=str(tmp_path / "verifier"), architectures=["LlamaForCausalLM"])))
    torch.manual_seed(0)
    drafter = Eagle3DraftModel(config)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.normal_(0, 0.05)
    return drafter


def training_forward(drafter) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One TTT training step's loss (three steps) and the gradients it gives, on a packed, padded batch."""
    from speculators.losses.utils import resolve_loss_config

    generator = torch.Generator().manual_seed(1)
    document_ids = packed_document_ids()[None]
    length = document_ids.shape[1]
    drafter.zero_grad()
    _, loss, _ = drafter(
        hidden_states=torch.randn(1, length, 3 * 96, generator=generator),
        input_ids=torch.randint(0, 256, (1, length), generator=generator),
        document_ids=document_ids, loss_mask=(document_ids != -1),
        verifier_last_hidden_states=torch.randn(1, length, 96, generator=generator), ttt_steps=3,
        loss_config=resolve_loss_config("kl_div", "eager"))  # as the CPU trains (the fused loss needs Triton)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}


def test_the_drafters_training_step_takes_block_attention_on_a_cpu_host_with_the_same_loss(tmp_path, monkeypatch):
    from transformers.modeling_utils import AttentionInterface

    speculators_ttt_attention.apply()
    drafter = tiny_drafter(tmp_path)
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[2].shape[2])  # the key length the layer attended over
        return speculators_ttt_attention.block_attention(*args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, speculators_ttt_attention.ATTENTION_NAME, counted)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    loss, grads = training_forward(drafter)
    assert calls == [88, 176, 264]  # one layer, three TTT steps over the growing cache
    # Afterwards the layers and the config that checkpoints save are as upstream built them.
    assert drafter.layers[0].self_attn.config is drafter.config.transformer_layer_config
    assert drafter.config.transformer_layer_config._attn_implementation == "sdpa"

    # speculators' own path (what a GPU host, or the `shipped` benchmark arm, runs): the same step.
    monkeypatch.setattr(speculators_ttt_attention, "uses_block_attention", lambda model: False)
    shipped_loss, shipped_grads = training_forward(drafter)
    assert len(calls) == 3
    torch.testing.assert_close(loss, shipped_loss, rtol=1e-5, atol=1e-6)
    assert grads.keys() == shipped_grads.keys() and grads
    for name, grad in grads.items():
        torch.testing.assert_close(grad, shipped_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_gpu_host_keeps_speculators_attention(tmp_path, monkeypatch):
    speculators_ttt_attention.apply()
    drafter = tiny_drafter(tmp_path)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert not speculators_ttt_attention.uses_block_attention(drafter)
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: False)
    assert speculators_ttt_attention.uses_block_attention(drafter)
    drafter._attn_impl = "simple_flex_attention"  # a drafter built for flex attention is left to it
    assert not speculators_ttt_attention.uses_block_attention(drafter)


def test_refuses_another_speculators_version(monkeypatch):
    from patches import speculators_cpu

    monkeypatch.setattr(speculators_cpu, "installed_version", lambda: "0.9.1")
    with pytest.raises(RuntimeError, match=r"targets speculators 0\.9\.0 but 0\.9\.1 is installed"):
        speculators_ttt_attention.apply()
