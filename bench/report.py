"""BENCHMARKS.md from the benchmark's results: every figure with its baseline beside it. The file is this
module's output and nothing else; findings measured by other commands live in docs/benchmarks/.
"""

from __future__ import annotations

from typing import Any, Callable

from bench.stats import is_available


def num(value: Any, digits: int = 0) -> str:
    """A number with thousands separators, '-' when missing, and anything else (an n/a figure) as it is."""
    if value is None:
        return "-"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    return f"{value:,.{digits}f}"


def med(figure: dict[str, Any] | str | None, digits: int = 0, fmt: Callable[[Any, int], str] = num) -> str:
    """'median [min-max]' of a spread() dict (the median written by fmt); just the median for one repetition."""
    if not figure:
        return "-"
    if not is_available(figure):
        return figure
    median = fmt(figure["median"], digits)
    if figure.get("n", 1) == 1:
        return median
    return f"{median} [{num(figure['min'], digits)}-{num(figure['max'], digits)}]"


def plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def ratio(value: float | str | None, digits: int = 2) -> str:
    if not is_available(value):
        return value
    return "-" if value is None else f"{value:.{digits}f}x"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def section(heading: str, *blocks: str | list[str]) -> list[str]:
    """A heading and its blocks (a paragraph, or the lines of a table or list), each followed by a blank line."""
    lines = [heading, ""]
    for block in blocks:
        lines += [block, ""] if isinstance(block, str) else [*block, ""]
    return lines


def ceiling_cells(ceiling: float | str, share: float | str | None) -> list[str]:
    """A ceiling's tokens/s and the measured share of it; an n/a ceiling is written once, with its reason."""
    return [num(ceiling), num(share, 2) if is_available(ceiling) else "-"]


def render_markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = section(
        "# Benchmarks",
        f"Every figure below comes from one run of `{meta['command']}` ({meta['mode']} mode), which read the finished "
        f"pipeline run `{meta['pipeline_run']}` and measured the rest itself in `{meta['work_dir']}`. Rerun it to "
        f"rewrite this file; its raw numbers are in `{meta['json']}`. Findings measured by other commands (engine "
        "settings, training speed-ups, predicted against served acceptance, diagnosis, bad input, data scaling) are "
        "in `docs/benchmarks/`, each under the command that measures it.",
        [f"- Date: {meta['date']}; the benchmark took {num(meta['total_s'] / 60, 1)} min.",
         f"- Machine: {meta['machine']['cpu']}, {meta['machine']['cores']} cores, {num(meta['machine']['ram_gib'], 1)} GiB RAM, "
         f"no GPU; {meta['machine']['os']}.",
         "- Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".",
         f"- Target: `{meta['verifier']}` in {meta['dtype']} ({meta['config']})."],
        "How to read: an A/B figure is measured in one process run with its sides interleaved (A B, then B A, ...). "
        "Each side's figure is the median over the repetitions, with [min-max] beside it; each ratio is taken "
        "pair by pair within a repetition and the median quoted. Loading engines and models is timed apart and "
        "never counts in a throughput. Figures marked *pipeline run* are single measurements from that run's "
        "manifests.",
    )
    for part in (_summary, _capture_section, _generation_section, _training_section, _serving_section,
                 _storage_section, _pipeline_section, _parts_section, _reproduce_section):
        lines += part(results)
    return "\n".join(lines) + "\n"


def _summary(results: dict[str, Any]) -> list[str]:
    cap, gen = results["capture"], results["generation"]
    train, serve, store, fp8 = results["training"], results["serving"]["modes"], results["storage"], results["fp8_cost"]
    pipe = results["pipeline"]
    rows = [
        ["1", "hidden-state capture, tokens/s (vLLM, stage 02's path)", med(cap["tokens_per_s"]["vllm"]),
         f"HF transformers {med(cap['tokens_per_s']['hf'])}", ratio(cap["ratio_vllm_over_hf"]["median"])],
        ["1", "capture against the fp32 matmul ceiling, tokens/s", num(cap["tokens_per_s"]["vllm"]["median"]),
         f"ceiling {num(cap['ceiling_tokens_per_s']['float32'])}", num(cap["fraction_of_ceiling"]["float32"], 2)],
        ["2", f"generation (stage 01), output tokens/s at batch {gen['batch_size']} *pipeline run*",
         num(gen["output_tokens_per_s"]), f"fp32 compute ceiling {num(gen['ceiling_tokens_per_s']['float32'])}",
         num(gen["fraction_of_ceiling"]["float32"], 2)],
        ["3", "training (stage 04), tokens/s, bf16 storage", num(train["bf16"]["tokens_per_s_median_step"]),
         f"fp8 storage {num(train['fp8']['tokens_per_s_median_step'])}", ratio(train["ratio_bf16_over_fp8"])],
        ["4", "serving, output tokens/s with the drafter", med(serve["eagle3"]["tokens_per_s"], 1),
         f"none {med(serve['none']['tokens_per_s'], 1)}; n-gram {med(serve['ngram']['tokens_per_s'], 1)}",
         f"{ratio(serve['eagle3']['ratio_to_baseline']['median'])} of none"],
        ["4", "mean acceptance length, drafter", num(serve["eagle3"]["mean_acceptance_length"], 2),
         f"n-gram {num(serve['ngram']['mean_acceptance_length'], 2)}", "-"],
        ["5", "training data, bytes per token, bf16 storage", num(store["bf16"]["bytes_per_token"]),
         f"fp8 {num(store['fp8']['bytes_per_token'])}", ratio(store["ratio_fp8_over_bf16"])],
        ["5", f"mean acceptance length, fp8 storage ({fp8['epochs']}-epoch drafters)", num(fp8["fp8"], 3),
         f"bf16 storage {num(fp8['bf16'], 3)}", f"{fp8['difference']:+.3f} (±{num(fp8['stderr'], 3)})"],
        ["6", "whole pipeline, wall time (s) *pipeline run*", num(pipe["total_wall_s"]), "-", "-"],
    ]
    return section("## Summary", table(["#", "figure", "measured", "baseline", "ratio"], rows))


def _capture_section(results: dict[str, Any]) -> list[str]:
    cap, ceil = results["capture"], results["ceiling"]
    agreement = cap["agreement"]
    rows = [
        ["vLLM, `HiddenStateCapture` (stage 02's path)", med(cap["tokens_per_s"]["vllm"]), num(cap["load_s"]["vllm"], 1),
         "1.00x"],
        ["HF transformers, forward with `output_hidden_states`", med(cap["tokens_per_s"]["hf"]), num(cap["load_s"]["hf"], 1),
         ratio(1 / cap["ratio_vllm_over_hf"]["median"])],
    ]
    for dtype in ("float32", "bfloat16"):
        ceiling, share = ceiling_cells(cap["ceiling_tokens_per_s"][dtype], cap["fraction_of_ceiling"][dtype])
        rows.append([f"ceiling: {dtype} matmul peak / FLOPs per token", ceiling, "-",
                     f"capture reaches {share}" if share != "-" else "-"])
    agree = (f"the two sides return the same layers (relative error per slot "
             f"{', '.join(f'{e:.1e}' for e in agreement['relative_error_per_slot'])})"
             if agreement.get("same_shape") else f"the two sides returned different shapes: {agreement}")
    return section(
        "## 1. Hidden-state capture",
        f"The same {cap['samples']} training samples ({num(cap['tokens'])} tokens) of the pipeline run, aux layers "
        f"{cap['layer_ids']} + the final layer before its norm, {cap['dtype']}, {cap['threads']} threads, "
        f"{plural(cap['repetitions'], 'interleaved repetition')}. Timed: token ids in, `[seq, n, H]` tensors out in the "
        f"benchmark's process (for vLLM {cap['vllm_batch_size']} sequences per engine call, the connector's file round "
        "trip included, as stage 02 runs it; for HF one sequence per forward pass, no padding, logits for the last "
        "position only). Not timed: loading (column 3), writing training files.",
        table(["side", "tokens/s", "load s", "vLLM / side"], rows),
        f"Warm-up check: {agree}.",
        f"The ceiling is the machine's matmul throughput divided by the forward FLOPs per token (2 x "
        f"{num(cap['decoder_params'] / 1e6, 1)}M decoder weights + causal attention at these sequence lengths = "
        f"{num(cap['flops_per_token'] / 1e6, 1)} MFLOP). The throughput is the faster kernel's on {ceil['size']}x{ceil['size']} "
        f"matrices with {ceil['threads']} threads, measured in every repetition between the two capture sides, and the "
        "share of the ceiling is taken per repetition:",
        table(["dtype", *[f"{k} GFLOP/s" for k in ceil["kernels"]["float32"]], "peak GFLOP/s"],
              [[d, *[med(_gflops(f)) for f in ceil["kernels"][d].values()], med(_gflops(ceil["flops_per_s"][d]))]
               for d in ceil["flops_per_s"]]),
        "`torch` is torch.matmul (MKL for float32), `onednn` the oneDNN GEMM that vLLM's CPU linear layers run.",
    )


def _gflops(figure: dict[str, Any] | str) -> dict[str, Any] | str:
    if not is_available(figure):
        return figure
    return {k: (v / 1e9 if k in ("median", "min", "max") else v) for k, v in figure.items()}


def _generation_section(results: dict[str, Any]) -> list[str]:
    gen = results["generation"]
    rows = [
        [f"vLLM offline engine, batch {gen['batch_size']}, {gen['max_tokens']} max tokens *pipeline run*",
         num(gen["output_tokens_per_s"], 1), "-"],
        *([f"ceiling: {dtype} matmul peak / FLOPs per output token",
           *ceiling_cells(gen["ceiling_tokens_per_s"][dtype], gen["fraction_of_ceiling"][dtype])]
          for dtype in ("float32", "bfloat16")),
    ]
    return section(
        "## 2. Generation (stage 01)",
        f"{num(gen['completion_tokens'])} answer tokens for {gen['samples']} prompts in {num(gen['generation_seconds'])} s "
        "(engine start not counted), from the pipeline run's stage 01 manifest. FLOPs per output token: decoder + "
        f"lm_head + attention, with each prompt's prefill spread over its answer: {num(gen['flops_per_token'] / 1e6, 1)} MFLOP.",
        table(["", "output tokens/s", "share of the ceiling"], rows),
    )


def _training_section(results: dict[str, Any]) -> list[str]:
    train = results["training"]
    rows = []
    for name, label in (("bf16", "bf16 storage"), ("fp8", "fp8 storage"), ("pipeline", "the pipeline run's own *pipeline run*")):
        t = train[name]
        rows.append([label, str(t["epochs"]), num(t["tokens_per_s_median_step"]), num(t["steps_per_s"], 2),
                     num(t["peak_rss_mb"]), num(t["wall_s"]),
                     " / ".join(f"{a:.3f}" for a in t["val_full_acc"]) or "-"])
    return section(
        "## 3. Training (stage 04)",
        f"The two drafters of figure 5's storage comparison: the same conversations (the first "
        f"{results['storage']['bf16']['samples']} of the pipeline run's), vocabulary, seed and settings "
        f"({plural(train['bf16']['epochs'], 'epoch')}), only the stored hidden states differ. They train one after the other (a "
        "run cannot be paused between steps without changing it), so their ratio is not interleaved; tokens/s is the "
        "median over optimizer steps of each step's rate. Steps/s counts step time only (batch, forward, backward, "
        "optimizer); wall time adds start-up, validation and checkpoints. Peak memory is the training process's "
        f"maximum RSS. Ratio bf16 / fp8 tokens/s: {ratio(train['ratio_bf16_over_fp8'])}.",
        table(["run", "epochs", "tokens/s", "steps/s", "peak RSS MB", "wall s", "validation full acc per position"], rows),
    )


def _serving_section(results: dict[str, Any]) -> list[str]:
    serve = results["serving"]
    labels = {"none": "no speculation", "ngram": "n-gram", "eagle3": "EAGLE-3, the pipeline's drafter"}
    eagle = serve["modes"].get("eagle3", {})
    lines = section(
        "## 4. Serving (stage 06's measurement, interleaved)",
        f"{serve['num_prompts']} held-out prompts, {serve['max_tokens']} tokens each, temperature {serve['temperature']}, "
        f"concurrency {serve['concurrency']}, {results['meta']['num_speculative_tokens']} speculative tokens. One vLLM "
        f"server per row, all up at once; the prompts go in {plural(serve['rounds'], 'round')}, each round's chunk to every server "
        "in turn (order rotating), so each ratio to no speculation compares the same prompts back to back. "
        "Acceptance comes from the servers' spec-decode counters, as in stage 06.",
        table(["server", "output tokens/s", "ratio to none", *SERVING_COLUMNS], _serving_rows(serve, labels)),
    )
    if results["meta"].get("device") == "cpu" and (eagle.get("ratio_to_baseline") or {}).get("median", 2) < 1:
        lines += ["On a CPU a target this small decodes about as fast as the drafter's extra forward passes cost, so "
                  "even a good drafter does not speed it up here; the speed-up figure matters on the GPU host.", ""]
    pipe = results["pipeline"]["serving"]
    if pipe.get("mean_acceptance_length") is not None:
        lines += [f"The pipeline run's own stage 06 (one pass per mode, one after another) measured a mean acceptance "
                  f"length of {num(pipe['mean_acceptance_length'], 3)} and tokens/s "
                  + ", ".join(f"{k} {num(v, 1)}" for k, v in (pipe.get("tokens_per_s") or {}).items() if v is not None)
                  + (f"; its verdict: {pipe['verdict']}" if pipe.get("verdict") else "") + ".", ""]
    return lines


SERVING_COLUMNS = ["mean acceptance length", "acceptance per position", "greedy texts differing from none"]


def _serving_rows(serve: dict[str, Any], labels: dict[str, str]) -> list[list[str]]:
    rows = []
    for name, m in serve["modes"].items():
        per = m.get("per_position_acceptance") or []
        rows.append([
            labels.get(name, name), med(m["tokens_per_s"], 1),
            "1.00x" if name == serve["baseline"] else med(m["ratio_to_baseline"], 2, fmt=ratio),
            num(m.get("mean_acceptance_length"), 3), " / ".join(f"{p:.3f}" for p in per) or "-",
            "-" if m.get("greedy_mismatches") is None else f"{len(m['greedy_mismatches'])} of {serve['num_prompts']}",
        ])
    return rows


def _storage_section(results: dict[str, Any]) -> list[str]:
    store, fp8 = results["storage"], results["fp8_cost"]
    rows = []
    for name in ("bf16", "fp8"):
        s = store[name]
        rows.append([name, num(s["bytes_per_token"]), num(s["bytes_per_1k_samples"] / 1e6, 1), str(s["samples"]),
                     num(s["tokens"])])
    b = store["bf16"]
    return section(
        "## 5. Storage of training data, and what fp8 storage costs",
        f"Stage 02 output of the same {b['samples']} conversations stored both ways (`hidden_states.storage_dtype`), "
        f"{b['num_hidden_states']} states x {b['hidden_size']} per token, so {b['num_hidden_states'] * b['hidden_size'] * 2:,} B "
        f"of bf16 or {b['num_hidden_states'] * b['hidden_size']:,} B of fp8 (+ a 4 B scale) before the token ids and file "
        f"headers, which the measured bytes include. Per 1k samples at this data's {num(b['tokens'] / b['samples'])} tokens per sample. "
        f"fp8 / bf16: {ratio(store['ratio_fp8_over_bf16'])}.",
        table(["storage", "bytes per token", "MB per 1k samples", "samples", "tokens"], rows),
        f"What it costs: the two {fp8['epochs']}-epoch drafters of figure 3, converted for vLLM and served like figure "
        "4 (the same prompts and settings, both servers up, rounds interleaved). Mean acceptance length with bf16 "
        f"storage {num(fp8['bf16'], 3)}, with fp8 storage {num(fp8['fp8'], 3)}: difference {fp8['difference']:+.3f} "
        f"± {num(fp8['stderr'], 3)} (one standard error, treating draft steps as independent). {fp8['verdict']}",
        table(["drafter", "output tokens/s", "ratio to bf16", *SERVING_COLUMNS],
              _serving_rows(results["storage_serving"], {"eagle3-bf16": "bf16 storage", "eagle3-fp8": "fp8 storage"})),
    )


def _pipeline_section(results: dict[str, Any]) -> list[str]:
    pipe = results["pipeline"]
    total = pipe["total_wall_s"] or 0
    rows = [[name, num(s, 1), f"{s / total:.0%}" if s and total else "-"] for name, s in pipe["stages_wall_s"].items()]
    rows.append(["total", num(total, 1), "100%"])
    return section(
        "## 6. Whole pipeline *pipeline run*",
        f"`wall_time_s` of each stage's manifest in `{pipe['run_dir']}` (finished {pipe['finished_at']}), the run that "
        "`scripts/run_pipeline.sh` made; the lines it prints also include each interpreter's start-up, and its "
        "first run in a new checkout also builds `.venv/`.",
        table(["stage", "wall time s", "share"], rows),
    )


def _parts_section(results: dict[str, Any]) -> list[str]:
    parts = results["meta"]["parts_s"]
    rows = [[name, num(s, 1)] for name, s in parts.items()]
    rows.append(["total", num(results["meta"]["total_s"], 1)])
    return section("## How long the benchmark took", table(["part", "seconds"], rows))


def _reproduce_section(results: dict[str, Any]) -> list[str]:
    meta = results["meta"]
    return section(
        "## How to reproduce",
        'From the repository\'s root, on a machine of the same kind (docs/engines.md, "Machines differ": figures '
        "from another kind of machine are not comparable):",
        ["```bash",
         f"{meta['pipeline_command']}    # the finished run this file reads: {meta['pipeline_run']}",
         f"{meta['command']}    # measures the rest, rewrites this file",
         "```"],
    )
