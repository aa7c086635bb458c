"""Measure what speculative decoding buys: one server per mode, one at a time, and the stage-06 summary of the runs.

Per mode a warm-up request, then per concurrency level /metrics scraped before and after its prompts (docs/engines.md,
"Spec-decode metrics"); the first level is the headline, its first pass the mode's texts and token ids. Each mode's
record (`mode_record`) is handed out before its server stops, so a later failure loses nothing measured
(docs/contracts.md, "Stage 06: report.json"); the report is built from the records (`served_report`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

from eagle_pipeline.config import RunConfig
from eagle_pipeline.drafter.layouts import DRAFTER_MODES, drafter_mode
from eagle_pipeline.engine import drafter_engine_settings, drafter_speculative_config, server_kwargs
from eagle_pipeline.errors import BadInput
from eagle_pipeline.serve.client import PromptRun, run_prompts
from eagle_pipeline.serve.engine_facts import declared_settings, read_engine_facts, server_env
from eagle_pipeline.serve.plan import SCHEDULE_MODE, greedy_mismatches, requests_at
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

MODES = ("none", "ngram", *DRAFTER_MODES)


@dataclass
class ModeMeasurement:
    mode: str
    speculative_config: dict | None
    run: PromptRun
    metrics: dict  # metrics_delta over the prompt run
    server_start_s: float | None = None


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
        "tpot_ms": ratio(1000.0 * m.metrics["tpot_sum_s"], m.metrics["tpot_count"]),
        "ttft_ms": ratio(1000.0 * m.metrics["ttft_sum_s"], m.metrics["ttft_count"]),
        "mean_latency_s": sum(r.latency_s for r in run.requests) / len(run.requests) if run.requests else None,
        "server_generation_tokens": int(m.metrics["generation_tokens"]),
    }
    if m.speculative_config is not None:
        summary.update(acceptance_stats(m.metrics))
        summary["per_prompt"] = [request_acceptance(r.spec_decode) for r in run.requests]
    return summary


def level_summary(m: ModeMeasurement, level: int) -> dict:
    """One concurrency level of a mode: `summarize_mode`'s figures over every request the level sent, each
    request's own acceptance as `per_request` (request i asked prompt i modulo the number of prompts)."""
    summary = summarize_mode(m)
    del summary["speculative_config"], summary["server_start_s"]
    if "per_prompt" in summary:
        summary["per_request"] = summary.pop("per_prompt")
    return {"concurrency": level, "num_requests": len(m.run.requests), **summary}


def mode_record(m: ModeMeasurement) -> dict:
    """One served mode as it is kept (JSON): its report block, and per prompt its text and [prompt, answer] ids."""
    return {"summary": summarize_mode(m), "texts": m.run.texts,
            "token_ids": [[r.prompt_token_ids, r.token_ids] for r in m.run.requests]}


def sweep_record(measurements: Sequence[ModeMeasurement], levels: Sequence[int], num_prompts: int) -> dict:
    """One served mode swept over `levels` (a measurement each), as it is kept: the first level's record
    (`mode_record`, texts and ids of its first pass over the prompts) with every level's figures in its summary's
    `levels` (`level_summary`)."""
    head = measurements[0]
    record = mode_record(head)
    record["texts"], record["token_ids"] = record["texts"][:num_prompts], record["token_ids"][:num_prompts]
    if "per_prompt" in record["summary"]:
        record["summary"]["per_prompt"] = record["summary"]["per_prompt"][:num_prompts]
    record["summary"]["levels"] = [level_summary(m, level) for m, level in zip(measurements, levels)]
    return record


def summarize_records(
    records: Mapping[str, dict],
    *,
    num_speculative_tokens: int,
    temperature: float,
    max_tokens: int | None = None,
    concurrency: int | Sequence[int] | None = None,
) -> dict:
    """The stage-06 report of the modes' records (`mode_record`), its fields as docs/contracts.md lists them;
    `concurrency` one level or the levels swept (the headline figures are the first level's). `greedy_match`
    speaks for the drafter when measured, else for the other speculative modes."""
    levels = None if concurrency is None else [concurrency] if isinstance(concurrency, int) else list(concurrency)
    modes = {name: record["summary"] for name, record in records.items()}
    num_prompts = {len(record["texts"]) for record in records.values()}
    if len(num_prompts) > 1:
        raise ValueError(f"modes ran different numbers of prompts: {sorted(num_prompts)}")
    drafter = drafter_mode(modes)
    tokens_per_s = {**dict.fromkeys(("none", "ngram", drafter)),
                    **{name: summary["tokens_per_s"] for name, summary in modes.items()}}

    mismatches: dict[str, list[int]] = {}
    if temperature == 0 and "none" in records:
        reference = records["none"]["texts"]
        for name, record in records.items():
            if name != "none" and record["summary"].get("speculative_config") is not None:
                mismatches[name] = greedy_mismatches(reference, record["texts"])
    checked = [mismatches[drafter]] if drafter in mismatches else list(mismatches.values())
    greedy_match = not any(checked) if checked else None

    none_tps = tokens_per_s.get("none")
    speedups = {
        name: ratio(tps, none_tps) if (tps is not None and none_tps) else None
        for name, tps in tokens_per_s.items() if name != "none"
    }
    eagle = modes.get(drafter, {})
    return {
        "num_prompts": num_prompts.pop() if num_prompts else 0,
        "num_speculative_tokens": num_speculative_tokens,
        "mean_acceptance_length": eagle.get("mean_acceptance_length"),
        "acceptance_rate": eagle.get("acceptance_rate"),
        "per_position_acceptance": eagle.get("per_position_acceptance", []),
        "tokens_per_s": tokens_per_s,
        "speedup": speedups.get(drafter),
        "greedy_match": greedy_match,
        "greedy_mismatches": mismatches,
        "speedup_by_mode": speedups,
        "tpot_ms": {name: s["tpot_ms"] for name, s in modes.items()},
        "ngram_acceptance": {key: modes["ngram"].get(key) for key in
                  ("acceptance_rate", "mean_acceptance_length", "per_position_acceptance")}
        if "ngram" in modes else None,
        "temperature": temperature,
        "max_tokens": max_tokens,
        "concurrency": levels[0] if levels else None,
        "concurrency_levels": levels,
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
    schedule: Sequence[Sequence[int]] | None = None,
) -> dict | None:
    """vLLM's `speculative_config` of a mode; "schedule" is the drafter's with `schedule` as vLLM's
    `num_speculative_tokens_per_batch_size` (None: one k at every batch size)."""
    if mode == "none":
        return None
    if mode == "ngram":
        return {"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
                "prompt_lookup_max": prompt_lookup_max, "prompt_lookup_min": prompt_lookup_min}
    if mode in (*DRAFTER_MODES, SCHEDULE_MODE):
        if drafter_dir is None:
            raise BadInput(f"{mode} mode needs the drafter folder (stage 05 output); none was given")
        drafter_dir = Path(drafter_dir)
        if not (drafter_dir / "config.json").is_file():
            raise BadInput(f"{drafter_dir}: no config.json; point to a converted drafter (stage 05 output)")
        config = drafter_speculative_config(drafter_dir, num_speculative_tokens, drafter_settings)
        if mode == SCHEDULE_MODE and schedule is not None:
            config["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in schedule]
        return config
    raise BadInput(f"serve.modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")


def served_report(records: Mapping[str, dict], **settings) -> dict:
    """The report of the served modes' records (`summarize_records`, `settings` its keywords), with "texts" and
    "token_ids" per mode beside it; records in the order the modes were served."""
    report = summarize_records(records, **settings)
    report["texts"] = {mode: record["texts"] for mode, record in records.items()}
    report["token_ids"] = {mode: [tuple(pair) for pair in record["token_ids"]] for mode, record in records.items()}
    return report


def mode_server(mode: str, target_dir: str | os.PathLike, drafter_dir: str | os.PathLike | None, *,
                num_speculative_tokens: int, drafter_settings: dict | None = None,
                schedule: Sequence[Sequence[int]] | None = None, extra_args: Sequence[str] = (),
                **server) -> VllmServer:
    """The server (not started) that serves `mode`: the target's settings (`server`, VllmServer's keywords), the
    mode's `speculative_config`, and for a speculating mode each request's own acceptance (vLLM refuses that flag
    without speculation)."""
    config = speculative_config_for(mode, num_speculative_tokens=num_speculative_tokens, drafter_dir=drafter_dir,
                                    drafter_settings=drafter_settings, schedule=schedule)
    flags = [*extra_args, *(PER_REQUEST_FLAGS if config is not None else ())]
    return VllmServer(target_dir, speculative_config=config, extra_args=flags, **server)


def measure_modes(cfg: RunConfig, target_dir: str | os.PathLike, drafter_dir: str | os.PathLike | None,
                 prompts: Sequence[list[dict]], modes: Sequence[str], log_dir: Path, chat_template_kwargs: dict | None,
                 measured: Mapping[str, dict] | None = None, on_measured: Callable[[str, dict], None] | None = None,
                 levels: Sequence[int] | None = None, num_speculative_tokens: int | None = None,
                 schedule: Sequence[Sequence[int]] | None = None) -> dict:
    """Serve the target once per mode (sequentially, as the module's docstring says) under `cfg`'s engine settings
    and return the report dict (`served_report`), the eagle3 server's engine facts (`read_engine_facts`) beside it
    and in its record. `levels` (default serve.concurrency): `plan.requests_at` requests each. `measured`: the
    records (`sweep_record`) of modes an earlier run served, not served again. `on_measured(mode, record)`: each
    mode's record once its prompts are answered. `num_speculative_tokens` and `schedule` (the "schedule" mode's
    `num_speculative_tokens_per_batch_size`) default to serve.num_speculative_tokens and none."""
    s = cfg.serve
    levels = list(levels or s.concurrency_levels)
    num_speculative_tokens = num_speculative_tokens or s.num_speculative_tokens
    if not prompts:
        raise BadInput("prompts: no prompts to measure with; give at least one")
    measured = dict(measured or {})
    kwargs = server_kwargs(cfg)
    kwargs["env"] = server_env(cfg, kwargs["env"])
    # Every server is built (a mode's bad setting refused) before the first one starts.
    servers = {mode: mode_server(mode, target_dir, drafter_dir, num_speculative_tokens=num_speculative_tokens,
                                 log_path=log_dir / f"server-{mode}.log", port=s.port,
                                 startup_timeout_s=s.startup_timeout_s, drafter_settings=drafter_engine_settings(cfg),
                                 schedule=schedule, **kwargs)
               for mode in modes if mode not in measured}
    warmup_prompt = [{"role": "user", "content": "Say hello."}]
    records: dict[str, dict] = {}
    for mode in modes:
        if mode in measured:
            records[mode] = measured[mode]
            continue
        server = servers[mode]
        print(f"[{mode}] starting vLLM server (log: {server.log_path})")
        with server:
            print(f"[{mode}] server healthy after {server.start_seconds:.1f} s; warm-up request")
            run_prompts(server.base_url, server.model, [warmup_prompt], max_tokens=8, temperature=s.temperature,
                        concurrency=1, seed=cfg.seed, chat_template_kwargs=chat_template_kwargs)
            swept = []
            for level in levels:
                asked = [prompts[i % len(prompts)] for i in range(requests_at(level, len(prompts)))]
                before = scrape_spec_metrics(server.base_url)
                run = run_prompts(server.base_url, server.model, asked, max_tokens=s.max_tokens,
                                  temperature=s.temperature, concurrency=level, seed=cfg.seed,
                                  chat_template_kwargs=chat_template_kwargs)
                after = wait_for_counted_tokens(server.base_url, before, run.output_tokens)
                swept.append(ModeMeasurement(mode=mode, speculative_config=server.speculative_config, run=run,
                                             metrics=metrics_delta(before, after), server_start_s=server.start_seconds))
                summary = summarize_mode(swept[-1])
                print(f"[{mode}] concurrency {level}: {summary['output_tokens']} tokens in {run.wall_s:.1f} s = "
                      f"{summary['tokens_per_s']:.1f} tok/s"
                      + (f", mean acceptance length {summary['mean_acceptance_length']:.2f}"
                         if summary.get("mean_acceptance_length") is not None else ""))
            records[mode] = sweep_record(swept, levels, len(prompts))
            if mode in DRAFTER_MODES:
                records[mode]["engine"] = read_engine_facts(server.log_path, declared_settings(cfg))
            if on_measured is not None:
                on_measured(mode, records[mode])
    report = served_report(records, num_speculative_tokens=num_speculative_tokens, temperature=s.temperature,
                           max_tokens=s.max_tokens, concurrency=levels)
    drafter = drafter_mode(modes)
    if drafter in modes:
        report["engine"] = (records[drafter].get("engine")
                            or read_engine_facts(log_dir / f"server-{drafter}.log", declared_settings(cfg)))
    return report
