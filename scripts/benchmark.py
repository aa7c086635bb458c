"""Reproduce every figure of BENCHMARKS.md on a finished pipeline run, and rewrite it.

    scripts/run_benchmarks.sh configs/tiny.yaml            # full: ~20 min on an idle 2-core machine
    scripts/run_benchmarks.sh configs/tiny.yaml --quick    # every part on a few samples (a smoke test)

Needs the finished run of the same config (`scripts/run_pipeline.sh CONFIG`), which it only reads: stage
wall times, generation speed and the trained drafter come from there. Everything else it measures itself,
in its own work folder (`<data_root>/<run_name>-bench/`, emptied at the start):
  1. hidden-state capture, vLLM (stage 02's path) against HF transformers, interleaved;
  2. in the same rounds, matmul throughput (float32, bfloat16; torch's and vLLM's oneDNN kernel): the
     compute ceiling;
  3. two drafters that differ only in how their training data is stored (bf16, fp8): stages 02-04 run
     for real on copies of the pipeline's conversations, then converted for vLLM;
  4. serving: no speculation, n-gram and the pipeline's drafter, then the two drafters of 3; within each
     group every server is up at once and each round of prompts goes to each server in turn.
Then BENCHMARKS.md (or --out) and benchmarks.json in the work folder.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from eagle_pipeline import atomic, benchmark_report, benchmarks  # noqa: E402
from eagle_pipeline.config import RunConfig, load_config  # noqa: E402
from eagle_pipeline.errors import BadInput  # noqa: E402
from eagle_pipeline.stage import package_versions, read_manifest  # noqa: E402

WORK_MARKER = ".benchmark-work-dir"
ARMS = {"bf16": "bfloat16", "fp8": "fp8"}  # arm name -> hidden_states.storage_dtype


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

    @classmethod
    def for_mode(cls, quick: bool) -> "Settings":
        if quick:
            return cls(matmul_size=512, matmul_seconds=0.2, repetitions=1, capture_samples=4, arm_samples=6, epochs=1,
                       serve_prompts=2, serve_max_tokens=16)
        # The two storage drafters dominate the time (stages 02 and 04, twice): 300 samples x 3 epochs each
        # keeps the whole benchmark near 20 minutes on a 2-core machine.
        return cls(matmul_size=2048, matmul_seconds=1.0, repetitions=3, capture_samples=64, arm_samples=300, epochs=3,
                   serve_prompts=None, serve_max_tokens=None)


# --------------------------------------------------------------------------------------------------------
# Logging and timing


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


# --------------------------------------------------------------------------------------------------------
# The work folder and the two storage arms


def prepare_work_dir(path: Path) -> None:
    """Empty the work folder of an earlier benchmark; refuse a folder that is not one."""
    if path.exists():
        if any(path.iterdir()) and not (path / WORK_MARKER).exists():
            raise BadInput(f"--work-dir: {path} exists and is not a benchmark work folder; choose an empty or new folder")
        shutil.rmtree(path)
    (path / "logs").mkdir(parents=True)
    (path / WORK_MARKER).write_text("made by scripts/benchmark.py; emptied by every run\n")


def copy_conversations(source_stage: Path, target_stage: Path, num_samples: int) -> int:
    """Start an arm from the pipeline's finished stage 01: its first `num_samples` conversations."""
    from datasets import load_from_disk

    conversations = load_from_disk(str(source_stage / "conversations"))
    if num_samples < len(conversations):
        conversations = conversations.select(range(num_samples))
    target_stage.mkdir(parents=True)
    conversations.save_to_disk(str(target_stage / "conversations"))
    manifest = read_manifest(source_stage)
    manifest["counts"] = {**manifest["counts"], "samples": len(conversations), "copied_from": str(source_stage)}
    atomic.write_json(target_stage / "manifest.json", manifest)
    return len(conversations)


def run_stage(script: str, config: str, overrides: list[str], log_path: Path, log: Log) -> None:
    """One stage script as its own process (as the pipeline runs it); its output goes to log_path."""
    command = [sys.executable, str(REPO / f"{script}.py"), "--config", config]
    for assignment in overrides:
        command += ["--set", assignment]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    with open(log_path, "w") as out:
        out.write("$ " + " ".join(command) + "\n")
        out.flush()
        result = subprocess.run(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-15:])
        log(tail)
        raise RuntimeError(f"{script} exited with {result.returncode}; its output: {log_path}")


def convert_drafter(run_dir: Path, out_dir: Path, vocab_size: int) -> None:
    """The arm's drafter in vLLM's format, from the checkpoint stage 05 would pick (best, else last)."""
    from eagle_pipeline.convert import convert_for_vllm

    trained = read_manifest(run_dir / "04_train")
    best = trained["counts"].get("best") or {}
    checkpoint = run_dir / "04_train" / (best.get("checkpoint") or trained["counts"]["last_checkpoint"])
    convert_for_vllm(checkpoint, out_dir, target_vocab_size=vocab_size, layer_ids=trained["inputs"]["layer_ids"])


# --------------------------------------------------------------------------------------------------------
# Machine and figures


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


def ceilings(peak: dict[str, Any], flops_per_token: float, measured: float | None) -> tuple[dict, dict]:
    """Tokens/s the median matmul peak allows at flops_per_token, and the measured rate's share of it."""
    tokens = {d: f["median"] / flops_per_token for d, f in peak["flops_per_s"].items()}
    return tokens, {d: (measured / t if measured is not None else None) for d, t in tokens.items()}


def fp8_cost(modes: dict[str, Any], epochs: int, default_storage: str) -> dict[str, Any]:
    bf16, fp8 = modes["eagle3-bf16"], modes["eagle3-fp8"]
    a, b = bf16["mean_acceptance_length"], fp8["mean_acceptance_length"]
    se_a, se_b = bf16["mean_acceptance_length_stderr"], fp8["mean_acceptance_length_stderr"]
    difference = (b - a) if a is not None and b is not None else None
    stderr = (se_a**2 + se_b**2) ** 0.5 if se_a is not None and se_b is not None else None
    return {"epochs": epochs, "bf16": a, "fp8": b, "difference": difference, "stderr": stderr,
            "verdict": benchmark_report.fp8_verdict(difference, stderr, a, default_storage)}


def relative(path: Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


# --------------------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> None:
    cfg: RunConfig = load_config(args.config, args.overrides)
    manifests = benchmark_report.read_pipeline_run(cfg, args.config)
    settings = Settings.for_mode(args.quick)
    for name in ("epochs", "repetitions", "capture_samples", "arm_samples"):
        if getattr(args, name) is not None:
            setattr(settings, name, getattr(args, name))
    work = Path(args.work_dir).resolve() if args.work_dir else cfg.resolve_path(cfg.data_root) / (
        f"{cfg.run_name}-bench" + ("-quick" if args.quick else ""))
    out_md = Path(args.out).resolve() if args.out else (work / "BENCHMARKS.md" if args.quick else REPO / "BENCHMARKS.md")
    prepare_work_dir(work)
    log = Log(work / "benchmark.log")
    started = time.monotonic()
    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    log(f"benchmark ({'quick' if args.quick else 'full'} mode) of {cfg.run_dir} in {work}: {asdict(settings)}")

    import torch  # noqa: F401 - imported here so that no part's time includes loading it

    from eagle_pipeline.engine import apply_engine_env, server_kwargs
    from eagle_pipeline.verifier import Verifier

    verifier = Verifier.from_config(cfg)
    text_config = verifier.text_config()
    pipeline = benchmark_report.pipeline_figures(manifests, cfg.run_dir)
    parts: dict[str, float] = {}

    # -- 1-2. capture: vLLM against HF transformers, and the matmul ceiling between them -------------------
    with timed(parts, "capture A/B and matmul ceiling", log):
        from datasets import load_from_disk

        data = load_from_disk(str(cfg.stage_dir("02_extract_hidden") / "data")).with_format(None)
        sequences = [[int(t) for t in row["input_ids"]] for row in data.select(range(min(settings.capture_samples, len(data))))]
        layer_ids = manifests["02_extract_hidden"]["counts"]["layer_ids"]
        apply_engine_env(cfg)
        capture = benchmarks.capture_ab(
            verifier.path, layer_ids, sequences, num_layers=verifier.num_layers, dtype=cfg.verifier.dtype,
            max_model_len=cfg.verifier.max_model_len, batch_size=cfg.hidden_states.batch_size,
            repetitions=settings.repetitions, tensor_parallel_size=cfg.verifier.tensor_parallel_size,
            trust_remote_code=cfg.verifier.trust_remote_code,
            engine_args={**({"enable_expert_parallel": True} if cfg.verifier.enable_expert_parallel else {}),
                         **cfg.verifier.engine_args},
            storage_path=work / "capture_scratch", matmul_size=settings.matmul_size,
            matmul_seconds=settings.matmul_seconds, log=log)
        shutil.rmtree(work / "capture_scratch", ignore_errors=True)
    capture["decoder_params"] = benchmarks.decoder_matmul_params(text_config)
    capture["flops_per_token"] = benchmarks.prefill_flops_per_token(text_config, [len(s) for s in sequences])
    peak = capture.pop("matmul")
    capture["ceiling_tokens_per_s"] = {d: f["median"] / capture["flops_per_token"] for d, f in peak["flops_per_s"].items()}
    # Each repetition's capture rate against the ceiling measured in the same repetition.
    capture["fraction_of_ceiling"] = {
        d: statistics.median(r * capture["flops_per_token"] / p
                             for r, p in zip(capture["tokens_per_s"]["vllm"]["values"], f["values"]))
        for d, f in peak["flops_per_s"].items()}

    # -- 3. two drafters, bf16 and fp8 storage ------------------------------------------------------------
    arm_overrides = {}
    for arm, storage in ARMS.items():
        samples = copy_conversations(cfg.stage_dir("01_generate_data"), work / arm / "01_generate_data", settings.arm_samples)
        arm_overrides[arm] = [*args.overrides, f"data_root={work}", f"run_name={arm}", f"data.num_samples={samples}",
                              f"hidden_states.storage_dtype={storage}", f"train.epochs={settings.epochs}"]
    for script in ("02_extract_hidden", "03_build_vocab_map", "04_train"):
        for arm in ARMS:
            with timed(parts, f"{arm}: {script}", log):
                run_stage(script, str(Path(args.config).resolve()), arm_overrides[arm], work / "logs" / f"{arm}-{script}.log", log)
    with timed(parts, "convert both drafters", log):
        for arm in ARMS:
            convert_drafter(work / arm, work / arm / "drafter-vllm", verifier.vocab_size)

    # -- 4. serving, interleaved --------------------------------------------------------------------------
    from eagle_pipeline.prompts import load_prompts
    from eagle_pipeline.serve.measure import greedy_mismatches, speculative_config_for

    s = cfg.serve
    num_prompts = settings.serve_prompts or cfg.data.num_eval_prompts
    prompts = load_prompts(cfg.resolve_path(cfg.data.eval_prompts), cfg.data.prompt_field, "data.eval_prompts")[:num_prompts]
    spec = {"num_speculative_tokens": s.num_speculative_tokens}
    serve_args = dict(rounds=settings.repetitions, max_tokens=settings.serve_max_tokens or s.max_tokens,
                      temperature=s.temperature, concurrency=s.concurrency, seed=cfg.seed,
                      log_dir=work / "logs", log=log, **server_kwargs(cfg))
    messages = [p["messages"] for p in prompts]
    # Two groups, so that at most three servers (a few GB each) are up at once: the figure-4 comparison
    # against no speculation, then the two storage drafters against each other.
    with timed(parts, "serving: none, n-gram, pipeline drafter", log):
        served = benchmarks.serve_interleaved(verifier.path, {
            "none": None,
            "ngram": speculative_config_for("ngram", **spec),
            "eagle3": speculative_config_for("eagle3", drafter_dir=cfg.stage_dir("05_convert") / "vllm", **spec),
        }, messages, **serve_args)
    with timed(parts, "serving: bf16 and fp8 storage drafters", log):
        storage_served = benchmarks.serve_interleaved(verifier.path, {
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

    # -- figures ------------------------------------------------------------------------------------------
    gen = pipeline["generation"]
    gen["flops_per_token"] = benchmarks.generation_flops_per_output_token(
        text_config, gen["prompt_tokens"], gen["completion_tokens"], gen["samples"])
    gen["ceiling_tokens_per_s"], gen["fraction_of_ceiling"] = ceilings(peak, gen["flops_per_token"], gen["output_tokens_per_s"])
    training = {arm: benchmark_report.training_figures(read_manifest(work / arm / "04_train"), work / arm / "04_train")
                for arm in ARMS}
    training["pipeline"] = pipeline["training"]
    training["ratio_bf16_over_fp8"] = _ratio(training["bf16"]["tokens_per_s_median_step"],
                                             training["fp8"]["tokens_per_s_median_step"])
    storage = {arm: benchmark_report.storage_figures(read_manifest(work / arm / "02_extract_hidden")) for arm in ARMS}
    storage["ratio_fp8_over_bf16"] = _ratio(storage["fp8"]["bytes_per_token"], storage["bf16"]["bytes_per_token"])

    total = time.monotonic() - started
    json_path = work / "benchmarks.json"
    results = {
        "meta": {
            "command": command_line(args),
            "mode": "quick" if args.quick else "full",
            "settings": asdict(settings),
            "date": date,
            "machine": machine(),
            "versions": package_versions(),
            "config": relative(Path(args.config)),
            "verifier": cfg.verifier.path,
            "dtype": cfg.verifier.dtype,
            "device": cfg.device,
            "num_speculative_tokens": s.num_speculative_tokens,
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
        "fp8_cost": fp8_cost(storage_served["modes"], settings.epochs, cfg.hidden_states.storage_dtype),
        "pipeline": pipeline,
    }
    atomic.write_json(json_path, results)
    atomic.write_text(out_md, benchmark_report.render_markdown(results))
    log(f"wrote {out_md} and {json_path} in {total / 60:.1f} min; parts (s): {json.dumps(parts)}")


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def command_line(args: argparse.Namespace) -> str:
    """The README command that repeats this run."""
    words = ["scripts/run_benchmarks.sh", args.config, *(["--quick"] if args.quick else [])]
    for assignment in args.overrides:
        words += ["--set", assignment]
    for name in ("out", "work_dir", "epochs", "repetitions", "capture_samples", "arm_samples"):
        if getattr(args, name) is not None:
            words += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return shlex.join(words)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the config of the finished pipeline run (e.g. configs/tiny.yaml)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, as for the stage scripts (applies to the run read and the runs made)")
    parser.add_argument("--quick", action="store_true",
                        help="a few samples, one repetition, one epoch: checks that every part runs (minutes); "
                             "writes into the work folder unless --out is given")
    parser.add_argument("--out", help="markdown file to write (default: BENCHMARKS.md; with --quick: in the work folder)")
    parser.add_argument("--work-dir", help="folder for the benchmark's own runs (default: <data_root>/<run_name>-bench)")
    parser.add_argument("--epochs", type=int, help="training epochs of the two storage drafters (default 3; quick 1)")
    parser.add_argument("--repetitions", type=int, help="interleaved repetitions and serving rounds (default 3; quick 1)")
    parser.add_argument("--capture-samples", type=int, help="samples in the capture A/B (default 64; quick 4)")
    parser.add_argument("--arm-samples", type=int, help="conversations the two storage drafters train on (default 300; quick 6)")
    args = parser.parse_args(argv)
    try:
        run(args)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: no figures written", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - any other failure: exit 1 with where to look
        traceback.print_exc()
        print(f"failed: {type(e).__name__}: {e}; logs in the work folder's logs/ and benchmark.log", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
