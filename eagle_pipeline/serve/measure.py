"""Measure what speculative decoding buys: one server per mode, and the stage-06 summary of the runs.

Each mode ("none", "ngram", "eagle3") gets its own server process, one at a time. For each mode we send a
warm-up request, scrape /metrics, run the prompts, scrape again, and keep the difference, so that start-up
and warm-up traffic never count.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from eagle_pipeline.engine import eagle3_speculative_config
from eagle_pipeline.errors import BadInput
from eagle_pipeline.serve.client import PromptRun, run_prompts
from eagle_pipeline.serve.server import VllmServer
from eagle_pipeline.serve.spec_metrics import (
    PER_REQUEST_FLAGS,
    acceptance_stats,
    metrics_delta,
    ratio,
    request_acceptance,
    scrape_spec_metrics,
    wait_for_counted_tokens,
)

MODES = ("none", "ngram", "eagle3")


@dataclass
class ModeMeasurement:
    mode: str
    speculative_config: dict | None
    run: PromptRun
    metrics: dict  # metrics_delta over the prompt run
    server_start_s: float | None = None
    extra: dict = field(default_factory=dict)


def summarize_mode(m: ModeMeasurement) -> dict:
    run = m.run
    output_tokens = run.output_tokens
    summary = {
        "speculative_config": m.speculative_config,
        "server_start_s": m.server_start_s,
        "output_tokens": output_tokens,
        "wall_s": run.wall_s,
        "tokens_per_s": ratio(output_tokens, run.wall_s),
        # Server-side mean over requests of decode time per output token (excludes queueing and prefill).
        "tpot_ms": _scaled(ratio(m.metrics["tpot_sum_s"], m.metrics["tpot_count"]), 1000.0),
        "ttft_ms": _scaled(ratio(m.metrics["ttft_sum_s"], m.metrics["ttft_count"]), 1000.0),
        "mean_latency_s": sum(r.latency_s for r in run.requests) / len(run.requests) if run.requests else None,
        "server_generation_tokens": int(m.metrics["generation_tokens"]),
    }
    if m.speculative_config is not None:
        summary.update(acceptance_stats(m.metrics))
        summary["per_prompt"] = [request_acceptance(r.spec_decode) for r in run.requests]
    summary.update(m.extra)
    return summary


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def greedy_mismatches(reference: Sequence[str], candidate: Sequence[str]) -> list[int]:
    """Indices of prompts whose texts differ."""
    return [i for i, (a, b) in enumerate(zip(reference, candidate)) if a != b]


def summarize(
    measurements: dict[str, ModeMeasurement],
    *,
    num_speculative_tokens: int,
    temperature: float,
    max_tokens: int | None = None,
    concurrency: int | None = None,
) -> dict:
    """The stage-06 report: headline numbers for eagle3, tokens/s for every mode, and the greedy check.

    `greedy_match` compares each speculative mode's texts with those of "none" (same prompts, temperature
    0); it is None when no such comparison is possible (temperature > 0 or "none" not measured). The
    headline flag speaks for eagle3 when measured, else for the other speculative modes.
    """
    modes = {name: summarize_mode(m) for name, m in measurements.items()}
    num_prompts = {len(m.run.requests) for m in measurements.values()}
    if len(num_prompts) > 1:
        raise ValueError(f"modes ran different numbers of prompts: {sorted(num_prompts)}")
    tokens_per_s = {mode: modes[mode]["tokens_per_s"] if mode in modes else None for mode in MODES}
    for name in modes:
        tokens_per_s.setdefault(name, modes[name]["tokens_per_s"])

    mismatches: dict[str, list[int]] = {}
    if temperature == 0 and "none" in measurements:
        reference = measurements["none"].run.texts
        for name, m in measurements.items():
            if name != "none" and m.speculative_config is not None:
                mismatches[name] = greedy_mismatches(reference, m.run.texts)
    if "eagle3" in mismatches:
        greedy_match = not mismatches["eagle3"]
    elif mismatches:
        greedy_match = all(not v for v in mismatches.values())
    else:
        greedy_match = None

    none_tps = tokens_per_s.get("none")
    speedups = {
        name: ratio(tps, none_tps) if (tps is not None and none_tps) else None
        for name, tps in tokens_per_s.items() if name != "none"
    }
    eagle = modes.get("eagle3", {})
    return {
        "num_prompts": num_prompts.pop() if num_prompts else 0,
        "num_speculative_tokens": num_speculative_tokens,
        "mean_acceptance_length": eagle.get("mean_acceptance_length"),
        "acceptance_rate": eagle.get("acceptance_rate"),
        "per_position_acceptance": eagle.get("per_position_acceptance", []),
        "tokens_per_s": tokens_per_s,
        "speedup": speedups.get("eagle3"),
        "greedy_match": greedy_match,
        "greedy_mismatches": mismatches,
        "speedup_by_mode": speedups,
        "tpot_ms": {name: s["tpot_ms"] for name, s in modes.items()},
        "ngram_acceptance": {key: modes["ngram"].get(key) for key in
                  ("acceptance_rate", "mean_acceptance_length", "per_position_acceptance")}
        if "ngram" in modes else None,
        "temperature": temperature,
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "modes": modes,
    }


def speculative_config_for(
    mode: str,
    *,
    num_speculative_tokens: int,
    drafter_dir: str | os.PathLike | None = None,
    prompt_lookup_max: int = 4,
    prompt_lookup_min: int = 2,
    drafter_settings: dict | None = None,
) -> dict | None:
    if mode == "none":
        return None
    if mode == "ngram":
        return {"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
                "prompt_lookup_max": prompt_lookup_max, "prompt_lookup_min": prompt_lookup_min}
    if mode == "eagle3":
        if drafter_dir is None:
            raise BadInput("eagle3 mode needs the drafter folder (stage 05 output); none was given")
        drafter_dir = Path(drafter_dir)
        if not (drafter_dir / "config.json").is_file():
            raise BadInput(f"{drafter_dir}: no config.json; point to a converted drafter (stage 05 output)")
        return eagle3_speculative_config(drafter_dir, num_speculative_tokens, drafter_settings)
    raise BadInput(f"serve.modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")


def measure_modes(
    target_dir: str | os.PathLike,
    drafter_dir: str | os.PathLike | None,
    prompts: Sequence[list[dict]],
    *,
    num_speculative_tokens: int,
    modes: Iterable[str] = MODES,
    max_tokens: int = 128,
    temperature: float = 0.0,
    concurrency: int = 1,
    seed: int | None = 0,
    prompt_lookup_max: int = 4,
    prompt_lookup_min: int = 2,
    max_model_len: int = 2048,
    dtype: str = "auto",
    port: int | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    drafter_settings: dict | None = None,
    log_dir: str | os.PathLike,
    startup_timeout_s: float = 1200.0,
    chat_template_kwargs: dict | None = None,
    log=print,
) -> dict:
    """Serve the target once per mode (sequentially), measure, and return the report dict.

    The returned dict is `summarize(...)` plus "texts": {mode: [output text per prompt]}.
    """
    modes = tuple(modes)
    if not prompts:
        raise BadInput("prompts: no prompts to measure with; give at least one")
    configs = {
        mode: speculative_config_for(mode, num_speculative_tokens=num_speculative_tokens, drafter_dir=drafter_dir,
                                     prompt_lookup_max=prompt_lookup_max, prompt_lookup_min=prompt_lookup_min,
                                     drafter_settings=drafter_settings)
        for mode in modes
    }
    warmup_prompt = [{"role": "user", "content": "Say hello."}]
    measurements: dict[str, ModeMeasurement] = {}
    for mode in modes:
        log(f"[{mode}] starting vLLM server (log: {Path(log_dir) / f'server-{mode}.log'})")
        # Speculating servers also answer each request with its own acceptance (vLLM refuses the flag otherwise).
        flags = [*extra_args, *(PER_REQUEST_FLAGS if configs[mode] is not None else ())]
        server = VllmServer(target_dir, port=port, speculative_config=configs[mode], max_model_len=max_model_len,
                            dtype=dtype, extra_args=flags, log_path=Path(log_dir) / f"server-{mode}.log",
                            env=env, startup_timeout_s=startup_timeout_s)
        with server:
            log(f"[{mode}] server healthy after {server.start_seconds:.1f} s; warm-up request")
            run_prompts(server.base_url, server.model, [warmup_prompt], max_tokens=8, temperature=temperature,
                        concurrency=1, seed=seed, chat_template_kwargs=chat_template_kwargs)
            before = scrape_spec_metrics(server.base_url)
            run = run_prompts(server.base_url, server.model, prompts, max_tokens=max_tokens,
                              temperature=temperature, concurrency=concurrency, seed=seed,
                              chat_template_kwargs=chat_template_kwargs)
            after = wait_for_counted_tokens(server.base_url, before, run.output_tokens)
        measurement = ModeMeasurement(mode=mode, speculative_config=configs[mode], run=run,
                                      metrics=metrics_delta(before, after), server_start_s=server.start_seconds)
        measurements[mode] = measurement
        summary = summarize_mode(measurement)
        log(f"[{mode}] {summary['output_tokens']} tokens in {run.wall_s:.1f} s = {summary['tokens_per_s']:.1f} tok/s"
            + (f", mean acceptance length {summary['mean_acceptance_length']:.2f}"
               if summary.get("mean_acceptance_length") is not None else ""))
    report = summarize(measurements, num_speculative_tokens=num_speculative_tokens, temperature=temperature,
                       max_tokens=max_tokens, concurrency=concurrency)
    report["texts"] = {mode: m.run.texts for mode, m in measurements.items()}
    report["token_ids"] = {mode: [(r.prompt_token_ids, r.token_ids) for r in m.run.requests] for mode, m in measurements.items()}
    return report
