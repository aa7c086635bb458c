"""Reproduce every figure of BENCHMARKS.md on a finished pipeline run, and rewrite it.

    scripts/run_benchmarks.sh configs/tiny.yaml            # full: ~20 min on an idle 2-core machine
    scripts/run_benchmarks.sh configs/tiny.yaml --quick    # every part once, as small as it runs (a smoke test)
    python -m bench.run --config configs/tiny.yaml [...]   # what the script runs

Needs the finished run of the same config (`scripts/run_pipeline.sh CONFIG`), which it only reads: stage
wall times, generation speed and the trained drafter come from there. Everything else (hidden-state capture
against HF transformers with the matmul ceiling, two drafters that differ only in how their training data is
stored, serving) it measures in its own work folder (`<data_root>/<run_name>-bench/`, emptied at the start), as
BENCHMARKS.md's sections say. Then BENCHMARKS.md (or --out) and benchmarks.json in the work folder, and the
checks of bench/checks.py: a part that measured nothing, or a figure missing from the document, ends the
command with exit 1 (after both files are written), in either mode.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

from bench import arms, checks, drift, figures, flops, report
from bench.arms import ARMS, REPO
from bench.capture_ab import capture_ab
from bench.serve_ab import serve_interleaved
from bench.stats import ratio_or_none
from eagle_pipeline import atomic
from eagle_pipeline.config import RunConfig, load_config
from eagle_pipeline.stage import package_versions, read_manifest

TUNABLE = ("epochs", "repetitions", "capture_samples", "arm_samples")  # Settings that a command-line option sets


@dataclass
class Settings:
    """How much of everything to measure; --quick shrinks it all to check that every part runs."""

    matmul_size: int
    matmul_seconds: float
    repetitions: int
    capture_samples: int
    arm_samples: int  # the storage drafters train on the pipeline run's first conversations
    epochs: int
    serve_prompts: int | None  # None: the config's data.num_eval_prompts
    serve_max_tokens: int | None  # None: the config's serve.max_tokens
    # The arm that stores states as the pipeline run did starts from that run's captured states, so its
    # stage 02 resumes without an engine; the other arm still captures through vLLM.
    reuse_pipeline_states: bool

    @classmethod
    def for_mode(cls, quick: bool) -> "Settings":
        if quick:
            # Every part once: one repetition and round, one capture batch, one epoch; two prompts (sent
            # concurrently, so hardly slower than one) with room for a few drafts, so that n-gram finds a
            # match to draft from. The time left is mostly engine and server start-up.
            return cls(matmul_size=256, matmul_seconds=0.05, repetitions=1, capture_samples=2, arm_samples=6, epochs=1,
                       serve_prompts=2, serve_max_tokens=16, reuse_pipeline_states=True)
        # The two storage drafters dominate the time (stages 02 and 04, twice): 300 samples x 3 epochs each
        # keeps the whole benchmark near 20 minutes on a 2-core machine.
        return cls(matmul_size=2048, matmul_seconds=1.0, repetitions=3, capture_samples=64, arm_samples=300, epochs=3,
                   serve_prompts=None, serve_max_tokens=None, reuse_pipeline_states=False)


class Log:
    def __init__(self, path: Path):
        self.path = path

    def __call__(self, message: str) -> None:
        line = f"[{dt.datetime.now(dt.timezone.utc):%H:%M:%S}] {message}"
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


@contextmanager
def timed(parts: dict[str, float], name: str, log: Log) -> Iterator[None]:
    log(f"--- {name}")
    started = time.monotonic()
    yield
    parts[name] = round(time.monotonic() - started, 1)
    log(f"--- {name}: {parts[name]:.0f} s")


def machine() -> dict[str, Any]:
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)), "ram_gib": ram,
            "os": f"{platform.system()} {platform.release()}"}


def relative(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def measure_capture(cfg: RunConfig, verifier, manifests: dict, settings: Settings, work: Path, log: Log) -> dict[str, Any]:
    """Parts 1-2: capture A/B with the matmul ceiling between its sides; the ceiling goes under "matmul"."""
    from datasets import load_from_disk

    from eagle_pipeline.engine import apply_engine_env, llm_kwargs

    data = load_from_disk(str(cfg.stage_dir("02_extract_hidden") / "data")).with_format(None)
    sequences = [[int(t) for t in row["input_ids"]] for row in data.select(range(min(settings.capture_samples, len(data))))]
    apply_engine_env(cfg)
    capture = capture_ab(
        verifier.path, manifests["02_extract_hidden"]["counts"]["layer_ids"], sequences,
        num_layers=verifier.num_layers, engine_kwargs=llm_kwargs(cfg, str(verifier.path)),
        batch_size=cfg.hidden_states.batch_size, repetitions=settings.repetitions,
        storage_path=work / "capture_scratch", matmul_size=settings.matmul_size,
        matmul_seconds=settings.matmul_seconds, log=log)
    shutil.rmtree(work / "capture_scratch", ignore_errors=True)
    text_config = verifier.text_config()
    capture["decoder_params"] = flops.decoder_matmul_params(text_config)
    capture["flops_per_token"] = flops.prefill_flops_per_token(text_config, [len(s) for s in sequences])
    capture["ceiling_tokens_per_s"] = flops.ceiling_tokens_per_s(capture["matmul"], capture["flops_per_token"])
    capture["fraction_of_ceiling"] = flops.share_of_ceiling_per_repetition(
        capture["tokens_per_s"]["vllm"]["values"], capture["matmul"], capture["flops_per_token"])
    return capture


def make_storage_drafters(args: argparse.Namespace, cfg: RunConfig, vocab_size: int, settings: Settings, work: Path,
                          parts: dict[str, float], log: Log) -> None:
    """Part 3: stages 02-04 for each arm, then each drafter converted for vLLM."""
    pipeline_storage = read_manifest(cfg.stage_dir("02_extract_hidden"))["config"]["hidden_states"]["storage_dtype"]
    overrides = {}
    for arm, storage in ARMS.items():
        samples = arms.copy_conversations(cfg.stage_dir("01_generate_data"), work / arm / "01_generate_data", settings.arm_samples)
        if settings.reuse_pipeline_states and storage == pipeline_storage:
            arms.copy_captured_states(cfg.stage_dir("02_extract_hidden"), work / arm / "02_extract_hidden", samples)
        overrides[arm] = [*args.overrides, f"data_root={work}", f"run_name={arm}", f"data.num_samples={samples}",
                          f"hidden_states.storage_dtype={storage}", f"train.epochs={settings.epochs}"]
    for script in ("02_extract_hidden", "03_build_vocab_map", "04_train"):
        for arm in ARMS:
            with timed(parts, f"{arm}: {script}", log):
                arms.run_stage(script, str(Path(args.config).resolve()), overrides[arm], work / "logs" / f"{arm}-{script}.log", log)
    with timed(parts, "convert both drafters", log):
        for arm in ARMS:
            arms.convert_drafter(work / arm, work / arm / "drafter-vllm", vocab_size)


def measure_serving(cfg: RunConfig, target: Path, settings: Settings, work: Path, parts: dict[str, float],
                    log: Log) -> tuple[dict[str, Any], dict[str, Any]]:
    """Part 4: (the pipeline's drafter against none and n-gram, the two storage drafters against each other)."""
    from eagle_pipeline.engine import server_kwargs
    from eagle_pipeline.prompts import load_prompts
    from eagle_pipeline.serve.measure import speculative_config_for
    from eagle_pipeline.serve.plan import greedy_mismatches

    s = cfg.serve
    num_prompts = settings.serve_prompts or cfg.data.num_eval_prompts
    prompts = load_prompts(cfg.resolve_path(cfg.data.eval_prompts), cfg.data.prompt_field, "data.eval_prompts")[:num_prompts]
    spec = {"num_speculative_tokens": s.num_speculative_tokens}
    serve_args = dict(rounds=settings.repetitions, max_tokens=settings.serve_max_tokens or s.max_tokens,
                      temperature=s.temperature, concurrency=s.concurrency_levels[-1], seed=cfg.seed,
                      log_dir=work / "logs", log=log, **server_kwargs(cfg))
    messages = [p["messages"] for p in prompts]
    # Two groups, so that at most three servers (a few GB each) are up at once: the figure-4 comparison
    # against no speculation, then the two storage drafters against each other.
    with timed(parts, "serving: none, n-gram, pipeline drafter", log):
        served = serve_interleaved(target, {
            "none": None,
            "ngram": speculative_config_for("ngram", **spec),
            "eagle3": speculative_config_for("eagle3", drafter_dir=cfg.stage_dir("05_convert") / "vllm", **spec),
        }, messages, **serve_args)
    with timed(parts, "serving: bf16 and fp8 storage drafters", log):
        storage_served = serve_interleaved(target, {
            f"eagle3-{arm}": speculative_config_for("eagle3", drafter_dir=work / arm / "drafter-vllm", **spec)
            for arm in ARMS
        }, messages, **serve_args)
    texts = {**served.pop("texts"), **storage_served.pop("texts")}
    atomic.write_json(work / "serving_texts.json", texts)
    if s.temperature == 0:
        # Greedy decoding: a drafter must never change the text the target alone writes.
        for group in (served, storage_served):
            for name, mode in group["modes"].items():
                if mode["speculative_config"] is not None:
                    mode["greedy_mismatches"] = greedy_mismatches(texts["none"], texts[name])
    return served, storage_served


def run(args: argparse.Namespace) -> None:
    cfg: RunConfig = load_config(args.config, args.overrides)
    manifests = figures.read_pipeline_run(cfg, args.config)
    settings = Settings.for_mode(args.quick)
    for name in TUNABLE:
        if getattr(args, name) is not None:
            setattr(settings, name, getattr(args, name))
    work = arms.work_dir(args, cfg, "bench-quick" if args.quick else "bench")
    out_md = Path(args.out).resolve() if args.out else (work / "BENCHMARKS.md" if args.quick else REPO / "BENCHMARKS.md")
    arms.prepare_work_dir(work)
    log = Log(work / "benchmark.log")
    started = time.monotonic()
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    log(f"benchmark ({'quick' if args.quick else 'full'} mode) of {cfg.run_dir} in {work}: {asdict(settings)}")

    import torch  # noqa: F401 - imported here so that no part's time includes loading it

    from eagle_pipeline.verifier import Verifier

    verifier = Verifier.from_config(cfg)
    pipeline = figures.pipeline_figures(manifests, cfg.run_dir)
    parts: dict[str, float] = {}

    with timed(parts, "capture A/B and matmul ceiling", log):
        capture = measure_capture(cfg, verifier, manifests, settings, work, log)
    peak = capture.pop("matmul")
    make_storage_drafters(args, cfg, verifier.vocab_size, settings, work, parts, log)
    served, storage_served = measure_serving(cfg, verifier.path, settings, work, parts, log)

    gen = pipeline["generation"]
    gen["flops_per_token"] = flops.generation_flops_per_output_token(
        verifier.text_config(), gen["prompt_tokens"], gen["completion_tokens"], gen["samples"])
    gen["ceiling_tokens_per_s"] = flops.ceiling_tokens_per_s(peak, gen["flops_per_token"])
    gen["fraction_of_ceiling"] = flops.share_of_ceiling(gen["output_tokens_per_s"], gen["ceiling_tokens_per_s"])
    training = {arm: figures.training_figures(read_manifest(work / arm / "04_train"), work / arm / "04_train") for arm in ARMS}
    training["pipeline"] = pipeline["training"]
    training["ratio_bf16_over_fp8"] = ratio_or_none(training["bf16"]["tokens_per_s_median_step"],
                                                    training["fp8"]["tokens_per_s_median_step"])
    storage = {arm: figures.storage_figures(read_manifest(work / arm / "02_extract_hidden")) for arm in ARMS}
    storage["ratio_fp8_over_bf16"] = ratio_or_none(storage["fp8"]["bytes_per_token"], storage["bf16"]["bytes_per_token"])

    total = time.monotonic() - started
    json_path = work / "benchmarks.json"
    results = {
        "meta": {
            "command": command_line(args),
            "pipeline_command": command_line(args, "scripts/run_pipeline.sh"),
            "mode": "quick" if args.quick else "full",
            "settings": asdict(settings),
            "date": date,
            "machine": machine(),
            "versions": package_versions(),
            "config": relative(Path(args.config)),
            "verifier": cfg.verifier.path,
            "dtype": cfg.verifier.dtype,
            "device": cfg.device,
            "num_speculative_tokens": cfg.serve.num_speculative_tokens,
            "pipeline_run": relative(cfg.run_dir),
            "work_dir": relative(work),
            "json": relative(json_path),
            "parts_s": parts,
            "total_s": total,
        },
        "ceiling": peak,
        "capture": capture,
        "generation": gen,
        "training": training,
        "serving": served,
        "storage_serving": storage_served,
        "storage": storage,
        "fp8_cost": figures.fp8_cost(storage_served["modes"], settings.epochs, cfg.hidden_states.storage_dtype),
        "pipeline": pipeline,
    }
    published = (REPO / "BENCHMARKS.md").read_text() if (REPO / "BENCHMARKS.md").exists() else None
    write_and_check(results, json_path, out_md, published=published, log=log)
    log(f"wrote {out_md} and {json_path} in {total / 60:.1f} min; parts (s): {json.dumps(parts)}")


def write_and_check(results: dict[str, Any], json_path: Path, out_md: Path, *, published: str | None = None,
                    log=print) -> None:
    """Both files, then how the figures compare with `published` (BENCHMARKS.md as it was before this run:
    bench/drift.py), then the checks: what is missing is named, with the files there to look at."""
    text = report.render_markdown(results)
    atomic.write_json(json_path, results)
    atomic.write_text(out_md, text)
    if published is not None:
        for line in drift.compare(published, text, quick=results["meta"]["mode"] == "quick"):
            log(line)
    missing = checks.missing_figures(results) + checks.document_problems(text)
    if missing:
        raise arms.IncompleteFigures(f"{out_md} and {json_path} lack figures: " + "; ".join(missing))


def command_line(args: argparse.Namespace, script: str = "scripts/run_benchmarks.sh") -> str:
    """The README command that repeats this run, or (scripts/run_pipeline.sh) that makes the finished run it reads."""
    benchmark = script == "scripts/run_benchmarks.sh"
    words = [script, args.config, *(["--quick"] if benchmark and args.quick else [])]
    for assignment in args.overrides:
        words += ["--set", assignment]
    for name in ("out", "work_dir", *TUNABLE) if benchmark else ():
        if getattr(args, name) is not None:
            words += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return shlex.join(words)


def main(argv: list[str] | None = None) -> int:
    parser = arms.parser("python -m bench.run", __doc__, "bench")
    parser.add_argument("--quick", action="store_true",
                        help="every part once on the fewest samples, prompts and epochs (minutes): checks that it "
                             "all runs; writes into the work folder unless --out is given")
    parser.add_argument("--out", help="markdown file to write (default: BENCHMARKS.md; with --quick: in the work folder)")
    parser.add_argument("--epochs", type=int, help="training epochs of the two storage drafters (default 3; quick 1)")
    parser.add_argument("--repetitions", type=int, help="interleaved repetitions and serving rounds (default 3; quick 1)")
    parser.add_argument("--capture-samples", type=int, help="samples in the capture A/B (default 64; quick 2)")
    parser.add_argument("--arm-samples", type=int, help="conversations the two storage drafters train on (default 300; quick 6)")
    args = parser.parse_args(argv)
    return arms.run_command(run, args, interrupted="no figures written",
                            logs="logs in the work folder's logs/ and benchmark.log")


if __name__ == "__main__":
    sys.exit(main())
