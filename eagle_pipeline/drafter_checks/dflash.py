"""Stage 05's checks of a DFlash drafter folder (train.family: dflash) where they differ from EAGLE-3's: `shapes`
against speculators' own DFlashDraftModel, and `vllm_logits`, vLLM's DFlashQwen3ForCausalLM against the checkpoint.

vllm_logits: both sides on one held-out conversation stage 02 captured, blocks anchored at a few answer tokens.
- speculators: the block replay's forward (eagle_pipeline/predict/blocks.py), a block of k + 1 tokens, float32.
- vLLM: the class vLLM resolves for the folder, built and loaded as in the vllm_load check but in float32, run the way
  its DFlashProposer runs it, per anchor p: `combine_hidden_states` over the rows < p,
  `precompute_and_store_context_kv` into a KV cache of a few blocks, one forward of [x_p, mask x k] at positions
  p..p+k with its attention backend's own metadata (causal as vLLM reads the folder), the logits processor. Its
  embedding is the target's, as the proposer shares it; its mask token and attention mode are vLLM's reading.
What vLLM reads otherwise than training is named whatever the logits say: the aux layers it taps (a layer-id offset;
the states fed here are the trained ones, so the logits cannot show it), its mask token, causal attention in the
block (vLLM 0.32 serves a speculators folder so unless sliding_window_non_causal is true, vLLM PR #56692).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle_pipeline.drafter.layouts import WEIGHTS_NAME
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


def vllm_side(target_dir: str, drafter_dir: str, engine_kwargs: dict[str, Any] | None,
              drafter_settings: dict[str, Any] | None, inputs_path: str, out_path: str) -> dict[str, Any]:
    """vLLM's class on the inputs `speculators_side` wrote, its logits written to `out_path`, and how it read the
    folder; {"error": ...} when vLLM's side fails, {"skipped": ...} off the CPU (the vllm_load check's subprocess)."""
    try:
        return _vllm_side(target_dir, drafter_dir, engine_kwargs, drafter_settings, inputs_path, out_path)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


def _vllm_side(target_dir, drafter_dir, engine_kwargs, drafter_settings, inputs_path, out_path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.platforms import current_platform
    from vllm.v1.attention.backend import CommonAttentionMetadata

    from eagle_pipeline.verifier import target_embedding

    if not current_platform.is_cpu():
        return {"skipped": f"vLLM's platform here is {current_platform.device_name}, not the CPU"}
    vllm_config = vllm_load.build_vllm_config(target_dir, drafter_dir, {**(engine_kwargs or {}), "dtype": "float32"},
                                              drafter_settings)
    spec = vllm_config.speculative_config
    draft = vllm_load.drafter_build_config(vllm_config)
    causal = not draft.attention_config.use_non_causal
    inputs = load_file(str(inputs_path))
    tokens, aux, k = inputs["token_ids"], inputs["aux"], int(inputs["k"])
    out = []
    with set_current_vllm_config(draft):
        model = vllm_load.build_drafter(draft)
        model.load_weights(vllm_load.drafter_tensors(drafter_dir))
        process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
        embedding = target_embedding(target_dir)
        with torch.no_grad():
            model.model.embed_tokens.weight[: embedding.shape[0]].copy_(embedding)  # the proposer shares the target's
        layers = {name: layer for name, layer in draft.compilation_config.static_forward_context.items()
                  if hasattr(layer, "get_kv_cache_spec")}
        builders = {}
        for name, layer in layers.items():
            kv = layer.get_kv_cache_spec(draft)
            blocks = -(-(tokens.shape[0] + k + 1) // kv.block_size)
            # CPU_ATTN's cache (cpu_attn.py): [blocks, kv heads, block, 2 x head], the keys' rows then the values'.
            layer.bind_kv_cache(torch.zeros(blocks, kv.num_kv_heads, kv.block_size, 2 * kv.head_size, dtype=kv.dtype))
            backend = layer.get_attn_backend()
            builders[name] = backend.get_builder_cls()(kv, [name], draft, torch.device("cpu"))
        mask = model.model.mask_token_id
        with torch.no_grad():
            for p in inputs["anchors"].tolist():
                model.precompute_and_store_context_kv(model.combine_hidden_states(aux[:p]), torch.arange(p),
                                                      torch.arange(p))
                positions = torch.arange(p, p + k + 1)
                query = torch.tensor([0, k + 1], dtype=torch.int32)
                seq = torch.tensor([p + k + 1], dtype=torch.int32)
                common = CommonAttentionMetadata(
                    query_start_loc=query, query_start_loc_cpu=query, seq_lens=seq, num_reqs=1,
                    num_actual_tokens=k + 1, max_query_len=k + 1, max_seq_len=p + k + 1,
                    block_table_tensor=torch.arange(blocks, dtype=torch.int32)[None], slot_mapping=positions,
                    seq_lens_cpu_upper_bound=seq, causal=causal)
                metadata = {name: builder.build(0, common) for name, builder in builders.items()}
                with set_forward_context(metadata, draft, slot_mapping={name: positions for name in layers}):
                    hidden = model(torch.tensor([int(tokens[p])] + [mask] * k), positions)
                out.append(model.logits_processor(model.lm_head, hidden)[1:])
    save_file({"blocks": torch.stack(out).contiguous()}, str(out_path))
    return {"model_class": type(model).__name__, "attention_backend": backend.get_name(), "causal": causal,
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
    layer_types = trained["transformer_layer_config"].get("layer_types") or []
    trained_causal = bool(layer_types) and all(t != "full_attention" for t in layer_types) and not trained.get(
        "sliding_window_non_causal")
    if "causal" in vllm and vllm["causal"] != trained_causal:
        problems.append(f"vLLM attends {'causally' if vllm['causal'] else 'bidirectionally'} inside the block, the "
                        f"drafter was trained {'causally' if trained_causal else 'bidirectionally'} (vLLM serves a "
                        f"speculators folder causally unless sliding_window_non_causal is true)")
    return problems


def compare(expected: dict[str, Any], vllm: dict[str, Any], got_path: str | Path,
            trained: dict[str, Any]) -> dict[str, Any]:
    """The check's result: vllm_logits.compare over the drafted slots, and every reading of the folder that differs
    from training named."""
    result = vllm_logits.compare(expected, vllm, got_path, parts=PARTS)
    result["detail"]["problems"] += readings(vllm, trained)
    result["ok"] = not result["detail"]["problems"]
    return result
