"""Hidden-state capture, vLLM (stage 02's path) against HF transformers: same samples, same layers, and
the matmul ceiling measured between them."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.flops import matmul_flops_per_s, peak_of, summarize_matmul
from bench.stats import interleaved_order, is_available, paired_ratios, spread


class HFHiddenStates:
    """The HF transformers way to get a verifier's hidden states: a forward pass with output_hidden_states.

    Returns what HiddenStateCapture returns, [seq, n_aux + 1, H] per sequence: hidden_states[k] for each aux
    id k, and in the last slot the final decoder layer's output *before* the final norm (vLLM's id L; HF's
    hidden_states[L] is after the norm), taken with a forward hook. One sequence per forward pass, so no
    padding is computed; logits only for the last position, as vLLM's prefill computes them.
    """

    def __init__(self, verifier_dir: str | os.PathLike, layer_ids: Sequence[int], dtype: str,
                 trust_remote_code: bool = False):
        import torch
        from transformers import AutoModelForCausalLM

        torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(str(verifier_dir), dtype=torch_dtype,
                                                          trust_remote_code=trust_remote_code).eval()
        self.layer_ids = list(layer_ids)
        self._final: Any = None
        self.model.get_decoder().layers[-1].register_forward_hook(self._keep_final)

    def _keep_final(self, module, args, output) -> None:
        self._final = output[0] if isinstance(output, tuple) else output

    def capture(self, batch: Sequence[Sequence[int]]) -> list[dict[str, Any]]:
        import torch

        samples = []
        with torch.inference_mode():
            for ids in batch:
                tokens = torch.tensor([list(ids)], dtype=torch.long)
                out = self.model(input_ids=tokens, output_hidden_states=True, use_cache=False, logits_to_keep=1)
                slots = [out.hidden_states[k][0] for k in self.layer_ids] + [self._final[0]]
                samples.append({"hidden_states": torch.stack(slots, dim=1), "token_ids": tokens[0]})
        return samples


def relative_error(actual, reference) -> float:
    """Mean over tokens of |actual - reference| / |reference|, norms over the hidden dimension."""
    actual, reference = actual.float(), reference.float()
    return float(((actual - reference).norm(dim=-1) / reference.norm(dim=-1)).mean())


def time_capture(capture: Callable[[Sequence[Sequence[int]]], list], sequences: Sequence[Sequence[int]],
                 batch_size: int) -> float:
    """Seconds to capture every sequence, `batch_size` sequences per call."""
    started = time.perf_counter()
    for start in range(0, len(sequences), batch_size):
        capture(sequences[start:start + batch_size])
    return time.perf_counter() - started


def hidden_state_capture(verifier_dir: str | os.PathLike, layer_ids: Sequence[int], *, num_layers: int,
                         engine_kwargs: dict[str, Any], storage_path: str | os.PathLike):
    """Stage 02's engine from `eagle_pipeline.engine.llm_kwargs` (the config's vLLM arguments)."""
    from eagle_pipeline.capture import HiddenStateCapture

    extra = {k: v for k, v in engine_kwargs.items() if k != "model"}
    named = {name: extra.pop(name) for name in ("dtype", "max_model_len", "tensor_parallel_size", "trust_remote_code")
             if name in extra}
    return HiddenStateCapture(verifier_dir, layer_ids, num_layers=num_layers, extra_engine_args=extra,
                              storage_path=storage_path, **named)


def capture_ab(verifier_dir: str | os.PathLike, layer_ids: Sequence[int], sequences: Sequence[Sequence[int]], *,
               num_layers: int, engine_kwargs: dict[str, Any], batch_size: int, repetitions: int,
               storage_path: str | os.PathLike, matmul_size: int, matmul_seconds: float,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Capture tokens/s of vLLM (HiddenStateCapture, `engine_kwargs` being vLLM's arguments for the verifier:
    `llm_kwargs` of the run config) and of HF transformers, and the machine's matmul throughput (the ceiling)
    between them in every repetition, in rotating order; first an untimed warm-up pass of each side, which also
    checks that the two return the same states. What is timed: BENCHMARKS.md section 1."""
    import torch

    dtype = engine_kwargs["dtype"]
    threads = torch.get_num_threads()
    started = time.perf_counter()
    engine = hidden_state_capture(verifier_dir, layer_ids, num_layers=num_layers, engine_kwargs=engine_kwargs,
                                  storage_path=storage_path)
    with engine:
        vllm_load_s = time.perf_counter() - started
        # Starting vLLM may change this process's torch thread count; HF must run on every core it had.
        torch.set_num_threads(threads)
        started = time.perf_counter()
        hf = HFHiddenStates(verifier_dir, layer_ids, dtype, engine_kwargs.get("trust_remote_code", False))
        hf_load_s = time.perf_counter() - started
        log(f"capture A/B: vLLM engine up in {vllm_load_s:.1f} s, HF model in {hf_load_s:.1f} s; warm-up")

        sides = {"vllm": engine.capture, "hf": hf.capture}
        # The warm-up batch is also the check that both sides return the same layers.
        warm_up = sequences[:batch_size]
        agreement = _agreement(engine.capture(warm_up[:1])[0], hf.capture(warm_up[:1])[0])
        for capture in sides.values():
            capture(warm_up)

        seconds: dict[str, list[float]] = {name: [] for name in sides}
        matmul: list[dict[str, dict[str, float | str]]] = []
        for rep in range(repetitions):
            for name in interleaved_order([*sides, "matmul"], rep):
                if name == "matmul":
                    matmul.append(matmul_flops_per_s(matmul_size, matmul_seconds))
                else:
                    seconds[name].append(time_capture(sides[name], sequences, batch_size))
            peaks = {d: peak_of(k) for d, k in matmul[-1].items()}
            log(f"capture A/B repetition {rep + 1}/{repetitions}: "
                + ", ".join(f"{name} {seconds[name][-1]:.2f} s" for name in sides) + "; matmul GFLOP/s "
                + ", ".join(f"{d} {p / 1e9:.0f}" if is_available(p) else f"{d} n/a" for d, p in peaks.items()))
    num_tokens = sum(len(s) for s in sequences)
    rates = {name: [num_tokens / s for s in values] for name, values in seconds.items()}
    return {
        "samples": len(sequences),
        "tokens": num_tokens,
        "repetitions": repetitions,
        "vllm_batch_size": batch_size,
        "hf_sequences_per_forward": 1,
        "threads": threads,
        "dtype": dtype,
        "layer_ids": list(layer_ids),
        "load_s": {"vllm": vllm_load_s, "hf": hf_load_s},
        "seconds": {name: spread(v) for name, v in seconds.items()},
        "tokens_per_s": {name: spread(v) for name, v in rates.items()},
        "ratio_vllm_over_hf": spread(paired_ratios(rates["vllm"], rates["hf"])),
        "agreement": agreement,
        "matmul": summarize_matmul(matmul, matmul_size, threads),
    }


def _agreement(vllm_sample: dict, hf_sample: dict) -> dict[str, Any]:
    """Per-slot relative error of vLLM's states against HF's for one sequence: both capture the same layers."""
    a, b = vllm_sample["hidden_states"], hf_sample["hidden_states"]
    if a.shape != b.shape:
        return {"same_shape": False, "vllm_shape": list(a.shape), "hf_shape": list(b.shape)}
    errors = [relative_error(a[:, k], b[:, k]) for k in range(a.shape[1])]
    return {"same_shape": True, "relative_error_per_slot": errors, "max_relative_error": max(errors)}
