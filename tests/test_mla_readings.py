"""The diagnosis's readings of an MLA drafter (vLLM's Eagle3DeepseekV2ForCausalLM): RoPE over interleaved pairs or
halves, the softmax scale with or without YaRN's mscale**2, beside the readings every drafter has (layer ids,
norm flags). Cheap: a small random MLA drafter in memory, conversations made of its own drafts, no engine.

A drafter trained under one reading and "served" under the other (the replay under that reading stands in for
the engine) is diagnosed with that reading's name; a Llama-shaped drafter's readings are unchanged.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_mla_drafter import HIDDEN, YARN, draft_model, layer_config
from test_training import VOCAB

from eagle_pipeline.predict import diagnose as dx
from eagle_pipeline.predict.acceptance import simulate_variants
from eagle_pipeline.predict.speculators_drafter import SpeculatorsDrafter, checkpoint_flags, mla_attention
from eagle_pipeline.predict.variants import Variant, standard_variants

LAYER_IDS, NUM_LAYERS, K = (1, 2, 3), 4, 3
# Kimi-K2's YaRN factor and mscale_all_dim: a softmax factor of 2.0, the difference vLLM's scale makes.
KIMI_ROPE = {**YARN, "factor": 64.0, "mscale_all_dim": 1.0}


def mla_drafter(rope: dict, rope_interleave: bool = True):
    """speculators' Eagle3DraftModel with the MLA layer (patches/speculators_mla.py), seeded random weights."""
    return draft_model(norm_before_residual=False, rope=rope, rope_interleave=rope_interleave)


def own_conversations(model, count: int = 4, length: int = 40, prompt: int = 8) -> list:
    """Conversations whose answers are the drafter's own first drafts as trained: (ids, states [n, 4, H], P).

    Row t drafts x_{t+2} from x_1..x_{t+1} and the states of rows 0..t (eagle_pipeline.predict.simulate), so
    each answer token is drafted from what precedes it; the states' last slot is the final layer."""
    samples = []
    for seed in range(count):
        generator = torch.Generator().manual_seed(seed)
        states = torch.randn(length, len(LAYER_IDS) + 1, HIDDEN, generator=generator)
        ids = torch.randint(0, VOCAB, (length,), generator=generator)
        drafter = SpeculatorsDrafter(model)
        for i in range(prompt, length):
            drafts, _ = drafter.draft_step(ids[1:i], states[: i - 1, : len(LAYER_IDS)], torch.arange(i - 1))
            ids[i] = drafts[-1]
        samples.append((ids, states, prompt))
    return samples


def judged(model, served_attention: dict) -> dict:
    """The verdict on figures "served" with `served_attention`, against the replay under every reading."""
    attention = mla_attention(model.config.transformer_layer_config)
    readings = dx.readings(LAYER_IDS, NUM_LAYERS, checkpoint_flags(model), has_d2t=False, attention=attention)
    captured = dx.capture_ids(readings, NUM_LAYERS)
    assert captured == list(LAYER_IDS)
    variants = [dx.as_variant(r, captured, NUM_LAYERS) for r in readings]
    variants.append(Variant("served", aux_slots=variants[0].aux_slots, attention={**attention, **served_attention}))
    samples = own_conversations(model)
    predictions = simulate_variants(model, samples, K, variants, d2t=None)
    served = predictions.pop("served")
    return dx.diagnose(served["predicted_per_position_acceptance"], served["num_drafts"], predictions,
                       {r.name: r.text for r in readings}, "as_trained")


def test_an_mla_drafters_readings_add_rope_interleave_and_softmax_scale_and_a_llama_drafters_do_not():
    flags = {"norm_before_residual": False, "norm_before_fc": False, "fc_norm": False, "norm_output": False}
    llama = [r.name for r in dx.readings(LAYER_IDS, NUM_LAYERS, flags, has_d2t=True)]
    assert not [n for n in llama if n.startswith(("rope_", "softmax_"))]
    assert mla_attention({"model_type": "llama", "rope_interleave": False}) == {}
    assert [v.name for v in standard_variants(4, flags)] == [v.name for v in standard_variants(4, flags, {})]

    # vLLM's default reading of a DeepSeek layer: interleaved; the softmax factor only where YaRN has one.
    assert mla_attention(layer_config(rope=KIMI_ROPE)) == {"rope_interleave": True, "softmax_mscale": True}
    assert mla_attention({"model_type": "deepseek_v3", "rope_parameters": {"rope_type": "default"}}) == {
        "rope_interleave": True}
    assert mla_attention({"model_type": "deepseek_v3", "rope_interleave": False,
                          "rope_scaling": {"type": "yarn", "factor": 64.0}}) == {"rope_interleave": False,
                                                                                 "softmax_mscale": False}
    mla = {r.name: r for r in dx.readings(LAYER_IDS, NUM_LAYERS, flags, has_d2t=False,
                                          attention={"rope_interleave": False, "softmax_mscale": True})}
    assert mla["rope_interleave_flipped"].attention == {"rope_interleave": True, "softmax_mscale": True}
    assert "is_neox_style False" in mla["rope_interleave_flipped"].text
    assert mla["softmax_mscale_flipped"].attention == {"rope_interleave": False, "softmax_mscale": False}
    # The other readings keep the drafter's attention as trained.
    assert mla["ids_plus_one"].attention == mla["as_trained"].attention == {"rope_interleave": False,
                                                                            "softmax_mscale": True}


def test_the_drafter_computes_each_reading_and_restores_the_trained_one():
    model = mla_drafter(KIMI_ROPE)
    attention = model.layers[0].self_attn
    trained = attention.scaling
    assert trained == pytest.approx(attention.qk_head_dim ** -0.5 * (0.1 * math.log(64) + 1) ** 2)
    ids, states, _ = own_conversations(model, count=1)[0]

    def first_logits(**reading):
        drafter = SpeculatorsDrafter(model, attention=reading)
        drafter.draft_step(ids[1:], states[:-1, :3], torch.arange(len(ids) - 1))
        return drafter._context_logits

    as_trained = first_logits()
    for reading in ({"rope_interleave": False}, {"softmax_mscale": False}):
        assert (first_logits(**reading) - as_trained).abs().max() > 1e-2, reading
        assert attention.scaling == trained and attention.config.rope_interleave is True
    assert torch.equal(first_logits(), as_trained)
    with pytest.raises(ValueError, match="attention readings"):
        SpeculatorsDrafter(mla_drafter({"rope_type": "default", "rope_theta": 10000.0}),
                           attention={"softmax_mscale": False})


@pytest.mark.parametrize("trained, served, cause", [
    # Trained over halves, served by vLLM's DeepSeek layers over interleaved pairs.
    ({"rope_interleave": False}, {"rope_interleave": True}, "rope_interleave_flipped"),
    # Trained with YaRN's softmax factor, served by an engine without it.
    ({}, {"softmax_mscale": False}, "softmax_mscale_flipped"),
], ids=["rope_interleave", "softmax_mscale"])
def test_a_drafter_served_under_the_other_reading_is_diagnosed_with_its_name(trained, served, cause):
    model = mla_drafter(KIMI_ROPE, **trained)
    result = judged(model, served)
    assert result["status"] == "config" and result["cause"] == cause and result["reproduced"], result["line"]
    assert result["predicted"][0] == 1.0 and result["served"][0] < 1.0 - result["tolerance"][0]
    assert result["cause_text"] in result["line"]
    # Served as trained, the same drafter agrees.
    assert judged(model, {})["status"] == "agrees"
