"""A speculators EAGLE-3 drafter run the way vLLM serves it, behind the simulator's `Drafter` protocol.

The weights and modules are speculators' own (`Eagle3DraftModel`, loaded from the checkpoint folder stage 04
writes); only the order of calls is vLLM's: `fc` once over the target's aux states on the context pass, then
draft steps fed the drafter's own previous hidden output and the embedding of its own previous draft
(vllm/model_executor/models/llama_eagle3.py:124-151 and 261-288; vllm/v1/spec_decode/llm_base_proposer.py
689-768). The layer math is speculators' (`Eagle3FirstLayerMixin.forward`), which equals vLLM's
`LlamaDecoderLayer.forward` in llama_eagle3.py (norm the embedding with `input_layernorm`, the hidden part
with `hidden_norm`, residual from the normed hidden only with `norm_before_residual`); an MLA drafter's layer
(patches/speculators_mla.py) equals `DeepseekV2Eagle3DecoderLayer.forward` in deepseek_eagle3.py the same way,
and its attention keeps the compressed latent (normed kv latent and rotated rope key) in the same DynamicCache,
as vLLM's MLA caches it, expanding it to every head's keys and values at each step. Rows sit at vLLM's
positions (row p at p, draft step j at p + j); speculators' training puts row p at p + 1 (its
`shift_batch`), which rotary embeddings cannot tell apart, as only relative positions enter attention.

Knobs that reproduce engine-side mistakes without touching the checkpoint:
- `d2t`: the map the engine applies to draft ids (`target = draft + d2t[draft]`, llama_eagle3.py:385-394);
  None is what vLLM does when the folder has none: its zero-initialised map, the identity (340-343).
- `norm_flags`: override `norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output` as an engine
  would read them from a config. A norm the checkpoint has no weight for gets unit weight, which is what
  vLLM's `RMSNorm` starts with when nothing loads into it.
- `attention` (MLA drafters only): `rope_interleave`, RoPE over interleaved pairs (what vLLM's DeepSeek layers
  always rotate, `is_neox_style=False`, deepseek_v2.py) or over halves; `softmax_mscale`, the softmax scale
  with or without YaRN's mscale**2 factor (deepseek_v2.py's `yarn_get_mscale(factor, mscale_all_dim) ** 2`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

import torch

from eagle_pipeline.drafter.layouts import NORM_FLAGS, SPECULATORS_MLA_LAYER_TYPES


def load_drafter(drafter_dir: str | os.PathLike, *, load_verifier: bool = True,
                 dtype: torch.dtype = torch.float32):
    """speculators' `Eagle3DraftModel` from a stage-04 checkpoint folder, in eval mode on the CPU.

    Attention runs through SDPA with dense masks (the training default, flex attention, needs its block
    masks). `load_verifier` fills what the checkpoint leaves to the verifier: `embed_tokens` when absent,
    `verifier_norm` (the target's final norm) and `verifier_lm_head`, read from the verifier folder named
    in the checkpoint's config.
    """
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig

    from patches import speculators_mla

    speculators_mla.apply()  # an MLA drafter's layer class (transformer_layer_config.model_type deepseek_v3)
    config = Eagle3SpeculatorConfig.from_pretrained(str(drafter_dir))
    config.transformer_layer_config._attn_implementation = "sdpa"
    model = Eagle3DraftModel.from_pretrained(str(drafter_dir), config=config)
    if load_verifier:
        model.load_verifier_weights()
    if torch.isnan(model.embed_tokens.weight).any():
        raise ValueError(f"{drafter_dir}: the checkpoint has no embed_tokens; load it with load_verifier=True")
    return model.to(dtype).eval()


def checkpoint_flags(model) -> dict[str, bool]:
    return {flag: bool(getattr(model.config, flag, False)) for flag in NORM_FLAGS}


def mla_attention(layer_config: Any) -> dict[str, bool]:
    """How an MLA drafter's attention was trained, from its transformer_layer_config (a dict or a config):
    {"rope_interleave", "softmax_mscale"}; {} for a Llama-shaped layer. `softmax_mscale` is left out where
    the rope has no YaRN mscale to apply or drop (the two scales are equal)."""
    def read(key: str, default: Any = None) -> Any:
        return layer_config.get(key, default) if isinstance(layer_config, Mapping) else getattr(layer_config, key,
                                                                                                 default)

    if read("model_type") not in SPECULATORS_MLA_LAYER_TYPES:
        return {}
    # transformers' DeepseekV3Config default is interleaved, as vLLM rotates.
    result = {"rope_interleave": bool(read("rope_interleave", True))}
    rope = dict(read("rope_parameters") or read("rope_scaling") or {})
    if yarn_softmax_factor(rope) != 1.0:
        # transformers' yarn_apply_mscale applies it only with mscale_all_dim set, as vLLM does.
        result["softmax_mscale"] = bool(rope.get("mscale_all_dim"))
    return result


def yarn_softmax_factor(rope: Mapping[str, Any]) -> float:
    """The factor YaRN multiplies an MLA layer's softmax scale by: mscale(factor, mscale_all_dim) ** 2, with
    mscale_all_dim 1 where the rope leaves it out (what an engine that applies it regardless uses); 1.0 for
    other ropes or a factor of at most 1."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_get_mscale

    if rope.get("rope_type", rope.get("type")) != "yarn" or not rope.get("factor"):
        return 1.0
    return float(yarn_get_mscale(float(rope["factor"]), float(rope.get("mscale_all_dim") or 1.0)) ** 2)


def map_to_target(draft_ids: torch.Tensor, d2t: torch.Tensor | None) -> torch.Tensor:
    """Draft-vocabulary ids as target ids, as vLLM's `compute_logits` places them (None: identity)."""
    return draft_ids if d2t is None else draft_ids + d2t[draft_ids]


class SpeculatorsDrafter:
    """`Drafter` over a speculators Eagle3DraftModel, with vLLM's serving-time inputs; keeps one KV cache."""

    def __init__(self, model, d2t: Any = "checkpoint", norm_flags: Mapping[str, bool] | None = None,
                 attention: Mapping[str, bool] | None = None):
        unknown = set(norm_flags or {}) - set(NORM_FLAGS)
        if unknown:
            raise ValueError(f"unknown norm flags {sorted(unknown)}; known: {list(NORM_FLAGS)}")
        trained_attention = mla_attention(model.config.transformer_layer_config)
        unknown = set(attention or {}) - set(trained_attention)
        if unknown:
            raise ValueError(f"attention readings {sorted(unknown)} for a drafter that has "
                             f"{sorted(trained_attention) or 'none (a Llama-shaped layer)'}")
        self.model = model
        self.flags = {**checkpoint_flags(model), **(norm_flags or {})}
        self.attention = {**trained_attention, **(attention or {})}
        self._attention_state = self._attention_settings(self.attention) if self.attention else None
        self.d2t = resolve_d2t(model, d2t)
        self.num_aux = model.fc.in_features // model.hidden_size
        self.input_norm = self._norm(self.flags["norm_before_fc"], model.input_norm,
                                     lambda: self._unit_norm(self.num_aux * model.hidden_size))
        self.fc_norm = self._norm(self.flags["fc_norm"], model.fc_norm,
                                  lambda: torch.nn.ModuleList(self._unit_norm(model.hidden_size)
                                                              for _ in range(self.num_aux)))
        self._cache = None
        self._context_len = 0
        self._step = 0
        self._context_logits = None
        self.step_logits = None
        # The target's head over the draft vocabulary, which context_kl scores against; NaN where the model
        # was loaded without its verifier's weights.
        self._verifier_loaded = bool(torch.isfinite(model.verifier_norm.weight).all()
                                     and torch.isfinite(model.verifier_lm_head.weight).all())

    def _attention_settings(self, reading: Mapping[str, bool]) -> list[tuple[Any, float, bool]]:
        """(attention module, softmax scale, rope_interleave) per layer under `reading`."""
        rope = dict(getattr(self.model.config.transformer_layer_config, "rope_parameters", None) or {})
        factor = yarn_softmax_factor(rope)
        settings = []
        for layer in self.model.layers:
            attention = layer.self_attn
            scale = attention.qk_head_dim ** -0.5
            if reading.get("softmax_mscale", False):
                scale *= factor
            settings.append((attention, scale, bool(reading["rope_interleave"])))
        return settings

    def _swap_attention(self, settings):
        """Install `settings` in the shared modules and return what was there (the model is shared by readings)."""
        previous = [(attention, attention.scaling, attention.config.rope_interleave) for attention, _, _ in settings]
        for attention, scale, interleave in settings:
            attention.scaling, attention.config.rope_interleave = scale, interleave
        return previous

    @staticmethod
    def _norm(enabled: bool, trained, unit):
        if not enabled:
            return None
        return trained if trained is not None else unit()

    def _unit_norm(self, size: int):
        weight = self.model.norm.weight
        norm = self.model._model_definitions.norm_class(size,
                                                        eps=self.model.config.transformer_layer_config.rms_norm_eps)
        return norm.to(dtype=weight.dtype, device=weight.device)

    def combine_hidden_states(self, aux_states: torch.Tensor) -> torch.Tensor:
        """[n, n_aux, H] -> [n, D]: vLLM's `combine_hidden_states` (llama_eagle3.py:397-418)."""
        hidden = aux_states.flatten(1).to(self.model.fc.weight.dtype)
        if hidden.shape[-1] != self.model.fc.in_features:
            raise ValueError(f"{aux_states.shape[1]} aux slots of width {aux_states.shape[2]} fed to an fc that "
                             f"takes {self.model.fc.in_features} values ({self.num_aux} slots)")
        if self.input_norm is not None:
            hidden = self.input_norm(hidden)
        if self.fc_norm is not None:
            chunks = hidden.chunk(len(self.fc_norm), dim=-1)
            hidden = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks)], dim=-1)
        return self.model.fc(hidden)

    def _attention_mask(self, n: int) -> torch.Tensor:
        """Row i attends to context rows 0..i and to its own rows of the earlier draft steps (and itself)."""
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        diagonal = torch.eye(n, dtype=torch.bool)
        return torch.cat([causal, *([diagonal] * self._step)], dim=-1)[None, None]

    @torch.no_grad()
    def draft_step(self, input_ids: torch.Tensor, hidden_states: torch.Tensor,
                   positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from transformers import DynamicCache

        model = self.model
        n = input_ids.shape[0]
        if hidden_states.dim() == 3:  # the context pass: the target's states through fc, a fresh KV cache
            self._cache, self._context_len, self._step = DynamicCache(), n, 0
            hidden = self.combine_hidden_states(hidden_states)
        else:
            if self._cache is None or n != self._context_len:
                raise ValueError("a draft step needs the context pass of the same rows first")
            self._step += 1
            hidden = hidden_states
        embeds = model.embed_tokens(input_ids.long())
        hidden = torch.cat([embeds.to(hidden.dtype), hidden], dim=-1)[None]
        position_ids = positions.long()[None]
        position_embeddings = model.rotary_emb(hidden, position_ids)
        cache_position = torch.arange(self._step * n, (self._step + 1) * n)
        mask = self._attention_mask(n)
        first = model.layers[0]
        trained_flag = first.norm_before_residual
        first.norm_before_residual = self.flags["norm_before_residual"]
        trained_attention = self._swap_attention(self._attention_state) if self._attention_state else None
        try:
            for layer in model.layers:
                hidden = layer(hidden, attention_mask=mask, position_ids=position_ids, past_key_values=self._cache,
                               cache_position=cache_position, position_embeddings=position_embeddings)
        finally:
            first.norm_before_residual = trained_flag
            if trained_attention:
                self._swap_attention(trained_attention)
        normed = model.norm(hidden)
        logits = model.lm_head(normed)
        if self.flags["norm_output"]:
            hidden = normed
        self.step_logits = logits[0]  # [n, draft vocabulary], what stage 05 holds vLLM's class against
        if self._step == 0:
            self._context_logits = logits[0]
        draft_ids = map_to_target(logits[0].argmax(dim=-1), self.d2t)
        return draft_ids, hidden[0]

    @torch.no_grad()
    def context_kl(self, final_states: torch.Tensor) -> torch.Tensor | None:
        """KL [n] of the last context pass's row t from the target's distribution at position t + 1.

        `final_states` [n + 1, H]: the target's final layer before its norm for the whole sequence (stage 02's
        last slot). Row t drafts x_{t+2}, which the target predicts from its state at t + 1 (speculators'
        training pairs them the same way). None when the drafter was loaded without its verifier's weights.
        """
        model = self.model
        if self._context_logits is None or final_states.shape[0] != self._context_logits.shape[0] + 1:
            raise ValueError("context_kl needs the context pass over the same sequence first")
        if not self._verifier_loaded:
            return None
        weight = model.verifier_lm_head.weight
        targets = model.verifier_lm_head(model.verifier_norm(final_states[1:].to(weight.dtype)))
        target_log_p = torch.log_softmax(targets.float(), dim=-1)
        draft_log_p = torch.log_softmax(self._context_logits.float(), dim=-1)
        return (target_log_p.exp() * (target_log_p - draft_log_p)).sum(dim=-1)


def resolve_d2t(model, d2t: Any) -> torch.Tensor | None:
    """The engine's d2t: "checkpoint" (the drafter's own buffer), None (identity), or an int array [DV]."""
    if isinstance(d2t, str):
        if d2t != "checkpoint":
            raise ValueError(f"d2t={d2t!r}: pass 'checkpoint', None or an array")
        d2t = model.d2t
        # With the full vocabulary speculators keeps no map (or an all-zero one): identity either way.
        return None if d2t is None else d2t.long()
    if d2t is None:
        return None
    d2t = torch.as_tensor(d2t)
    if d2t.dtype.is_floating_point or d2t.shape != (model.lm_head.out_features,):
        raise ValueError(f"d2t must be an integer array of {model.lm_head.out_features} entries, "
                         f"got {d2t.dtype} {tuple(d2t.shape)}")
    return d2t.long()


@torch.no_grad()
def teacher_forced_drafts(model, token_ids: torch.Tensor, aux_states: torch.Tensor, ttt_steps: int,
                          d2t: Literal["checkpoint"] | torch.Tensor | None = "checkpoint") -> torch.Tensor:
    """Drafts [N-1, ttt_steps] (target ids) from speculators' training forward, teacher-forced.

    Row t, step j: the draft for x_{t+j+2} given the data's tokens x_{t+1..t+j+1}. Step 0 is what the
    engine drafts too; step j > 0 equals the engine's draft wherever the chain's earlier drafts were right.
    """
    token_ids = torch.as_tensor(token_ids, dtype=torch.long)
    n = token_ids.shape[0] - 1
    hidden = aux_states[:-1].flatten(1).to(model.fc.weight.dtype)[None]
    drafts = model(hidden_states=hidden, input_ids=token_ids[1:][None],
                   document_ids=torch.zeros(1, n, dtype=torch.long), ttt_steps=ttt_steps)
    target_d2t = resolve_d2t(model, d2t)
    return torch.stack([map_to_target(step[0], target_d2t) for step in drafts], dim=1)
