"""An MLA drafter (train.draft_layer: mla) trained in speculators' own Trainer through patches/speculators_mla.py.

- the layer computes what vLLM's Eagle3DeepseekV2ForCausalLM computes: vLLM's formula (deepseek_eagle3.py,
  deepseek_v2.py, layers/mla.py) written out here around vLLM's own DeepSeek YaRN rotary class, on small dims
  with query/key width 24 and value width 6; the same reference with RoPE not interleaved, or without the
  softmax mscale, differs;
- the TTT block attention of patches/speculators_ttt_attention.py serves value widths other than the key's;
- stage 04's runner trains a few steps of an MLA drafter on a tiny DeepSeek-V3 verifier (Kimi-K2.5's nesting)
  and its checkpoint holds exactly the tensors of the drafter contract; the offline replay drives it;
- the config and draft-shape refusals, and the patch's refusal of another speculators or a changed source.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from test_training import RUN, VOCAB, read_rows, settings, write_training_data, write_vocab_map

from eagle_pipeline.config import load_section
from eagle_pipeline.errors import BadInput
from eagle_pipeline.train import runner
from eagle_pipeline.train.draft_config import build_draft_config, check_draft_shape
from eagle_pipeline.train.settings import TrainRun
from patches import speculators_cpu, speculators_mla, speculators_ttt_attention
from patches.upstream import source_sha256

HIDDEN, HEADS, Q_LORA, KV_LORA, NOPE, ROPE, V_DIM, INTER = 32, 2, 8, 16, 16, 8, 6, 40
# Kimi-K2's YaRN with mscale_all_dim other than mscale, so that both the cos/sin factor (mscale / mscale_all_dim)
# and the softmax factor (mscale_all_dim squared) differ from 1.
YARN = {"rope_type": "yarn", "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 0.5,
        "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0, "rope_theta": 10000.0}


@pytest.mark.parametrize("qualified_name", sorted(speculators_mla.UPSTREAM_SOURCE_SHA256))
def test_upstream_source_is_the_one_the_patch_was_written_for(qualified_name):
    assert source_sha256(qualified_name) == speculators_mla.UPSTREAM_SOURCE_SHA256[qualified_name]


@pytest.mark.parametrize("qualified_name", sorted(speculators_mla.VLLM_SOURCE_SHA256))
def test_vllm_source_is_the_one_the_layer_was_matched_to(qualified_name):
    assert source_sha256(qualified_name) == speculators_mla.VLLM_SOURCE_SHA256[qualified_name]


def test_the_patch_refuses_another_speculators_or_a_changed_source(monkeypatch):
    monkeypatch.setattr(speculators_cpu, "installed_version", lambda: "0.10.0")
    with pytest.raises(RuntimeError, match=r"targets speculators 0\.9\.0 but 0\.10\.0 is installed"):
        speculators_mla.apply()
    monkeypatch.undo()
    name = "transformers.models.deepseek_v3.modeling_deepseek_v3:apply_rotary_pos_emb_interleave"
    monkeypatch.setitem(speculators_mla.UPSTREAM_SOURCE_SHA256, name, "0" * 64)
    with pytest.raises(RuntimeError, match=r"speculators_mla\.py targets speculators 0\.9\.0, but these functions "
                                           r"differ from that release: .*apply_rotary_pos_emb_interleave"):
        speculators_mla.apply()


def layer_config(q_lora_rank: int | None = Q_LORA, rope: dict | None = None):
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=1, first_k_dense_replace=1,
        num_attention_heads=HEADS, num_key_value_heads=HEADS, q_lora_rank=q_lora_rank, kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_parameters=dict(rope or YARN), rope_interleave=True, attention_bias=False,
        tie_word_embeddings=False)


def draft_model(q_lora_rank: int | None = Q_LORA, attn: str | None = "sdpa", norm_before_residual: bool = False,
                rope: dict | None = None, rope_interleave: bool = True):
    """speculators' Eagle3DraftModel with the MLA layer, seeded random weights (norms included)."""
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    speculators_mla.apply()
    layer = layer_config(q_lora_rank, rope)
    layer.rope_interleave = rope_interleave
    layer._attn_implementation = attn
    config = Eagle3SpeculatorConfig(
        transformer_layer_config=layer, draft_vocab_size=VOCAB, norm_before_residual=norm_before_residual,
        eagle_aux_hidden_state_layer_ids=[1, 2, 3],
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path="verifier", architectures=["DeepseekV3ForCausalLM"])))
    torch.manual_seed(0)
    model = Eagle3DraftModel(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.copy_(1 + 0.2 * torch.randn_like(parameter))
            else:
                parameter.copy_(0.3 * torch.randn_like(parameter))
    return model


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def vllm_first_layer(layer, config, embeds, hidden, positions, *, interleaved=True, softmax_mscale=True,
                     norm_before_residual=False):
    """vLLM 0.32's DeepseekV2Eagle3DecoderLayer (layer 0) and DeepseekV2MLAAttention over the same weights, with
    vLLM's own DeepSeek YaRN rotary class; returns the layer's output (residual added, as vLLM's final norm does)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.deepseek_scaling_rope import (
        DeepseekScalingRotaryEmbedding,
        yarn_get_mscale,
    )

    eps, rope = config.rms_norm_eps, config.rope_parameters
    attention, n = layer.self_attn, embeds.shape[0]
    weight = lambda module: module.weight.detach()  # noqa: E731
    # deepseek_eagle3.py:106-131: input_layernorm on the embeddings, hidden_norm on the hidden part.
    normed_hidden = rms(hidden, weight(layer.hidden_norm), eps)
    residual = normed_hidden if norm_before_residual else hidden
    x = torch.cat([rms(embeds, weight(layer.input_layernorm), eps), normed_hidden], dim=-1)
    # layers/mla.py:183-225: q from the query latent (eps rms_norm_eps, deepseek_v2.py:1082), the kv latent.
    if config.q_lora_rank is None:
        q = x @ weight(attention.q_proj).T
    else:
        q = rms(x @ weight(attention.q_a_proj).T, weight(attention.q_a_layernorm), eps) @ weight(attention.q_b_proj).T
    q = q.view(n, HEADS, NOPE + ROPE)
    kv_c, k_pe = (x @ weight(attention.kv_a_proj_with_mqa).T).split([KV_LORA, ROPE], dim=-1)
    kv_c = rms(kv_c, weight(attention.kv_a_layernorm), eps)
    # deepseek_v2.py:1115-1127: get_rope(qk_rope_head_dim, ..., is_neox_style=False), DeepSeek YaRN.
    with set_current_vllm_config(VllmConfig()):
        rotary = DeepseekScalingRotaryEmbedding(
            ROPE, ROPE, rope["original_max_position_embeddings"], rope["rope_theta"], not interleaved, rope["factor"],
            torch.float32, beta_fast=rope["beta_fast"], beta_slow=rope["beta_slow"], mscale=rope["mscale"],
            mscale_all_dim=rope["mscale_all_dim"])
    q_pe, k_pe = rotary.forward_static(positions, q[..., NOPE:].clone(), k_pe[:, None].clone(), ROPE, ROPE,
                                       rotary.cos_sin_cache, not interleaved)
    q = torch.cat([q[..., :NOPE], q_pe], dim=-1)
    k_nope, v = (kv_c @ weight(attention.kv_b_proj).T).view(n, HEADS, NOPE + V_DIM).split([NOPE, V_DIM], dim=-1)
    k = torch.cat([k_nope, k_pe.expand(n, HEADS, ROPE)], dim=-1)
    # deepseek_v2.py:1044 and 1129-1136.
    scale = (NOPE + ROPE) ** -0.5
    if softmax_mscale:
        scale *= yarn_get_mscale(rope["factor"], float(rope["mscale_all_dim"])) ** 2
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, HEADS * V_DIM) @ weight(attention.o_proj).T
    # deepseek_eagle3.py:143-148 and 251: fused add-norm, SiLU-gated MLP (deepseek_v2.py:278-287), final residual.
    hidden = residual + attn
    post = rms(hidden, weight(layer.post_attention_layernorm), eps)
    mlp = layer.mlp
    return hidden + (torch.nn.functional.silu(post @ weight(mlp.gate_proj).T) * (post @ weight(mlp.up_proj).T)) \
        @ weight(mlp.down_proj).T


def speculators_first_layer(model, embeds, hidden, positions):
    n = embeds.shape[0]
    x = torch.cat([embeds, hidden], dim=-1)[None]
    position_ids = positions[None]
    with torch.no_grad():
        return model.layers[0](x, attention_mask=torch.ones(n, n, dtype=torch.bool).tril()[None, None],
                               position_ids=position_ids, position_embeddings=model.rotary_emb(x, position_ids))[0]


@pytest.mark.parametrize("q_lora_rank, norm_before_residual", [(Q_LORA, False), (None, True)])
def test_the_layer_computes_what_vllm_computes_and_a_wrong_rope_or_scale_would_not(q_lora_rank, norm_before_residual):
    model = draft_model(q_lora_rank, norm_before_residual=norm_before_residual)
    layer, config = model.layers[0], model.config.transformer_layer_config
    generator = torch.Generator().manual_seed(1)
    n = 12
    embeds, hidden = torch.randn(n, HIDDEN, generator=generator), torch.randn(n, HIDDEN, generator=generator)
    # Positions past original_max_position_embeddings, where YaRN interpolates.
    positions = torch.arange(n) + 90

    ours = speculators_first_layer(model, embeds, hidden, positions)
    reference = lambda **variant: vllm_first_layer(layer, config, embeds, hidden, positions,  # noqa: E731
                                                   norm_before_residual=norm_before_residual, **variant)
    tolerance = 1e-4 * reference().abs().max().item()
    assert (ours - reference()).abs().max().item() < tolerance
    # The check can fail: RoPE over rotate-half pairs, or the softmax without YaRN's mscale, give other outputs.
    assert (ours - reference(interleaved=False)).abs().max().item() > 100 * tolerance
    assert (ours - reference(softmax_mscale=False)).abs().max().item() > 100 * tolerance


def test_the_rotary_embedding_is_the_qk_rope_width_and_the_attention_scale_has_yarns_mscale():
    model = draft_model()
    attention = model.layers[0].self_attn
    assert model.rotary_emb.inv_freq.shape == (ROPE // 2,)
    mscale = 0.1 * YARN["mscale_all_dim"] * math.log(YARN["factor"]) + 1
    assert attention.scaling == pytest.approx((NOPE + ROPE) ** -0.5 * mscale ** 2)
    assert model.rotary_emb.attention_scaling == pytest.approx(
        (0.1 * math.log(YARN["factor"]) + 1) / (0.1 * 0.5 * math.log(YARN["factor"]) + 1))
    # The two latent norms take the config's eps, as vLLM builds them.
    assert attention.q_a_layernorm.variance_epsilon == attention.kv_a_layernorm.variance_epsilon == 1e-5


def test_an_mla_drafter_gets_dense_masks_and_block_attention_on_every_device(monkeypatch):
    model = draft_model(attn="simple_flex_attention")
    assert model._attn_impl == "sdpa"  # flex attention is not used for MLA layers
    speculators_ttt_attention.apply()
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    assert speculators_ttt_attention.uses_block_attention(model)


@pytest.mark.parametrize("steps", [1, 3])
def test_block_attention_serves_a_value_width_other_than_the_keys(steps):
    from test_ttt_attention import attention_module, packed_document_ids, ttt_mask
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    torch.manual_seed(steps)
    document_ids = packed_document_ids()
    length = document_ids.shape[0]
    mask = ttt_mask(document_ids, steps)
    inputs = [torch.randn(1, HEADS, length, NOPE + ROPE), torch.randn(1, HEADS, steps * length, NOPE + ROPE),
              torch.randn(1, HEADS, steps * length, V_DIM)]
    upstream, blocks = [x.clone().requires_grad_() for x in inputs], [x.clone().requires_grad_() for x in inputs]
    module = attention_module(1)
    expected, _ = sdpa_attention_forward(module, *upstream, mask, scaling=0.3)
    got, _ = speculators_ttt_attention.block_attention(module, *blocks, mask, scaling=0.3)
    assert got.shape == expected.shape == (1, length, HEADS, V_DIM)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(expected)
    (expected * grad).sum().backward()
    (got * grad).sum().backward()
    for a, b in zip(upstream, blocks):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5)


def make_mla_verifier(folder, q_lora_rank: int | None = 24):
    """A tiny DeepSeek-V3 (MLA + MoE, YaRN) text model inside a Kimi-K2.5 config, weights under Kimi's names."""
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    text = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
        topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=KV_LORA,
        qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V_DIM, max_position_embeddings=512,
        rope_parameters={**YARN, "mscale_all_dim": 1.0}, tie_word_embeddings=False,
    )
    model = DeepseekV3ForCausalLM(text).eval()
    folder.mkdir(parents=True)
    save_file({f"language_model.{name}": t.contiguous() for name, t in model.state_dict().items()},
              str(folder / "model.safetensors"))
    config = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
              "text_config": {**text.to_dict(), "model_type": "kimi_k2", "architectures": ["DeepseekV3ForCausalLM"]},
              "vision_config": {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                "intermediate_size": 64}}
    (folder / "config.json").write_text(json.dumps(config))
    return model


MLA_TRAIN = dict(draft_layer="mla", norm_before_residual=False, fc_norm=False, norm_output=False)


def contract_tensors(hidden: int, heads: int, q_lora_rank: int | None, draft_vocab: int, inter: int) -> dict:
    """The drafter contract's tensors of a speculators MLA checkpoint (briefs' mla_contract: names and shapes)."""
    attention = {
        "kv_a_proj_with_mqa": (KV_LORA + ROPE, 2 * hidden), "kv_a_layernorm": (KV_LORA,),
        "kv_b_proj": (heads * (NOPE + V_DIM), KV_LORA), "o_proj": (hidden, heads * V_DIM),
    }
    if q_lora_rank is None:
        attention["q_proj"] = (heads * (NOPE + ROPE), 2 * hidden)
    else:
        attention.update(q_a_proj=(q_lora_rank, 2 * hidden), q_a_layernorm=(q_lora_rank,),
                         q_b_proj=(heads * (NOPE + ROPE), q_lora_rank))
    tensors = {f"layers.0.self_attn.{name}.weight": shape for name, shape in attention.items()}
    tensors.update({f"layers.0.{name}.weight": (hidden,)
                    for name in ("hidden_norm", "input_layernorm", "post_attention_layernorm")})
    tensors.update({"layers.0.mlp.gate_proj.weight": (inter, hidden), "layers.0.mlp.up_proj.weight": (inter, hidden),
                    "layers.0.mlp.down_proj.weight": (hidden, inter)})
    tensors.update({"fc.weight": (hidden, 3 * hidden), "norm.weight": (hidden,), "lm_head.weight": (draft_vocab, hidden),
                    "d2t": (draft_vocab,), "t2d": (VOCAB,), "embed_tokens.weight": (VOCAB, hidden)})
    return tensors


@pytest.fixture(scope="module")
def mla_trained(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("mla")
    model = make_mla_verifier(root / "kimi")
    write_training_data(model, model.model.norm, root / "data", [48] * 12, seed=3)
    d2t, t2d = write_vocab_map(root, np.arange(0, VOCAB, 4))
    out = root / "04_train"
    train = settings(**MLA_TRAIN, draft_shape={"num_attention_heads": 2, "intermediate_size": 48}, epochs=1,
                     total_seq_len=128, val_ratio=0.25, predict_conversations=2)
    run = TrainRun(data_dir=root / "data", d2t_path=d2t, t2d_path=t2d, verifier_dir=root / "kimi", out_dir=out, **RUN)
    summary = runner.train_drafter(train, run)
    return {"root": root, "out": out, "summary": summary, "train": train, "run": run}


def test_stage_04_trains_an_mla_drafter_whose_checkpoint_has_the_contracts_tensors(mla_trained):
    from safetensors.torch import load_file

    out, summary = mla_trained["out"], mla_trained["summary"]
    train_rows = [r for r in read_rows(out) if r["split"] == "train"]
    assert len(train_rows) >= 3 and all(np.isfinite(float(r["loss"])) for r in train_rows)
    assert "sdpa" in summary["this_run"]["argv"]
    checkpoint = out / summary["last"]["checkpoint"]
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["norm_before_fc"] is False
    # Every field the contract names is in the file as written (readers take it as a plain dict).
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "deepseek_v3"
    assert (layer["num_hidden_layers"], layer["first_k_dense_replace"], layer["num_attention_heads"]) == (1, 1, 2)
    assert ([layer[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                                "intermediate_size", "rope_interleave")] == [24, KV_LORA, NOPE, ROPE, V_DIM, 48, True])
    assert {k: layer["rope_parameters"][k] for k in ("rope_type", "factor", "mscale", "mscale_all_dim",
                                                     "original_max_position_embeddings", "rope_theta")} \
        == {"rope_type": "yarn", "factor": 8.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 64, "rope_theta": 10000.0}
    tensors = load_file(str(checkpoint / "model.safetensors"))
    assert {name: tuple(t.shape) for name, t in tensors.items()} == contract_tensors(64, 2, 24, VOCAB // 4, 48)


def test_the_offline_replay_drives_an_mla_checkpoint_through_its_latent_cache(mla_trained):
    from eagle_pipeline.predict.speculators_drafter import SpeculatorsDrafter, load_drafter, teacher_forced_drafts

    checkpoint = mla_trained["out"] / mla_trained["summary"]["last"]["checkpoint"]
    model = load_drafter(checkpoint)
    generator = torch.Generator().manual_seed(5)
    n = 20
    tokens = torch.randint(0, VOCAB, (n + 1,), generator=generator)
    aux = torch.randn(n + 1, 3, 64, generator=generator)
    drafter = SpeculatorsDrafter(model)
    first, hidden = drafter.draft_step(tokens[1:], aux[:-1], torch.arange(n))
    second, _ = drafter.draft_step(first, hidden, torch.arange(n) + 1)
    # The cache holds the compressed latent (kv_lora_rank) and the rope key, one head, for both passes.
    keys, values = drafter._cache.layers[0].keys, drafter._cache.layers[0].values
    assert keys.shape == (1, 1, 2 * n, KV_LORA) and values.shape == (1, 1, 2 * n, ROPE)
    # The engine's first draft of each row is the teacher-forced one (rotations see relative positions only).
    forced = teacher_forced_drafts(model, tokens, aux, ttt_steps=2)
    assert torch.equal(forced[:, 0], first)
    assert second.shape == (n,)


def test_a_checkpoint_written_where_vllm_renamed_deepseek_v3_to_kimi_k2_loads_back(mla_trained, tmp_path,
                                                                                    monkeypatch):
    """vLLM sets `DeepseekV3Config.model_type = "kimi_k2"` in a process that has read a Kimi config
    (vllm/transformers_utils/config.py, _register_config_class): stage 05's read-back of its flat folder and the
    replay are written there. Such a checkpoint must load as the MLA drafter it is."""
    from transformers import DeepseekV3Config

    from eagle_pipeline.predict.speculators_drafter import load_drafter, mla_attention

    checkpoint = mla_trained["out"] / mla_trained["summary"]["last"]["checkpoint"]
    monkeypatch.setattr(DeepseekV3Config, "model_type", "kimi_k2")  # what vLLM does to the class
    model = load_drafter(checkpoint)
    model.save_pretrained(tmp_path / "renamed")
    written = json.loads((tmp_path / "renamed" / "config.json").read_text())["transformer_layer_config"]
    assert written["model_type"] == "kimi_k2"
    monkeypatch.undo()
    reloaded = load_drafter(tmp_path / "renamed")
    assert mla_attention(reloaded.config.transformer_layer_config) == mla_attention(model.config.transformer_layer_config)
    assert type(reloaded.layers[0]) is type(model.layers[0])


def test_mla_config_and_shape_refusals(tmp_path):
    with pytest.raises(BadInput, match=r"train\.norm_before_fc: draft_layer mla has no norm before fc"):
        load_section("train", {"draft_layer": "mla", "norm_before_fc": True}, source="t")
    assert load_section("train", {"draft_layer": "mla"}, source="t").norm_before_fc is False
    # vLLM cannot serve an MLA speculators checkpoint, which convert.parity: vllm would ask of it.
    from conftest import TINY_CONFIG

    from eagle_pipeline.config import load_config
    with pytest.raises(BadInput, match=r"convert\.parity: vllm serves the speculators checkpoint, which vLLM reads "
                                       r"for Llama and Qwen3 layers only"):
        load_config(TINY_CONFIG, ["train.draft_layer=mla", "convert.parity=vllm"])
    assert load_config(TINY_CONFIG, ["train.draft_layer=mla"]).convert.parity == "replay"

    from transformers import LlamaConfig

    llama = LlamaConfig(hidden_size=64, num_attention_heads=4, vocab_size=VOCAB)
    with pytest.raises(BadInput, match=r"^train\.draft_layer: mla needs a verifier with MLA attention .*'llama'"):
        check_draft_shape(settings(**MLA_TRAIN), llama)
    text = layer_config()
    with pytest.raises(BadInput, match=r"^train\.draft_shape: head_dim, num_key_value_heads do not apply to "
                                       r"draft_layer mla"):
        check_draft_shape(settings(**MLA_TRAIN, draft_shape={"head_dim": 64, "num_key_value_heads": 2}), text)
    with pytest.raises(BadInput, match=r"^train\.draft_shape\.num_hidden_layers: 2, but an MLA drafter has one"):
        check_draft_shape(settings(**MLA_TRAIN, draft_shape={"num_hidden_layers": 2}), text)
    explicit = layer_config(rope={**YARN, "attention_factor": 1.0})
    with pytest.raises(BadInput, match=r"^train\.draft_layer: mla, but the verifier's rope has an explicit "
                                       r"attention_factor"):
        check_draft_shape(settings(**MLA_TRAIN), explicit)
    # A raw text config (the dry run reads config.json as it stands): YaRN under rope_scaling, theta beside it.
    # mscale without mscale_all_dim: transformers scales cos/sin by yarn_get_mscale(factor), vLLM by its mscale.
    raw = {**text.to_dict(), "rope_scaling": {**YARN, "type": "yarn", "mscale": 0.7, "mscale_all_dim": 0},
           "rope_theta": 1e4}
    raw.pop("rope_parameters")
    with pytest.raises(BadInput, match=r"mscale 0\.7 with mscale_all_dim 0: cos/sin scale"):
        check_draft_shape(settings(**MLA_TRAIN), raw)

    # Kimi-K2's own rope (mscale = mscale_all_dim) agrees; the draft config keeps it and the verifier's MLA dims.
    kimi = layer_config(rope={**YARN, "mscale_all_dim": 1.0})
    run = TrainRun(data_dir=tmp_path, d2t_path=tmp_path, t2d_path=tmp_path, verifier_dir=tmp_path, out_dir=tmp_path,
                   **RUN)
    draft = build_draft_config(settings(**MLA_TRAIN, draft_shape={"intermediate_size": 48}), run, kimi)
    assert (draft["model_type"], draft["num_hidden_layers"], draft["first_k_dense_replace"]) == ("deepseek_v3", 1, 1)
    assert (draft["q_lora_rank"], draft["kv_lora_rank"], draft["v_head_dim"], draft["intermediate_size"]) \
        == (Q_LORA, KV_LORA, V_DIM, 48)
    assert draft["rope_parameters"]["mscale_all_dim"] == 1.0 and draft["rope_interleave"] is True


def test_the_plan_has_the_dims_and_parameters_of_the_mla_drafter_stage_04_writes(mla_trained):
    from types import SimpleNamespace

    from safetensors import safe_open

    from eagle_pipeline.drafter.planned import drafter_params, planned_draft_dims
    from eagle_pipeline.drafter.tensors import draft_dims

    checkpoint = mla_trained["out"] / mla_trained["summary"]["last"]["checkpoint"]
    text = json.loads((mla_trained["root"] / "kimi" / "config.json").read_text())["text_config"]
    verifier = SimpleNamespace(text_config=lambda: text, hidden_size=64, vocab_size=VOCAB)
    cfg = SimpleNamespace(train=mla_trained["train"], vocab=SimpleNamespace(draft_vocab_size=VOCAB // 4))
    planned = planned_draft_dims(cfg, verifier, 3)
    assert planned == draft_dims(json.loads((checkpoint / "config.json").read_text()))
    with safe_open(str(checkpoint / "model.safetensors"), "pt") as f:
        saved = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys() if name not in ("d2t", "t2d"))
    assert drafter_params(planned) == saved



@pytest.mark.parametrize("q_lora_rank", [Q_LORA, None])
def test_the_plans_count_every_tensor_and_attention_activation_of_a_built_mla_drafter(q_lora_rank, monkeypatch):
    """The disk and memory plans' counts against speculators' own Eagle3DraftModel with the MLA layer: parameters
    tensor by tensor, and the attention's activations per token as its forward makes them (its modules' outputs and
    the tensors it hands to the attention function)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from eagle_pipeline.drafter.planned import drafter_params, layer_params
    from eagle_pipeline.drafter.tensors import draft_dims
    from eagle_pipeline.online.memory import DrafterShape, attention_activations

    model = draft_model(q_lora_rank)
    dims = draft_dims(model.config.to_dict())
    numel = {name: p.numel() for name, p in model.named_parameters()}
    verifier_head = numel.pop("verifier_lm_head.weight")
    numel.pop("verifier_norm.weight")  # the target's, neither saved nor trained
    assert drafter_params(dims) == sum(numel.values())  # every tensor the checkpoint saves
    layer = sum(p.numel() for p in model.layers[0].parameters())
    shape = DrafterShape.from_dims(dims)
    assert layer_params(dims) == shape.layer_params == layer
    assert shape.root_params == sum(numel.values()) - layer + verifier_head
    assert shape.trainable_params + shape.frozen_params == sum(numel.values()) + verifier_head
    # What speculators' optimizer steps: not the embedding, nor either lm_head (speculators/model.py freezes them).
    assert shape.trainable_params == sum(p.numel() for name, p in model.named_parameters()
                                         if p.requires_grad and name != "verifier_norm.weight")

    n = 5
    elements = []
    attention = model.layers[0].self_attn
    for name, module in attention.named_children():
        if name != "o_proj":
            module.register_forward_hook(lambda module, args, out: elements.append(out.numel()))
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def counted(module, query, key, value, *args, **kwargs):
        out = sdpa(module, query, key, value, *args, **kwargs)
        elements.extend([query.numel(), key.numel(), out[0].numel()])  # value: a view of kv_b_proj's output
        return out

    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS, "sdpa", counted)
    speculators_first_layer(model, torch.randn(n, HIDDEN), torch.randn(n, HIDDEN), torch.arange(n))
    assert attention_activations(dims) * n == sum(elements), elements


def test_an_mla_init_from_of_another_shape_or_rope_is_refused_naming_what_differs(tmp_path):
    """check_init_from compares a speculators MLA drafter to fine-tune with the MLA layer this run builds: its MLA
    dimensions, and the rope vLLM rotates it by (YaRN's factor and mscales, interleaved pairs)."""
    from eagle_pipeline.train.draft_config import build_mla_draft_config, check_init_from

    model = draft_model()
    model.save_pretrained(tmp_path / "init")
    text = {**layer_config().to_dict(), "num_hidden_layers": 4}
    train = settings(**MLA_TRAIN, init_from=str(tmp_path / "init"))
    d2t, t2d = write_vocab_map(tmp_path, np.arange(0, VOCAB, 4))
    run = TrainRun(data_dir=tmp_path, d2t_path=d2t, t2d_path=t2d, verifier_dir=tmp_path, out_dir=tmp_path / "out",
                   **RUN)
    # Its shape is this run's: the check goes on to the vocabulary (this full-vocabulary drafter has no d2t).
    with pytest.raises(BadInput, match=r"has no d2t/t2d"):
        check_init_from(train, run, build_mla_draft_config(train, text))
    for changed, named in [({"kv_lora_rank": 2 * KV_LORA}, f"kv_lora_rank {KV_LORA} vs {2 * KV_LORA}"),
                           ({"v_head_dim": V_DIM + 2}, f"v_head_dim {V_DIM} vs {V_DIM + 2}"),
                           ({"rope_parameters": {**YARN, "factor": 4.0}},
                            "yarn {.*'factor': 8.0.*} vs {.*'factor': 4.0"),
                           ({"rope_interleave": False}, "rope_interleave True vs False")]:
        ours = {**build_mla_draft_config(train, text), **changed}
        with pytest.raises(BadInput, match=r"another drafter shape than this run .*" + named):
            check_init_from(train, run, ours)
