"""The `vllm_logits` check: vLLM's own drafter class, given the flat folder's weights, computes the logits that
the speculators checkpoint computes, on the same inputs (docs/formats.md, "What vLLM computes").

Two sides, the same first `ROWS` rows of one held-out conversation: the replay's drafter (`SpeculatorsDrafter`,
eagle_pipeline/predict) in float32, and the class vLLM's config resolves for the folder, built and loaded as in the
vllm_load check but in float32, run outside an engine the way vLLM's model runner runs it (`AttentionCache`). The
embeddings come from the speculators side (the target's, which vLLM shares with the drafter).
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

from eagle_pipeline.drafter_checks import vllm_load
from eagle_pipeline.vllm_config import require_written_for

# Float32 on both sides: implementations of the same formula agree to about 1e-6 of the largest logit; a RoPE
# rotated over the other pairs or a softmax scale without YaRN's mscale moves logits by about 1e-3 of it.
TOLERANCE = 1e-4
ROWS = 48


def speculators_side(model, conversation, inputs_path: Path) -> dict[str, Any]:
    """Run the checkpoint (loaded by `predict.speculators_drafter.load_drafter`) on the conversation's first rows;
    write the vLLM side's inputs to `inputs_path` and return the logits to hold vLLM's against:
    {"context": [n, V], "step": [1, V]}."""
    import torch
    from safetensors.torch import save_file

    from eagle_pipeline.predict.speculators_drafter import SpeculatorsDrafter
    from eagle_pipeline.predict.variants import serving_inputs

    token_ids, hidden_states, _ = conversation
    aux = serving_inputs(torch.as_tensor(hidden_states))[: ROWS + 1]
    token_ids = torch.as_tensor(token_ids, dtype=torch.long)[: aux.shape[0]]
    n = aux.shape[0] - 1
    drafter = SpeculatorsDrafter(model)
    rows = torch.arange(n)
    with torch.no_grad():
        input_ids, context_aux = token_ids[1:], aux[:-1]
        drafts, hidden = drafter.draft_step(input_ids, context_aux, rows)
        context_logits = drafter.step_logits
        drafter.draft_step(drafts, hidden, rows + 1)
        step_logits = drafter.step_logits[-1:]
        save_file({"positions": rows.contiguous(),
                   "embeds": model.embed_tokens(input_ids).float().contiguous(),
                   "aux": context_aux.flatten(1).float().contiguous(),
                   "step_embed": model.embed_tokens(drafts[-1:]).float().contiguous()}, str(inputs_path))
    return {"context": context_logits.float(), "step": step_logits.float()}


def vllm_side(side, target_dir: str, drafter_dir: str, engine_kwargs: dict[str, Any] | None,
              drafter_settings: dict[str, Any] | None, inputs_path: str, out_path: str) -> dict[str, Any]:
    """vLLM's class on the inputs `speculators_side` wrote, run by `side` (`eagle3_side`, or `dflash.vllm_blocks`
    on `dflash.speculators_side`'s), its logits written to `out_path`; {"error": ...} when vLLM's side fails,
    {"skipped": ...} off the CPU. In this process: the vllm_load check's subprocess runs it (drafter_checks/cli.py)."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return {"skipped": f"vLLM's platform here is {current_platform.device_name}, not the CPU"}
        return side(target_dir, drafter_dir, engine_kwargs or {}, drafter_settings, inputs_path, out_path)
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}"}


@contextmanager
def float32_drafter(target_dir, drafter_dir, engine_kwargs: dict[str, Any], drafter_settings):
    """vLLM's class for the folder built and loaded as in the vllm_load check but in float32, under its build
    config: (the speculative config, that build config, the model)."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    vllm_config = vllm_load.build_vllm_config(target_dir, drafter_dir, {**engine_kwargs, "dtype": "float32"},
                                              drafter_settings)
    spec = vllm_config.speculative_config
    draft_config = vllm_load.drafter_build_config(vllm_config)
    with set_current_vllm_config(draft_config):
        model = vllm_load.build_drafter(draft_config)
        model.load_weights(vllm_load.drafter_tensors(drafter_dir))
        process_weights_after_loading(model, spec.draft_model_config, torch.device("cpu"))
        yield spec, draft_config, model


def eagle3_side(target_dir, drafter_dir, engine_kwargs, drafter_settings, inputs_path, out_path) -> dict[str, Any]:
    import torch
    from safetensors.torch import load_file, save_file

    require_written_for()
    engine_kwargs = dict(engine_kwargs)
    compilation = dict(engine_kwargs.pop("compilation_config", None) or {})
    # vLLM's own switch to its native rotary formula: the CPU build's kernel rotates a strided multi-head query
    # (an MLA layer's q_pe slice) otherwise than the formula, which vLLM's GPU kernels compute.
    compilation["custom_ops"] = [*compilation.get("custom_ops", []), "-rotary_embedding"]
    inputs = load_file(str(inputs_path))
    n = inputs["positions"].shape[0]
    with float32_drafter(target_dir, drafter_dir, {**engine_kwargs, "compilation_config": compilation},
                         drafter_settings) as (_, draft_config, model):
        cache = AttentionCache(draft_config, rows=n + 1)
        with torch.no_grad():
            with cache.forward_context(query_len=n, seq_len=n):
                hidden = model.combine_hidden_states(inputs["aux"])
                out, prenorm = model(None, inputs["positions"], hidden, inputs["embeds"])
                context = model.logits_processor(model.lm_head, out)
            with cache.forward_context(query_len=1, seq_len=n + 1):
                out, _ = model(None, torch.tensor([n]), prenorm[-1:], inputs["step_embed"])
                step = model.logits_processor(model.lm_head, out)
    save_file({"context": context.contiguous(), "step": step.contiguous()}, str(out_path))
    return {"model_class": type(model).__name__, "attention_backend": cache.backend_name, "rows": n}


class AttentionCache:
    """A KV cache of a few blocks for every attention layer of the drafter, and the metadata vLLM's model runner
    would build for one request over it, from each layer's own backend (`causal` as that metadata's)."""

    def __init__(self, vllm_config, rows: int, causal: bool = True):
        import torch

        self.vllm_config, self.causal = vllm_config, causal
        context = vllm_config.compilation_config.static_forward_context
        self.layers = {name: layer for name, layer in context.items() if hasattr(layer, "get_kv_cache_spec")}
        self.builders = {}
        for name, layer in self.layers.items():
            spec = layer.get_kv_cache_spec(vllm_config)
            self.num_blocks = -(-rows // spec.block_size)
            # [blocks, kv heads, block, key + value]: the layout the CPU backends bind (cpu_attn.py, the keys' rows
            # then the values'; MLA: one head, one latent, no value)
            layer.bind_kv_cache(torch.zeros(self.num_blocks, spec.num_kv_heads, spec.block_size,
                                            spec.head_size + spec.head_size_v, dtype=spec.dtype))
            backend = layer.get_attn_backend()
            self.backend_name = backend.get_name()
            self.builders[name] = backend.get_builder_cls()(spec, [name], vllm_config, torch.device("cpu"))

    def forward_context(self, *, query_len: int, seq_len: int):
        """One request whose last `query_len` of `seq_len` tokens are computed now (prefill: all of them)."""
        import torch
        from vllm.forward_context import set_forward_context
        from vllm.v1.attention.backend import CommonAttentionMetadata

        query_start = torch.tensor([0, query_len], dtype=torch.int32)
        seq_lens = torch.tensor([seq_len], dtype=torch.int32)
        slots = torch.arange(seq_len - query_len, seq_len, dtype=torch.int64)
        common = CommonAttentionMetadata(
            query_start_loc=query_start, query_start_loc_cpu=query_start, seq_lens=seq_lens, num_reqs=1,
            num_actual_tokens=query_len, max_query_len=query_len, max_seq_len=seq_len,
            block_table_tensor=torch.arange(self.num_blocks, dtype=torch.int32)[None], slot_mapping=slots,
            seq_lens_cpu_upper_bound=seq_lens, causal=self.causal)
        metadata = {name: builder.build(0, common) for name, builder in self.builders.items()}
        return set_forward_context(metadata, self.vllm_config, slot_mapping={name: slots for name in self.layers})


PARTS = (("context", "the context pass (draft position 0, every row)"),
         ("step", "the next draft step (the last row, from the KV cache)"))


def compare(expected: dict[str, Any], vllm: dict[str, Any], got_path: str | Path,
            tolerance: float = TOLERANCE, parts: tuple[tuple[str, str], ...] = PARTS) -> dict[str, Any]:
    """The check's result: the largest logit difference of each pass against `tolerance` x the largest logit;
    `vllm` is what `vllm_side` returned."""
    from safetensors.torch import load_file

    got = load_file(str(got_path))
    detail: dict[str, Any] = {**vllm, "tolerance": tolerance, "problems": []}
    for part, what in parts:
        a, b = expected[part], got[part]
        if a.shape != b.shape:
            detail["problems"].append(f"{what}: vLLM's logits have shape {tuple(b.shape)}, speculators' "
                                      f"{tuple(a.shape)}")
            continue
        scale = float(a.abs().max())
        difference = float((a - b).abs().max())
        relative = difference / max(scale, 1e-12)
        agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
        detail[part] = {"max_abs_difference": difference, "relative_difference": relative,
                        "largest_logit": scale, "same_top_token_share": agree}
        if relative > tolerance:
            detail["problems"].append(
                f"{what}: vLLM's {vllm.get('model_class')} differs from the checkpoint by "
                f"{difference:.3g} ({relative:.2g} of the largest logit, tolerance {tolerance:g}); vLLM computes "
                f"this drafter differently from training (docs/formats.md, \"What vLLM computes\")")
    return {"ok": not detail["problems"], "detail": detail}
