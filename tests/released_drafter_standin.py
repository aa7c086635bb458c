"""Stand-ins for a released EAGLE-3 drafter, in the flat layout AQ-MedAI's Kimi-K2.5 drafter and SpecForge's
output have (docs/released_drafters.md): config.json with `architectures: ["LlamaForCausalLMEagle3"]`, aux
ids only in `eagle_config` and in the SGLang convention (id k = output of layer k = HF hidden_states[k+1]),
no norm flags (SpecForge trains with all of them off), and weights `midlayer.*`, `fc`, `norm`, `lm_head`,
`d2t`, `t2d` without `embed_tokens`.

The weights are random (seeded) and the draft vocabulary is a seeded random subset of the target's, so that
a run adopting it visibly gets another vocabulary than the one it would count itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch


@dataclass(frozen=True)
class StandinShape:
    """A target (hidden size, vocabulary, depth) and the drafter layer built for it."""

    hidden_size: int
    vocab_size: int
    num_target_layers: int
    hf_layer_ids: tuple[int, ...]
    draft_vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int

    def but(self, **changes) -> "StandinShape":
        return replace(self, **changes)


# The embedded SmolLM2-135M target and the drafter shape the pipeline derives for it (tests' smoke run:
# draft vocabulary 512, default aux layers (2, 15, 27)).
SMOLLM2 = StandinShape(hidden_size=576, vocab_size=49152, num_target_layers=30, hf_layer_ids=(2, 15, 27),
                       draft_vocab_size=512, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                       intermediate_size=1536, rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)
# The tiny Kimi-K2.5 stand-in (tests/test_kimi_vllm.py: hidden 64, 4 layers, aux layers 1/2/3) with the
# released Kimi drafters' head_dim 128.
KIMI_STANDIN = StandinShape(hidden_size=64, vocab_size=49152, num_target_layers=4, hf_layer_ids=(1, 2, 3),
                            draft_vocab_size=512, num_attention_heads=4, num_key_value_heads=4, head_dim=128,
                            intermediate_size=96, rope_theta=50000.0, rms_norm_eps=1e-6, max_position_embeddings=2048)


def sglang_ids(hf_ids) -> list[int]:
    # Written by hand rather than with eagle_pipeline.layer_ids, so that the code under test is checked
    # against an independent statement of the convention: SGLang's id k is HF hidden_states[k + 1].
    return [k - 1 for k in hf_ids]


def standin_tensors(shape: StandinShape, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def weight(*dims):
        return (torch.randn(*dims, generator=generator) * 0.02).to(torch.bfloat16)

    H, q, kv, ff = shape.hidden_size, shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim, shape.intermediate_size
    token_ids = torch.randperm(shape.vocab_size, generator=generator)[: shape.draft_vocab_size].sort().values
    t2d = torch.zeros(shape.vocab_size, dtype=torch.bool)
    t2d[token_ids] = True
    ones = lambda n: torch.ones(n, dtype=torch.bfloat16)  # noqa: E731
    return {
        "midlayer.self_attn.q_proj.weight": weight(q, 2 * H),
        "midlayer.self_attn.k_proj.weight": weight(kv, 2 * H),
        "midlayer.self_attn.v_proj.weight": weight(kv, 2 * H),
        "midlayer.self_attn.o_proj.weight": weight(H, q),
        "midlayer.mlp.gate_proj.weight": weight(ff, H),
        "midlayer.mlp.up_proj.weight": weight(ff, H),
        "midlayer.mlp.down_proj.weight": weight(H, ff),
        "midlayer.input_layernorm.weight": ones(H),
        "midlayer.hidden_norm.weight": ones(H),
        "midlayer.post_attention_layernorm.weight": ones(H),
        "fc.weight": weight(H, len(shape.hf_layer_ids) * H),
        "norm.weight": ones(H),
        "lm_head.weight": weight(shape.draft_vocab_size, H),
        "d2t": token_ids - torch.arange(shape.draft_vocab_size),
        "t2d": t2d,
    }


def standin_config(shape: StandinShape) -> dict:
    """A SpecForge-style config.json: transformers 4 rope spelling, ids only in eagle_config, no norm flags."""
    return {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": shape.rms_norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": None,
        "num_hidden_layers": 1,
        "vocab_size": shape.vocab_size,
        "draft_vocab_size": shape.draft_vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": sglang_ids(shape.hf_layer_ids), "use_aux_hidden_state": True},
    }


def write_released_standin(folder: Path, shape: StandinShape = SMOLLM2, seed: int = 0, *, tensors: dict | None = None,
                           config: dict | None = None) -> Path:
    """Write the stand-in (or the given tensors / config, for broken variants) into `folder`."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors if tensors is not None else standin_tensors(shape, seed), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config if config is not None else standin_config(shape), indent=2))
    return folder


# -- the MLA drafter of vLLM's Kimi-K2.5 recipe ------------------------------------------------------------------
# `lightseekorg/kimi-k2.5-eagle3-mla` (docs/formats.md, "The MLA drafter folder"): architecture
# Eagle3DeepseekV2ForCausalLM, model_type kimi_k2, one layer of Kimi's own MLA attention and a dense SwiGLU MLP,
# YaRN rope, the full vocabulary (vocab_size = draft_vocab_size, no d2t), aux ids in eagle_config only, which
# vLLM reads as they stand.

@dataclass(frozen=True)
class MlaStandinShape:
    hidden_size: int
    vocab_size: int
    hf_layer_ids: tuple[int, ...]
    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int

    def but(self, **changes) -> "MlaStandinShape":
        return replace(self, **changes)


# The released drafter's config: hidden 7168, intermediate 18432, 64 heads, q_lora_rank 1536, kv_lora_rank 512,
# qk_nope 128, qk_rope 64, v 128, vocabulary 163840, aux ids [1, 29, 57].
KIMI_MLA_RELEASED = MlaStandinShape(
    hidden_size=7168, vocab_size=163840, hf_layer_ids=(1, 29, 57), num_attention_heads=64, q_lora_rank=1536,
    kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, intermediate_size=18432,
    rope_theta=50000.0, rms_norm_eps=1e-6, max_position_embeddings=262144)
# Built for the tiny Kimi-K2.5 stand-in target (tests/test_kimi_vllm.py: hidden 64, 4 layers, q_lora_rank 32, aux
# layers 1/2/3): Kimi's kv_lora_rank 512 + rope 64 kept, the one latent size vLLM's CPU MLA kernel runs.
KIMI_MLA_STANDIN = KIMI_MLA_RELEASED.but(hidden_size=64, vocab_size=49152, hf_layer_ids=(1, 2, 3),
                                         num_attention_heads=4, q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
                                         intermediate_size=96)
# Kimi-K2's YaRN rope, in the transformers 4 spelling the release carries.
KIMI_YARN = {"type": "yarn", "factor": 64.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0,
             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
MLA_NAMINGS = ("midlayer.", "layers.0.")


def mla_standin_tensors(shape: MlaStandinShape = KIMI_MLA_STANDIN, seed: int = 0, *, naming: str = "midlayer.",
                        fused: bool = False, fc_norm: bool = False) -> dict[str, torch.Tensor]:
    """The release's tensors under `naming` (`midlayer.` or `layers.0.`), q_a_proj and kv_a_proj_with_mqa stored
    as one fused_qkv_a_proj (q rows first) when `fused`; fc_norm.<i> with `fc_norm`."""
    generator = torch.Generator().manual_seed(seed)

    def weight(*dims):
        return (torch.randn(*dims, generator=generator) * 0.02).to(torch.bfloat16)

    def norm(n):  # not all ones, so that a norm loaded into the wrong module shows
        return (1 + 0.1 * torch.randn(n, generator=generator)).to(torch.bfloat16)

    H, heads, ff = shape.hidden_size, shape.num_attention_heads, shape.intermediate_size
    qk = shape.qk_nope_head_dim + shape.qk_rope_head_dim
    layer = {
        "self_attn.q_a_proj.weight": weight(shape.q_lora_rank, 2 * H),
        "self_attn.q_a_layernorm.weight": norm(shape.q_lora_rank),
        "self_attn.q_b_proj.weight": weight(heads * qk, shape.q_lora_rank),
        "self_attn.kv_a_proj_with_mqa.weight": weight(shape.kv_lora_rank + shape.qk_rope_head_dim, 2 * H),
        "self_attn.kv_a_layernorm.weight": norm(shape.kv_lora_rank),
        "self_attn.kv_b_proj.weight": weight(heads * (shape.qk_nope_head_dim + shape.v_head_dim), shape.kv_lora_rank),
        "self_attn.o_proj.weight": weight(H, heads * shape.v_head_dim),
        "mlp.gate_proj.weight": weight(ff, H),
        "mlp.up_proj.weight": weight(ff, H),
        "mlp.down_proj.weight": weight(H, ff),
        "input_layernorm.weight": norm(H),
        "hidden_norm.weight": norm(H),
        "post_attention_layernorm.weight": norm(H),
    }
    if fused:
        layer["self_attn.fused_qkv_a_proj.weight"] = torch.cat(
            [layer.pop("self_attn.q_a_proj.weight"), layer.pop("self_attn.kv_a_proj_with_mqa.weight")])
    tensors = {naming + name: tensor for name, tensor in layer.items()} | {
        "fc.weight": weight(H, len(shape.hf_layer_ids) * H),
        "norm.weight": norm(H),
        "lm_head.weight": weight(shape.vocab_size, H),
    }
    if fc_norm:
        tensors |= {f"fc_norm.{i}.weight": norm(H) for i in range(len(shape.hf_layer_ids))}
    return tensors


def mla_standin_config(shape: MlaStandinShape = KIMI_MLA_STANDIN, **flags) -> dict:
    """The release's config.json (the issue's fields); norm flags only where given."""
    return {
        "architectures": ["Eagle3DeepseekV2ForCausalLM"],
        "model_type": "kimi_k2",
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_attention_heads,
        "q_lora_rank": shape.q_lora_rank,
        "kv_lora_rank": shape.kv_lora_rank,
        "qk_nope_head_dim": shape.qk_nope_head_dim,
        "qk_rope_head_dim": shape.qk_rope_head_dim,
        "v_head_dim": shape.v_head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": shape.rms_norm_eps,
        "max_position_embeddings": shape.max_position_embeddings,
        "rope_theta": shape.rope_theta,
        "rope_scaling": dict(KIMI_YARN),
        "vocab_size": shape.vocab_size,
        "draft_vocab_size": shape.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(shape.hf_layer_ids), "use_aux_hidden_state": True},
        **flags,
    }


def write_mla_standin(folder: Path, shape: MlaStandinShape = KIMI_MLA_STANDIN, seed: int = 0, *,
                      naming: str = "midlayer.", fused: bool = False, tensors: dict | None = None,
                      config: dict | None = None) -> Path:
    """Write the MLA stand-in (or the given tensors / config, for broken variants) into `folder`."""
    if tensors is None:
        tensors = mla_standin_tensors(shape, seed, naming=naming, fused=fused,
                                      fc_norm=bool((config or {}).get("fc_norm")))
    config = config if config is not None else mla_standin_config(shape)
    return write_released_standin(folder, tensors=tensors, config=config)


# -- a DFlash release in z-lab's flat layout ------------------------------------------------------------------------
# z-lab/Kimi-K2.5-DFlash's: architecture DFlashDraftModel, the Qwen3 decoder fields at the top level, block_size,
# dflash_config {mask_token_id, target_layer_ids} with z-lab's ids (the output of layer i = HF hidden_states[i + 1]),
# the whole vocabulary (no d2t), weights layers.*, fc, hidden_norm, norm: the embedding and head are the target's.

def write_dflash_release_standin(folder: Path, verifier_dir: Path, hf_layer_ids, *, num_layers: int, block_size: int,
                                 mask_token_id: int, seed: int = 0, extra: dict | None = None) -> Path:
    """A random (seeded) DFlash release of `num_layers` Qwen3 layers for the target in `verifier_dir`; `extra` tensors
    added (a foreign or fused one)."""
    from safetensors.torch import save_file
    from speculators.train.cli import create_transformer_layer_config

    layer = create_transformer_layer_config(verifier_name_or_path=str(verifier_dir), num_layers=num_layers,
                                            draft_arch="qwen3", hidden_act="silu", sliding_window=2048,
                                            full_attention_indices=list(range(num_layers))).to_dict()
    config = {**layer, "architectures": ["DFlashDraftModel"], "block_size": block_size,
              "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": sglang_ids(hf_layer_ids)}}
    H, q, kv = layer["hidden_size"], layer["num_attention_heads"] * layer["head_dim"], \
        layer["num_key_value_heads"] * layer["head_dim"]
    generator = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (H, len(hf_layer_ids) * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(num_layers):
        p, ff, hd = f"layers.{i}.", layer["intermediate_size"], layer["head_dim"]
        shapes |= {p + "self_attn.q_proj.weight": (q, H), p + "self_attn.k_proj.weight": (kv, H),
                   p + "self_attn.v_proj.weight": (kv, H), p + "self_attn.o_proj.weight": (H, q),
                   p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,),
                   p + "mlp.gate_proj.weight": (ff, H), p + "mlp.up_proj.weight": (ff, H),
                   p + "mlp.down_proj.weight": (H, ff), p + "input_layernorm.weight": (H,),
                   p + "post_attention_layernorm.weight": (H,)}
    tensors = {name: (torch.randn(*shape, generator=generator) * 0.02 + (len(shape) == 1)).to(torch.bfloat16)
               for name, shape in shapes.items()}
    folder.mkdir(parents=True, exist_ok=True)
    save_file({**tensors, **(extra or {})}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder
