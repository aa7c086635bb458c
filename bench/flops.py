"""Compute ceilings: forward FLOPs per token of a decoder-only verifier, the machine's matmul throughput,
and the tokens/s the one allows at the other.

A CPU may lack a kernel for a dtype (oneDNN on an AVX2-only CPU has no bf16 matmul); that kernel's figure,
and every figure built on it, is then "n/a (<reason>)" instead of a number.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from bench.stats import is_available, not_available, reason_of, spread

DTYPES = ("float32", "bfloat16")
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16"}


def decoder_matmul_params(text_config: dict[str, Any]) -> int:
    """Weights every token multiplies through in the decoder layers (attention and MLP projections).

    Embeddings are a lookup, norms are negligible, and the lm_head is counted separately: a prefill-only
    capture computes logits for the last position alone.
    """
    hidden = int(text_config["hidden_size"])
    heads = int(text_config["num_attention_heads"])
    kv_heads = int(text_config.get("num_key_value_heads") or heads)
    head_dim = int(text_config.get("head_dim") or hidden // heads)
    inter = int(text_config["intermediate_size"])
    layers = int(text_config["num_hidden_layers"])
    attention = hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    mlp = 3 * hidden * inter  # gate, up, down
    return layers * (attention + mlp)


def lm_head_params(text_config: dict[str, Any]) -> int:
    return int(text_config["vocab_size"]) * int(text_config["hidden_size"])


def attention_flops(text_config: dict[str, Any], context: float) -> float:
    """Score and value products for one token attending to `context` positions, over all layers."""
    heads = int(text_config["num_attention_heads"])
    head_dim = int(text_config.get("head_dim") or int(text_config["hidden_size"]) // heads)
    return 4.0 * int(text_config["num_hidden_layers"]) * heads * head_dim * context


def prefill_flops_per_token(text_config: dict[str, Any], seq_lens: Sequence[int]) -> float:
    """Mean forward FLOPs per token of a prefill over whole sequences (what hidden-state capture does):
    2 x decoder weights plus causal attention, where the token at position i sees i + 1 positions."""
    tokens = sum(seq_lens)
    if not tokens:
        raise ValueError("no tokens")
    mean_context = sum(n * (n + 1) / 2 for n in seq_lens) / tokens
    return 2.0 * decoder_matmul_params(text_config) + attention_flops(text_config, mean_context)


def generation_flops_per_output_token(text_config: dict[str, Any], prompt_tokens: int, completion_tokens: int,
                                      samples: int) -> float:
    """All forward FLOPs of generating the answers (prompt prefill included) per output token.

    Each output token costs the decoder, the lm_head and attention over the prompt plus the answer so far;
    each prompt token costs the decoder and its attention once.
    """
    if not completion_tokens or not samples:
        raise ValueError("no generated tokens")
    prompt_mean = prompt_tokens / samples
    answer_mean = completion_tokens / samples
    decoder = 2.0 * decoder_matmul_params(text_config)
    prompt = prompt_tokens * (decoder + attention_flops(text_config, (prompt_mean + 1) / 2))
    answer = completion_tokens * (decoder + 2.0 * lm_head_params(text_config)
                                  + attention_flops(text_config, prompt_mean + (answer_mean + 1) / 2))
    return (prompt + answer) / completion_tokens


def matmul_kernels() -> dict[str, Callable[[Any, Any], Callable[[], Any]]]:
    """Kernel name -> a function of (a, b) returning a step that computes a @ b with that kernel:
    torch.matmul (MKL or OpenBLAS for float32 on the CPU) and, where this vLLM build has it, the oneDNN GEMM
    that vLLM's CPU linear layers use."""
    import torch

    kernels = {"torch": lambda a, b: partial(torch.matmul, a, b,
                                             out=torch.empty(a.shape[0], b.shape[1], dtype=a.dtype))}
    try:
        from vllm import _custom_ops as ops
    except Exception:  # noqa: BLE001 - no vLLM, or a build without CPU kernels
        return kernels
    if getattr(ops, "_supports_onednn", False):
        kernels["onednn"] = lambda a, b: partial(ops.onednn_mm, ops.create_onednn_mm(b, 32), a, None)
    return kernels


def _first_step(make_step: Callable, a, b, dtype: str) -> Callable[[], Any] | str:
    """The kernel's step after one call (kernel selection, page faults), or n/a when this CPU has no such
    kernel: oneDNN raises "could not create a primitive descriptor" there rather than falling back."""
    try:
        step = make_step(a, b)
        step()
    except RuntimeError as error:
        message = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
        return not_available(f"no {SHORT_NAMES.get(dtype, dtype)} matmul kernel on this CPU: {message}")
    return step


def _flops_per_s(step: Callable[[], Any], size: int, min_seconds: float) -> float:
    count, started = 0, time.perf_counter()
    while True:
        step()
        count += 1
        elapsed = time.perf_counter() - started
        if elapsed >= min_seconds:
            return 2.0 * size**3 * count / elapsed


def matmul_flops_per_s(size: int, min_seconds: float, dtypes: Sequence[str] = DTYPES) -> dict[str, dict[str, float | str]]:
    """FLOP/s of a size x size by size x size product, per dtype and kernel (n/a where the CPU has no such
    kernel). The kernels differ by 2x for float32 on some CPUs, so the ceiling is the faster of them."""
    import torch

    kernels = matmul_kernels()
    generator = torch.Generator().manual_seed(0)
    rates: dict[str, dict[str, float | str]] = {}
    for dtype in dtypes:
        torch_dtype = getattr(torch, dtype)
        a = torch.randn(size, size, generator=generator).to(torch_dtype)
        b = torch.randn(size, size, generator=generator).to(torch_dtype)
        rates[dtype] = {}
        for name, make_step in kernels.items():
            step = _first_step(make_step, a, b, dtype)
            rates[dtype][name] = _flops_per_s(step, size, min_seconds) if callable(step) else step
    return rates


def unavailable_matmul_kernels(dtype: str) -> dict[str, str]:
    """Kernel name -> n/a reason, for each kernel this CPU cannot run a `dtype` matmul with (a 16x16 try)."""
    import torch

    a = torch.ones(16, 16, dtype=getattr(torch, dtype))
    steps = {name: _first_step(make_step, a, a, dtype) for name, make_step in matmul_kernels().items()}
    return {name: step for name, step in steps.items() if isinstance(step, str)}


def peak_of(rates: dict[str, float | str]) -> float | str:
    """The faster kernel's FLOP/s; n/a, with every kernel's reason, when none could run."""
    measured = [v for v in rates.values() if is_available(v)]
    if measured:
        return max(measured)
    reasons = {name: reason_of(v) for name, v in rates.items()}
    if len(set(reasons.values())) == 1:
        return next(iter(rates.values()))
    return not_available("; ".join(f"{name}: {reason}" for name, reason in reasons.items()))


def _spread_or_reason(values: Sequence[float | str]) -> dict[str, Any] | str:
    missing = [v for v in values if not is_available(v)]
    return missing[0] if missing else spread(values)


def summarize_matmul(samples: Sequence[dict[str, dict[str, float | str]]], size: int, threads: int) -> dict[str, Any]:
    """Per dtype: each kernel's FLOP/s and the peak (the faster kernel of each repetition), as spreads, or
    n/a where the CPU lacks the kernel (every kernel, for the peak)."""
    out: dict[str, Any] = {"size": size, "repetitions": len(samples), "threads": threads, "flops_per_s": {}, "kernels": {}}
    for dtype in samples[0]:
        out["flops_per_s"][dtype] = _spread_or_reason([peak_of(rep[dtype]) for rep in samples])
        out["kernels"][dtype] = {k: _spread_or_reason([rep[dtype][k] for rep in samples]) for k in samples[0][dtype]}
    return out


def ceiling_tokens_per_s(peak: dict[str, Any], flops_per_token: float) -> dict[str, float | str]:
    """Per dtype, the tokens/s the median matmul peak allows at flops_per_token."""
    return {d: f["median"] / flops_per_token if is_available(f) else f for d, f in peak["flops_per_s"].items()}


def share_of_ceiling(measured: float | None, ceilings: dict[str, float | str]) -> dict[str, float | str | None]:
    """Per dtype, a measured tokens/s as a fraction of the ceiling."""
    return {d: (c if not is_available(c) else measured / c if measured is not None else None) for d, c in ceilings.items()}


def share_of_ceiling_per_repetition(tokens_per_s: Sequence[float], peak: dict[str, Any],
                                    flops_per_token: float) -> dict[str, float | str]:
    """Per dtype, the median over repetitions of each repetition's rate against the ceiling measured in the
    same repetition."""
    return {d: statistics.median(r * flops_per_token / p for r, p in zip(tokens_per_s, f["values"])) if is_available(f) else f
            for d, f in peak["flops_per_s"].items()}
