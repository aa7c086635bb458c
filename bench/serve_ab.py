"""Serving A/B: several vLLM servers alive at once, each round of prompts sent to each in turn."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from itertools import zip_longest
from pathlib import Path
from typing import Any

from bench.stats import acceptance_length_stderr, interleaved_order, paired_ratios, split_rounds, spread


def serve_interleaved(target_dir: str | os.PathLike, servers: dict[str, dict | None], prompts: Sequence[list[dict]], *,
                      rounds: int, max_tokens: int, temperature: float, concurrency: int, seed: int | None,
                      max_model_len: int, dtype: str, extra_args: Sequence[str], env: dict[str, str],
                      log_dir: str | os.PathLike, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Output tokens/s and acceptance of each server (`servers`: name -> speculative config or None), all up at
    once, each round's chunk of prompts sent to each in turn (BENCHMARKS.md section 4 says how), the ratios taken
    per round against the first server. The result's "texts" holds every server's answers in prompt order."""
    from eagle_pipeline.serve.client import run_prompts
    from eagle_pipeline.serve.server import VllmServer
    from eagle_pipeline.serve.spec_metrics import metrics_delta, scrape_spec_metrics, wait_for_counted_tokens

    chunks = split_rounds(prompts, rounds)
    per_round: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    with ExitStack() as stack:
        live = {}
        for name, spec in servers.items():
            log(f"serving: starting the {name} server")
            live[name] = server = stack.enter_context(VllmServer(
                target_dir, speculative_config=spec, max_model_len=max_model_len, dtype=dtype, extra_args=extra_args,
                env=env, log_path=Path(log_dir) / f"server-{name}.log"))
            run_prompts(server.base_url, server.model, [[{"role": "user", "content": "Say hello."}]],
                        max_tokens=8, temperature=temperature, concurrency=1, seed=seed)
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
    start_s = {name: server.start_seconds for name, server in live.items()}
    return summarize_serving(per_round, servers, start_s, num_prompts=len(prompts), max_tokens=max_tokens,
                             temperature=temperature, concurrency=concurrency)


def _sum_metrics(deltas: Sequence[dict]) -> dict[str, Any]:
    total = {key: sum(delta[key] for delta in deltas) for key in deltas[0] if key != "accepted_per_pos"}
    total["accepted_per_pos"] = [sum(p) for p in zip_longest(*(d["accepted_per_pos"] for d in deltas), fillvalue=0.0)]
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
