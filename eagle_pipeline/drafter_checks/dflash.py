"""Stage 05's checks of a DFlash drafter folder (train.family: dflash) where they differ from EAGLE-3's: `shapes`
against speculators' own DFlashDraftModel, and `vllm_logits`, vLLM's DFlashQwen3ForCausalLM against the checkpoint.

vllm_logits: both sides on one held-out conversation stage 02 captured, blocks anchored at a few answer tokens.
- speculators: the block replay's forward (eagle_pipeline/predict/blocks.py), a block of k + 1 tokens, float32.
- vLLM: the class vLLM resolves for the folder, built and loaded as in the vllm_load check but in float32, run the way
  its DFlashProposer runs it, per anchor p: `combine_hidden_states` over the rows < p,
  `precompute_and_store_context_kv` into a KV cache of a few blocks, one forward of [x_p, mask x k] at positions
  p..p+k with its attention backend's own metadata (causal as vLLM reads the folder), the logits processor. Its
  embedding is the target's, as the proposer shares it; its mask token and attention mode are vLLM's reading.
What vLLM reads otherwise than training (`readings`; docs/drafter_families.md, "Traps the pipeline checks") is named
whatever the logits say: the states fed here are the trained ones, so the logits cannot show a layer-id offset.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle_pipeline.drafter.layouts import WEIGHTS_NAME, dflash_trained_causal
from eagle_pipeline.drafter.tensors import compare_with_reference, dflash_tensor_problems, read_tensor_specs
from eagle_pipeline.drafter_checks import vllm_load, vllm_logits
from eagle_pipeline.vocab_map import safetensors_vocab_map_problems

ANCHORS = 8
PARTS = (("blocks", "the drafted slots of every block"),)


def check_shapes(drafter_dir: str | Path, reference_dir: str | Path | None = None) -> dict[str, Any]:
    """Every tensor against speculators' DFlashDraftModel built from the folder's config (on the meta device), none
    missing but the verifier's, the d2t/t2d map, and tensor by tensor against a reference drafter's weights."""
    from speculators.models.dflash import DFlashSpeculatorConfig

    config = DFlashSpeculatorConfig.from_pretrained(str(drafter_dir))
    specs = read_tensor_specs(drafter_dir)
    problems = dflash_tensor_problems(config, specs)
    if not problems and "d2t" in specs:
        weights = Path(drafter_dir) / WEIGHTS_NAME
        problems += safetensors_vocab_map_problems(weights, weights, config.transformer_layer_config.vocab_size,
                                                   config.draft_vocab_size)
    if reference_dir is not None:
        problems += [f"vs reference: {p}" for p in compare_with_reference(specs, read_tensor_specs(reference_dir))]
    return {"ok": not problems, "detail": {"format": "dflash", "num_tensors": len(specs), "problems": problems,
                                           "tensors": {n: {"shape": list(s.shape), "dtype": s.dtype}
                                                       for n, s in sorted(specs.items())}}}


def speculators_side(model, conversation, num_speculative_tokens: int, inputs_path: Path) -> dict[str, Any]:
    """The checkpoint's logits (`predict.blocks.block_logits`) for up to ANCHORS blocks spread over the answer; the
    vLLM side's inputs written to `inputs_path`: {"blocks": [anchors, k, V]}."""
    import torch
    from safetensors.torch import save_file

    from eagle_pipeline.predict.blocks import block_logits

    token_ids, hidden_states, prompt_len = conversation
    k = num_speculative_tokens
    answer = list(range(int(prompt_len), len(token_ids) - k))
    anchors = answer[:: max(1, len(answer) // ANCHORS)][:ANCHORS]
    aux = torch.as_tensor(hidden_states)[:, :-1].float()
    logits = block_logits(model, token_ids, aux, anchors, k)
    save_file({"token_ids": torch.as_tensor(token_ids, dtype=torch.long).contiguous(),
               "aux": aux.flatten(1).contiguous(), "anchors": torch.tensor(anchors), "k": torch.tensor([k])},
              str(inputs_path))
    return {"blocks": logits}


def vllm_blocks(target_dir, drafter_dir, engine_kwargs, drafter_settings, inputs_path, out_path) -> dict[str, Any]:
    """`vllm_logits.vllm_side` for a DFlash folder: vLLM's class on the inputs `speculators_side` wrote, its logits
    written to `out_path`, and how it read the folder."""
    import torch
    from safetensors.torch import load_file, save_file

    from eagle_pipeline.verifier import target_embedding

    inputs = load_file(str(inputs_path))
    tokens, aux, k = inputs["token_ids"], inputs["aux"], int(inputs["k"])
    out = []
    with vllm_logits.float32_drafter(target_dir, drafter_dir, engine_kwargs, drafter_settings) as (spec, draft, model):
        causal = not draft.attention_config.use_non_causal
        embedding = target_embedding(target_dir)
        with torch.no_grad():
            model.model.embed_tokens.weight[: embedding.shape[0]].copy_(embedding)  # the proposer shares the target's
        cache = vllm_logits.AttentionCache(draft, rows=tokens.shape[0] + k + 1, causal=causal)
        mask = model.model.mask_token_id
        with torch.no_grad():
            for p in inputs["anchors"].tolist():
                model.precompute_and_store_context_kv(model.combine_hidden_states(aux[:p]), torch.arange(p),
                                                      torch.arange(p))
                with cache.forward_context(query_len=k + 1, seq_len=p + k + 1):
                    hidden = model(torch.tensor([int(tokens[p])] + [mask] * k), torch.arange(p, p + k + 1))
                out.append(model.logits_processor(model.lm_head, hidden)[1:])
    save_file({"blocks": torch.stack(out).contiguous()}, str(out_path))
    return {"model_class": type(model).__name__, "attention_backend": cache.backend_name, "causal": causal,
            "mask_token_id": mask, "aux_layer_ids": vllm_load.vllm_aux_layer_ids(spec)}


def readings(vllm: dict[str, Any], trained: dict[str, Any]) -> list[str]:
    """What vLLM read of the folder otherwise than the checkpoint (`trained`: its config) was trained with."""
    problems = []
    ids = list(trained["aux_hidden_state_layer_ids"])
    for runner, taps in (vllm.get("aux_layer_ids") or {}).items():
        if taps and list(taps) != ids:
            shift = {tap - i for tap, i in zip(taps, ids)} if len(taps) == len(ids) else set()
            offset = f": a layer-id offset of {shift.pop():+d}" if len(shift) == 1 else ""
            problems.append(f"vLLM's {runner} taps the target's layers {list(taps)}, the drafter was trained on "
                            f"{ids}{offset} (docs/layer_ids.md)")
    if vllm.get("mask_token_id") != trained.get("mask_token_id"):
        problems.append(f"vLLM fills the block with mask token {vllm.get('mask_token_id')}, the drafter was trained "
                        f"with {trained.get('mask_token_id')}: a wrong mask token (dflash_config.mask_token_id)")
    causal = dflash_trained_causal(trained)
    if "causal" in vllm and causal != vllm["causal"]:
        how = {True: "causally", False: "bidirectionally", None: "causally in its sliding-window layers only"}[causal]
        problems.append(f"vLLM attends {'causally' if vllm['causal'] else 'bidirectionally'} inside the block, the "
                        f"drafter was trained {how} (vLLM serves a speculators folder causally, every layer alike, "
                        f"unless sliding_window_non_causal is true)")
    return problems


def compare(expected: dict[str, Any], vllm: dict[str, Any], got_path: str | Path,
            trained: dict[str, Any]) -> dict[str, Any]:
    """The check's result: vllm_logits.compare over the drafted slots, and every reading of the folder that differs
    from training named."""
    result = vllm_logits.compare(expected, vllm, got_path, parts=PARTS)
    result["detail"]["problems"] += readings(vllm, trained)
    result["ok"] = not result["detail"]["problems"]
    return result
