"""Measurements behind BENCHMARKS.md: statistics, compute ceilings, capture A/B, interleaved serving.

Machines are noisy, so every comparison here is measured in one process run with its two (or more) sides
interleaved: A B, B A, A B ... (the order alternates so that neither side always runs first), each side's
figure is the median over repetitions, and a ratio is taken pair by pair within a repetition and then its
median is quoted. Engine and model loading is timed separately and never counts in a throughput.

`scripts/benchmark.py` drives these pieces; `eagle_pipeline/benchmark_report.py` turns the results into
markdown.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import Any

# --------------------------------------------------------------------------------------------------------
# Statistics


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and the values themselves (the median is the figure to quote)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no values to summarise")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "values": values}


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """a[i] / b[i] for each repetition i: the two sides of a pair ran back to back, so drift cancels."""
    if len(numerators) != len(denominators):
        raise ValueError(f"unpaired measurements: {len(numerators)} against {len(denominators)}")
    return [a / b for a, b in zip(numerators, denominators)]


def interleaved_order(names: Sequence[str], repetition: int) -> list[str]:
    """The order to run the sides in on a repetition: rotated by one each time, so each side leads in turn."""
    names = list(names)
    shift = repetition % len(names)
    return names[shift:] + names[:shift]


def acceptance_length_stderr(per_position: Sequence[float], num_drafts: int) -> float | None:
    """Standard error of the mean acceptance length from per-position acceptance rates.

    vLLM accepts a draft's tokens up to the first rejection, so per_position[k] = P(A > k) for the number A
    of accepted draft tokens in one verification step: E[A] = sum p_k and E[A^2] = sum (2k + 1) p_k
    (k from 0). Steps of one request are not independent, so this is a lower bound on the true error.
    """
    if not num_drafts or not per_position:
        return None
    mean = sum(per_position)
    second = sum((2 * k + 1) * p for k, p in enumerate(per_position))
    variance = max(second - mean * mean, 0.0)
    return math.sqrt(variance / num_drafts)


# --------------------------------------------------------------------------------------------------------
# Compute ceilings: FLOPs per token of a decoder-only verifier, and the machine's matmul throughput


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


def _flops_per_s(step: Callable[[], Any], size: int, min_seconds: float) -> float:
    step()  # first call: kernel selection, page faults
    count, started = 0, time.perf_counter()
    while True:
        step()
        count += 1
        elapsed = time.perf_counter() - started
        if elapsed >= min_seconds:
            return 2.0 * size**3 * count / elapsed


def _onednn_ops():
    """vLLM's oneDNN GEMM (what its CPU linear layers run), or None where this vLLM build has none."""
    try:
        from vllm import _custom_ops as ops
    except Exception:  # noqa: BLE001 - no vLLM, or a build without CPU kernels
        return None
    return ops if getattr(ops, "_supports_onednn", False) else None


def matmul_flops_per_s(size: int, min_seconds: float, dtypes: Sequence[str] = ("float32", "bfloat16")) -> dict[str, dict[str, float]]:
    """FLOP/s of a size x size by size x size product, per dtype and kernel: torch.matmul (MKL or
    OpenBLAS for float32 on the CPU) and, where vLLM has it, the oneDNN GEMM that vLLM's CPU layers use.
    The two differ by 2x for float32 on some CPUs, so the ceiling is the faster of the two."""
    import torch

    ops = _onednn_ops()
    generator = torch.Generator().manual_seed(0)
    rates: dict[str, dict[str, float]] = {}
    for dtype in dtypes:
        torch_dtype = getattr(torch, dtype)
        a = torch.randn(size, size, generator=generator).to(torch_dtype)
        b = torch.randn(size, size, generator=generator).to(torch_dtype)
        out = torch.empty(size, size, dtype=torch_dtype)
        rates[dtype] = {"torch": _flops_per_s(lambda: torch.matmul(a, b, out=out), size, min_seconds)}
        if ops is not None:
            handler = ops.create_onednn_mm(b, 32)
            rates[dtype]["onednn"] = _flops_per_s(lambda: ops.onednn_mm(handler, a, None), size, min_seconds)
    return rates


def summarize_matmul(samples: Sequence[dict[str, dict[str, float]]], size: int, threads: int) -> dict[str, Any]:
    """Per dtype: each kernel's FLOP/s and the peak (the faster kernel of each repetition), as spreads."""
    dtypes = list(samples[0])
    out: dict[str, Any] = {"size": size, "repetitions": len(samples), "threads": threads, "flops_per_s": {}, "kernels": {}}
    for dtype in dtypes:
        out["flops_per_s"][dtype] = spread([max(rep[dtype].values()) for rep in samples])
        out["kernels"][dtype] = {k: spread([rep[dtype][k] for rep in samples]) for k in samples[0][dtype]}
    return out


# --------------------------------------------------------------------------------------------------------
# Hidden-state capture: vLLM (stage 02's path) against HF transformers, same samples, same layers


class HFHiddenStates:
    """The HF transformers way to get a verifier's hidden states: a forward pass with output_hidden_states.

    Returns what HiddenStateCapture returns, [seq, n_aux + 1, H] per sequence: hidden_states[k] for each aux
    id k, and in the last slot the final decoder layer's output *before* the final norm (vLLM's id L; HF's
    hidden_states[L] is after the norm), taken with a forward hook. One sequence per forward pass, so no
    padding is computed; logits only for the last position, as vLLM's prefill computes them.
    """

    def __init__(self, verifier_dir: str | os.PathLike, layer_ids: Sequence[int], dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        torch_dtype = "auto" if dtype == "auto" else getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(str(verifier_dir), dtype=torch_dtype).eval()
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


def capture_ab(verifier_dir: str | os.PathLike, layer_ids: Sequence[int], sequences: Sequence[Sequence[int]], *,
               num_layers: int, dtype: str, max_model_len: int, batch_size: int, repetitions: int,
               engine_args: dict[str, Any], storage_path: str | os.PathLike, matmul_size: int, matmul_seconds: float,
               tensor_parallel_size: int = 1, trust_remote_code: bool = False,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Capture tokens/s of vLLM (HiddenStateCapture, as stage 02 runs it) and of HF transformers, and the
    machine's matmul throughput (the ceiling) under the same conditions.

    Both sides load once (timed apart); one untimed warm-up pass each, which also checks that the two
    return the same states; then `repetitions` rounds, each a timed pass of each side over all sequences
    plus a matmul measurement, in rotating order. Timed: from token ids to [seq, n, H] tensors in this
    process (for vLLM that includes the connector's file round trip, as in stage 02); not timed: loading,
    writing the training files.
    """
    import torch

    from eagle_pipeline.capture import HiddenStateCapture

    threads = torch.get_num_threads()
    started = time.perf_counter()
    engine = HiddenStateCapture(verifier_dir, layer_ids, num_layers=num_layers, dtype=dtype,
                                max_model_len=max_model_len, tensor_parallel_size=tensor_parallel_size,
                                trust_remote_code=trust_remote_code, extra_engine_args=engine_args,
                                storage_path=storage_path)
    with engine:
        vllm_load_s = time.perf_counter() - started
        # Starting vLLM may change this process's torch thread count; HF must run on every core it had.
        torch.set_num_threads(threads)
        started = time.perf_counter()
        hf = HFHiddenStates(verifier_dir, layer_ids, dtype)
        hf_load_s = time.perf_counter() - started
        log(f"capture A/B: vLLM engine up in {vllm_load_s:.1f} s, HF model in {hf_load_s:.1f} s; warm-up")

        sides = {"vllm": engine.capture, "hf": hf.capture}
        # The warm-up batch is also the check that both sides return the same layers.
        warm_up = sequences[:batch_size]
        agreement = _agreement(engine.capture(warm_up[:1])[0], hf.capture(warm_up[:1])[0])
        for capture in sides.values():
            capture(warm_up)

        seconds: dict[str, list[float]] = {name: [] for name in sides}
        matmul: list[dict[str, dict[str, float]]] = []
        for rep in range(repetitions):
            for name in interleaved_order([*sides, "matmul"], rep):
                if name == "matmul":
                    matmul.append(matmul_flops_per_s(matmul_size, matmul_seconds))
                else:
                    seconds[name].append(time_capture(sides[name], sequences, batch_size))
            log(f"capture A/B repetition {rep + 1}/{repetitions}: "
                + ", ".join(f"{name} {seconds[name][-1]:.2f} s" for name in sides)
                + "; matmul GFLOP/s " + ", ".join(f"{d} {max(k.values()) / 1e9:.0f}" for d, k in matmul[-1].items()))
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


# --------------------------------------------------------------------------------------------------------
# Serving: several vLLM servers alive at once, the prompts sent to each in turn


def split_rounds(items: Sequence[Any], rounds: int) -> list[list[Any]]:
    """`rounds` contiguous chunks of nearly equal size (the first ones one longer), none empty."""
    rounds = max(1, min(rounds, len(items)))
    size, extra = divmod(len(items), rounds)
    chunks, start = [], 0
    for r in range(rounds):
        end = start + size + (1 if r < extra else 0)
        chunks.append(list(items[start:end]))
        start = end
    return chunks


def serve_interleaved(target_dir: str | os.PathLike, servers: dict[str, dict | None], prompts: Sequence[list[dict]], *,
                      rounds: int, max_tokens: int, temperature: float, concurrency: int, seed: int | None,
                      max_model_len: int, dtype: str, extra_args: Sequence[str], env: dict[str, str],
                      log_dir: str | os.PathLike, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Output tokens/s and acceptance of each server configuration, measured interleaved.

    Every server (one per entry of `servers`: name -> speculative config or None) is started first and
    stays up; each round then sends the same chunk of prompts to every server in turn, one server at a
    time, the order rotating between rounds. Tokens/s per round is output tokens over the chunk's wall time
    at the given concurrency, and each server's ratio is taken per round against the first server (the
    baseline). Spec-decode counters are scraped before and after each chunk, as stage 06 does, and summed
    over rounds. The result's "texts" holds every server's answers in prompt order.
    """
    from eagle_pipeline.serve.client import run_prompts
    from eagle_pipeline.serve.server import VllmServer
    from eagle_pipeline.serve.spec_metrics import metrics_delta, scrape_spec_metrics, wait_for_counted_tokens

    chunks = split_rounds(prompts, rounds)
    per_round: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    start_s: dict[str, float | None] = {}
    with ExitStack() as stack:
        live = {}
        for name, spec in servers.items():
            log(f"serving: starting the {name} server")
            server = VllmServer(target_dir, speculative_config=spec, max_model_len=max_model_len, dtype=dtype,
                                extra_args=extra_args, env=env, log_path=Path(log_dir) / f"server-{name}.log")
            stack.enter_context(server)
            start_s[name] = server.start_seconds
            run_prompts(server.base_url, server.model, [[{"role": "user", "content": "Say hello."}]],
                        max_tokens=8, temperature=temperature, concurrency=1, seed=seed)
            live[name] = server
        for r, chunk in enumerate(chunks):
            for name in interleaved_order(list(live), r):
                server = live[name]
                before = scrape_spec_metrics(server.base_url)
                run = run_prompts(server.base_url, server.model, chunk, max_tokens=max_tokens,
                                  temperature=temperature, concurrency=concurrency, seed=seed)
                after = wait_for_counted_tokens(server.base_url, before, run.output_tokens)
                per_round[name].append({"output_tokens": run.output_tokens, "wall_s": run.wall_s,
                                        "tokens_per_s": run.output_tokens / run.wall_s, "texts": run.texts,
                                        "metrics": metrics_delta(before, after)})
            log(f"serving round {r + 1}/{len(chunks)} ({len(chunk)} prompts): "
                + ", ".join(f"{name} {per_round[name][-1]['tokens_per_s']:.1f} tok/s" for name in live))
    return summarize_serving(per_round, servers, start_s, num_prompts=len(prompts), max_tokens=max_tokens,
                             temperature=temperature, concurrency=concurrency)


def _sum_metrics(deltas: Sequence[dict]) -> dict[str, Any]:
    total: dict[str, Any] = {}
    for delta in deltas:
        for key, value in delta.items():
            if key == "accepted_per_pos":
                old = total.get(key, [])
                total[key] = [(old[i] if i < len(old) else 0.0) + (value[i] if i < len(value) else 0.0)
                              for i in range(max(len(old), len(value)))]
            else:
                total[key] = total.get(key, 0.0) + value
    return total


def summarize_serving(per_round: dict[str, list[dict]], servers: dict[str, dict | None], start_s: dict[str, float | None],
                      *, num_prompts: int, max_tokens: int, temperature: float, concurrency: int) -> dict[str, Any]:
    """Per server: tokens/s (median over rounds), ratio to the first server per round, summed acceptance."""
    from eagle_pipeline.serve.spec_metrics import acceptance_stats

    baseline = next(iter(per_round))
    base_rates = [r["tokens_per_s"] for r in per_round[baseline]]
    modes, texts = {}, {}
    for name, rounds in per_round.items():
        rates = [r["tokens_per_s"] for r in rounds]
        texts[name] = [t for r in rounds for t in r["texts"]]
        summary: dict[str, Any] = {
            "speculative_config": servers[name],
            "server_start_s": start_s.get(name),
            "output_tokens": sum(r["output_tokens"] for r in rounds),
            "tokens_per_s": spread(rates),
            "ratio_to_baseline": spread(paired_ratios(rates, base_rates)),
        }
        if servers[name] is not None:
            stats = acceptance_stats(_sum_metrics([r["metrics"] for r in rounds]))
            stats["mean_acceptance_length_stderr"] = acceptance_length_stderr(stats["per_position_acceptance"],
                                                                               stats["num_drafts"])
            summary.update(stats)
        modes[name] = summary
    return {"num_prompts": num_prompts, "rounds": len(per_round[baseline]), "baseline": baseline,
            "max_tokens": max_tokens, "temperature": temperature, "concurrency": concurrency, "modes": modes,
            "texts": texts}
