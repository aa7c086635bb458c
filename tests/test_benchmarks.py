"""The benchmark's code: statistics, FLOP arithmetic, reading a finished run, the markdown and its checks.
The benchmark itself runs outside the suite: `scripts/run_benchmarks.sh configs/tiny-smoke.yaml --quick`
after `scripts/run_pipeline.sh configs/tiny-smoke.yaml`, which exits 1 when a part measured nothing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
from conftest import REPO, write_config

from bench import checks, drift, figures, flops, report, serve_ab, stats
from bench.arms import IncompleteFigures, run_command
from bench.run import write_and_check
from eagle_pipeline.config import load_config
from eagle_pipeline.errors import BadInput

# SmolLM2-135M's shape (config.json of the embedded verifier).
SMOLLM2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "intermediate_size": 1536, "num_hidden_layers": 30, "vocab_size": 49152}


# ---------------------------------------------------------------- statistics


def test_spread_quotes_the_median_and_keeps_the_range():
    s = stats.spread([3.0, 1.0, 10.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (3.0, 1.0, 10.0, 3)
    with pytest.raises(ValueError):
        stats.spread([])


def test_ratios_are_taken_pair_by_pair():
    assert stats.paired_ratios([2.0, 9.0], [1.0, 3.0]) == [2.0, 3.0]
    with pytest.raises(ValueError):
        stats.paired_ratios([1.0], [1.0, 2.0])


def test_interleaving_rotates_which_side_goes_first():
    assert [stats.interleaved_order(["a", "b"], r) for r in range(3)] == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert stats.interleaved_order(["a", "b", "c"], 1) == ["b", "c", "a"]


def test_rounds_cover_every_prompt_once_and_none_is_empty():
    chunks = stats.split_rounds(list(range(8)), 3)
    assert chunks == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert stats.split_rounds([1, 2], 5) == [[1], [2]]


def test_acceptance_length_stderr_from_per_position_rates():
    # Every draft token accepted: no spread at all.
    assert stats.acceptance_length_stderr([1.0, 1.0, 1.0], 100) == 0.0
    # One draft position accepted half the time: a fair coin, standard deviation 0.5.
    assert stats.acceptance_length_stderr([0.5, 0.0, 0.0], 100) == pytest.approx(0.05)
    # P(A>0)=.5, P(A>1)=.25: A is 0, 1, 2 with .5, .25, .25 -> mean .75, E[A^2] 1.25, variance .6875.
    assert stats.acceptance_length_stderr([0.5, 0.25], 1) == pytest.approx(math.sqrt(0.6875))
    assert stats.acceptance_length_stderr([], 10) is None and stats.acceptance_length_stderr([0.5], 0) is None


# ---------------------------------------------------------------- FLOPs per token and ceilings


def test_decoder_params_of_smollm2():
    # Per layer: q 576x576, k and v 576x192, o 576x576, gate/up/down 576x1536; 30 layers.
    assert flops.decoder_matmul_params(SMOLLM2) == 30 * (576 * 576 * 2 + 576 * 192 * 2 + 3 * 576 * 1536) == 106_168_320
    assert flops.lm_head_params(SMOLLM2) == 49152 * 576


def test_decoder_params_match_the_linear_layers_of_a_real_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    shape = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
                 num_hidden_layers=3, vocab_size=100)
    model = LlamaForCausalLM(LlamaConfig(**shape))
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if type(m).__name__ == "Linear")
    assert flops.decoder_matmul_params(shape) == linear


def test_prefill_flops_count_weights_twice_and_causal_attention():
    # One sequence of n tokens: token i sees i + 1 positions, mean (n + 1) / 2.
    n = 99
    attention = 4 * 30 * 9 * 64 * (n + 1) / 2
    assert flops.prefill_flops_per_token(SMOLLM2, [n]) == pytest.approx(2 * 106_168_320 + attention)
    # Longer sequences cost more per token, never less than the weights.
    assert flops.prefill_flops_per_token(SMOLLM2, [500]) > flops.prefill_flops_per_token(SMOLLM2, [50])


def test_generation_flops_add_the_lm_head_per_output_token():
    per_token = flops.generation_flops_per_output_token(SMOLLM2, prompt_tokens=0, completion_tokens=1000, samples=10)
    weights = 2 * (106_168_320 + 49152 * 576)
    assert weights < per_token < weights * 1.1
    with_prompts = flops.generation_flops_per_output_token(SMOLLM2, prompt_tokens=1000, completion_tokens=1000, samples=10)
    assert with_prompts > per_token + 2 * 106_168_320 * 0.99


def test_matmul_peak_is_the_faster_kernel_of_each_repetition():
    samples = [flops.matmul_flops_per_s(64, 0.01) for _ in range(2)]
    for rates in samples:
        assert "torch" in rates["float32"] and all(v > 0 for v in rates["float32"].values())
        # A kernel this CPU lacks (bf16 on AVX2-only CPUs) is n/a with its reason; every other one ran.
        assert all(v > 0 if stats.is_available(v) else v.startswith("n/a (no bf16 matmul kernel on this CPU: ")
                   for v in rates["bfloat16"].values())
    peak = flops.summarize_matmul(samples, 64, threads=2)
    for dtype in ("float32", "bfloat16"):
        kernels = [{k: v for k, v in r[dtype].items() if stats.is_available(v)} for r in samples]
        if all(kernels):
            assert peak["flops_per_s"][dtype]["values"] == [max(k.values()) for k in kernels]
        else:
            assert dtype == "bfloat16" and peak["flops_per_s"][dtype].startswith("n/a (no bf16 matmul kernel")
        torch_figure = peak["kernels"][dtype]["torch"]
        assert torch_figure["n"] == 2 if stats.is_available(torch_figure) else dtype == "bfloat16"


NO_PRIMITIVE = "could not create a primitive descriptor for the matmul primitive"

# Every kernel held to AVX2: what an AVX2-only CPU offers, on any x86 CPU (docs/engines.md, "Machines differ").
AS_AVX2_ONLY = str(REPO / "scripts" / "as_avx2_only.sh")


def run_as_avx2_only(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([AS_AVX2_ONLY, sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_onednn_held_to_avx2_has_no_bf16_matmul_and_the_peak_says_na_with_its_reason():
    """The real oneDNN, not a stand-in: its bf16 matmul is refused with the error the benchmark reports as n/a."""
    result = run_as_avx2_only("import json; from bench import flops; "
                              "print(json.dumps(flops.summarize_matmul([flops.matmul_flops_per_s(64, 0.01)], 64, threads=1)))")
    assert result.returncode == 0, result.stderr[-3000:]
    peak = json.loads(result.stdout.splitlines()[-1])
    if "onednn" not in peak["kernels"]["bfloat16"]:
        pytest.skip("this torch/vLLM build has no oneDNN GEMM op")
    assert peak["kernels"]["bfloat16"]["onednn"].startswith(f"n/a (no bf16 matmul kernel on this CPU: {NO_PRIMITIVE}")
    assert peak["flops_per_s"]["float32"]["median"] > 0
    # Where torch's own bf16 kernel runs, the peak is its figure; otherwise the peak is n/a too.
    torch_bf16 = peak["kernels"]["bfloat16"]["torch"]
    if stats.is_available(torch_bf16):
        assert peak["flops_per_s"]["bfloat16"]["values"] == torch_bf16["values"]
    else:
        assert peak["flops_per_s"]["bfloat16"].startswith("n/a (no bf16 matmul kernel on this CPU: ")


VLLM_KERNELS_LOADED = """
import torch
from vllm.platforms import current_platform
current_platform.import_kernels()
libraries = {line.split()[-1].rsplit("/", 1)[-1] for line in open("/proc/self/maps") if "/vllm/_C" in line}
print(torch.cpu._is_avx512_supported(), torch.cpu._is_amx_tile_supported(), torch.backends.cpu.get_cpu_capability(),
      *sorted(libraries))
"""


@pytest.mark.vllm
def test_as_avx2_only_makes_vllm_load_its_avx2_kernels():
    """vLLM picks its compiled library by what torch says the CPU has; under the script it is the AVX2 one."""
    if os.uname().machine != "x86_64":
        pytest.skip("vLLM's CPU build has AVX2 and AVX-512 libraries on x86-64 Linux only")
    held = run_as_avx2_only(VLLM_KERNELS_LOADED)
    assert held.returncode == 0, held.stderr[-3000:]
    # On an AVX-512 host (where torch alone answers True and vLLM loads `_C` or `_C_AVX512`), that is the script's doing.
    assert held.stdout.split() == ["False", "False", "AVX2", "_C_AVX2.abi3.so"], held.stdout


@pytest.fixture
def no_bf16_matmul_kernel(monkeypatch):
    """This CPU as an AVX2-only one: torch's and oneDNN's bf16 matmul raise oneDNN's error."""
    import torch

    def refuse_bf16(kernel):
        def make_step(a, b):
            if a.dtype == torch.bfloat16:
                raise RuntimeError(NO_PRIMITIVE)
            return kernel(a, b)
        return make_step

    kernels = flops.matmul_kernels()
    monkeypatch.setattr(flops, "matmul_kernels", lambda: {name: refuse_bf16(k) for name, k in kernels.items()})


def test_a_missing_bf16_kernel_is_na_with_its_reason_and_the_document_renders(no_bf16_matmul_kernel):
    reason = f"n/a (no bf16 matmul kernel on this CPU: {NO_PRIMITIVE})"
    peak = flops.summarize_matmul([flops.matmul_flops_per_s(64, 0.01)], 64, threads=2)
    assert peak["flops_per_s"]["float32"]["median"] > 0
    assert peak["flops_per_s"]["bfloat16"] == reason
    assert set(peak["kernels"]["bfloat16"].values()) == {reason}
    assert flops.unavailable_matmul_kernels("bfloat16") == {name: reason for name in flops.matmul_kernels()}
    assert flops.unavailable_matmul_kernels("float32") == {}

    results = _results()
    results["ceiling"] = json.loads(json.dumps(peak))  # as the JSON holds it
    cap, gen = results["capture"], results["generation"]
    cap["ceiling_tokens_per_s"] = flops.ceiling_tokens_per_s(peak, cap["flops_per_token"])
    cap["fraction_of_ceiling"] = flops.share_of_ceiling_per_repetition(
        cap["tokens_per_s"]["vllm"]["values"][:1], peak, cap["flops_per_token"])
    gen["ceiling_tokens_per_s"] = flops.ceiling_tokens_per_s(peak, gen["flops_per_token"])
    gen["fraction_of_ceiling"] = flops.share_of_ceiling(gen["output_tokens_per_s"], gen["ceiling_tokens_per_s"])
    assert cap["ceiling_tokens_per_s"]["bfloat16"] == gen["fraction_of_ceiling"]["bfloat16"] == reason
    assert cap["fraction_of_ceiling"]["float32"] > 0 and gen["fraction_of_ceiling"]["float32"] > 0

    text = report.render_markdown(results)
    check_benchmarks_md(text)
    assert f"| ceiling: bfloat16 matmul peak / FLOPs per token | {reason} | - | - |" in text
    assert f"| ceiling: bfloat16 matmul peak / FLOPs per output token | {reason} | - |" in text
    assert f"| bfloat16 | {reason} |" in text


# ---------------------------------------------------------------- serving summary


def _round(tokens_per_s, texts, drafts=0.0, accepted=(), wall=1.0):
    metrics = {"num_drafts": drafts, "num_draft_tokens": drafts * 3, "num_accepted_tokens": float(sum(accepted)),
               "accepted_per_pos": list(accepted), "generation_tokens": tokens_per_s * wall,
               "tpot_sum_s": 0.0, "tpot_count": 0.0, "ttft_sum_s": 0.0, "ttft_count": 0.0}
    return {"output_tokens": int(tokens_per_s * wall), "wall_s": wall, "tokens_per_s": tokens_per_s, "texts": texts,
            "metrics": metrics}


def test_serving_summary_pairs_rounds_and_sums_counters():
    per_round = {
        "none": [_round(100.0, ["a", "b"]), _round(50.0, ["c"])],
        "eagle3": [_round(80.0, ["a", "x"], drafts=10, accepted=(6, 3, 1)), _round(45.0, ["c"], drafts=10, accepted=(4, 1, 0))],
    }
    servers = {"none": None, "eagle3": {"method": "eagle3"}}
    summary = serve_ab.summarize_serving(per_round, servers, {"none": 1.0, "eagle3": 2.0}, num_prompts=3, max_tokens=8,
                                           temperature=0.0, concurrency=2)
    eagle = summary["modes"]["eagle3"]
    assert summary["baseline"] == "none" and summary["rounds"] == 2
    assert eagle["ratio_to_baseline"]["values"] == [0.8, 0.9] and eagle["ratio_to_baseline"]["median"] == pytest.approx(0.85)
    assert eagle["num_drafts"] == 20 and eagle["per_position_acceptance"] == [0.5, 0.2, 0.05]
    assert eagle["mean_acceptance_length"] == pytest.approx(1.75)
    assert eagle["mean_acceptance_length_stderr"] > 0
    assert summary["texts"] == {"none": ["a", "b", "c"], "eagle3": ["a", "x", "c"]}
    none = summary["modes"]["none"]
    assert none["ratio_to_baseline"]["median"] == 1.0 and "mean_acceptance_length" not in none


# ---------------------------------------------------------------- reading a finished run


def _manifest(path, stage, counts, config=None, wall=1.0):
    path.mkdir(parents=True, exist_ok=True)
    (path / "manifest.json").write_text(json.dumps({"stage": stage, "status": "complete", "counts": counts,
                                                    "config": config or {}, "wall_time_s": wall, "inputs": {}}))


def test_a_missing_run_is_refused_with_the_command_that_makes_it(tmp_path):
    cfg = load_config(write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "data"), run_name="r"))
    with pytest.raises(BadInput, match=r"06_serve_test not complete.*scripts/run_pipeline.sh configs/x.yaml"):
        figures.read_pipeline_run(cfg, "configs/x.yaml")


def test_the_script_exits_2_with_one_error_line_when_the_run_is_missing(tmp_path):
    config = write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "data"), run_name="r")
    result = subprocess.run([sys.executable, "-m", "bench.run", "--config", str(config)], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.startswith("error: ") and "scripts/run_pipeline.sh" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "data" / "r-bench").exists()


def test_training_figures_use_the_median_step_and_step_time(tmp_path):
    train = tmp_path / "04_train"
    _manifest(train, "04_train", {"epochs_completed": 2, "train_tokens_per_s": 90.0, "peak_rss_mb": 1200.0,
                                  "final_val": {"full_acc_1": 0.2, "full_acc_0": 0.4, "loss": 3.0}}, wall=60.0)
    (train / "run_stats.json").write_text(json.dumps({"steps": 10, "train_step_seconds": 5.0}))
    (train / "metrics.csv").write_text("split,epoch,step,tokens_per_s\r\ntrain,0,1,100\r\ntrain,0,2,50\r\n"
                                       "train,0,3,80\r\nval,0,3,\r\n")
    run = figures.training_figures(json.loads((train / "manifest.json").read_text()), train)
    assert run["tokens_per_s_median_step"] == 80.0 and run["steps_per_s"] == 2.0
    assert run["val_full_acc"] == [0.4, 0.2] and run["peak_rss_mb"] == 1200.0 and run["wall_s"] == 60.0


def test_storage_figures_per_token_and_per_thousand_samples():
    manifest = {"config": {"hidden_states": {"storage_dtype": "fp8"}},
                "counts": {"samples": 4, "tokens": 1000, "stored_bytes": 2_500_000, "num_hidden_states": 4,
                           "hidden_size": 576}}
    s = figures.storage_figures(manifest)
    assert s["bytes_per_token"] == 2500 and s["bytes_per_1k_samples"] == 625_000_000 and s["storage_dtype"] == "fp8"


def test_fp8_verdict_weighs_the_difference_against_the_noise():
    assert "within two standard errors" in figures.fp8_verdict(-0.01, 0.02, 1.5, "bfloat16")
    loses = figures.fp8_verdict(-0.2, 0.02, 1.5, "bfloat16")
    assert loses.startswith("fp8 storage loses 0.200") and "-40%" in loses and loses.endswith("as bfloat16.")
    assert "higher" in figures.fp8_verdict(0.2, 0.02, 1.5, "bfloat16")
    assert "No acceptance" in figures.fp8_verdict(None, None, None, "bfloat16")


# ---------------------------------------------------------------- the document


def check_benchmarks_md(text: str) -> None:
    """Every figure is present as a number, next to its baseline."""
    assert checks.document_problems(text) == []


def _results():
    s = stats.spread
    modes = {
        "none": {"tokens_per_s": s([85.0, 86.0, 84.0]), "ratio_to_baseline": s([1.0, 1.0, 1.0]), "speculative_config": None},
        "ngram": {"tokens_per_s": s([95.0]), "ratio_to_baseline": s([1.12]), "mean_acceptance_length": 2.48,
                  "per_position_acceptance": [0.6, 0.5, 0.4], "greedy_mismatches": []},
    }
    storage_modes = {}
    for name, length in (("eagle3", 1.5), ("eagle3-bf16", 1.3), ("eagle3-fp8", 1.28)):
        (modes if name == "eagle3" else storage_modes)[name] = {
            "tokens_per_s": s([65.0, 66.0]), "ratio_to_baseline": s([0.77, 0.78]), "mean_acceptance_length": length,
            "mean_acceptance_length_stderr": 0.02, "per_position_acceptance": [0.3, 0.1, 0.05], "greedy_mismatches": [2]}
    serving = {"num_prompts": 24, "rounds": 3, "max_tokens": 128, "temperature": 0.0, "concurrency": 4}
    training = {"epochs": 3, "steps": 300, "tokens_per_s_median_step": 680.0, "tokens_per_s_mean": 670.0,
                "steps_per_s": 1.3, "peak_rss_mb": 1300.0, "wall_s": 300.0, "val_full_acc": [0.35, 0.15, 0.07]}
    storage = {"storage_dtype": "bfloat16", "samples": 300, "tokens": 64707, "stored_bytes": 298_000_000,
               "bytes_per_token": 4617.0, "bytes_per_1k_samples": 995e6, "num_hidden_states": 4, "hidden_size": 576}
    flops = {"float32": s([3.0e11]), "bfloat16": s([1.6e11])}
    kernels = {"float32": {"torch": s([1.2e11]), "onednn": s([3.0e11])}, "bfloat16": {"torch": s([1.6e11]), "onednn": s([1.5e11])}}
    return {
        "meta": {"command": "scripts/run_benchmarks.sh configs/tiny.yaml", "pipeline_command": "scripts/run_pipeline.sh configs/tiny.yaml",
                 "mode": "full", "date": "2026-12-01 00:00 UTC",
                 "machine": {"cpu": "Some CPU", "cores": 2, "ram_gib": 23.4, "os": "Linux 6"},
                 "versions": {"python": "3.11", "torch": "2.13.0+cpu"}, "config": "configs/tiny.yaml",
                 "verifier": "embedded:smollm2-135m-instruct", "dtype": "float32", "device": "cpu", "num_speculative_tokens": 3,
                 "pipeline_run": "runs/tiny", "work_dir": "runs/tiny-bench", "json": "runs/tiny-bench/benchmarks.json",
                 "parts_s": {"capture A/B": 120.0}, "total_s": 1500.0},
        "ceiling": {"size": 2048, "threads": 2, "repetitions": 3, "flops_per_s": flops, "kernels": kernels},
        "capture": {"samples": 64, "tokens": 14000, "repetitions": 3, "vllm_batch_size": 16, "threads": 2,
                    "dtype": "float32", "layer_ids": [2, 15, 27], "load_s": {"vllm": 30.0, "hf": 3.0},
                    "tokens_per_s": {"vllm": s([2300.0, 2200.0, 2400.0]), "hf": s([1100.0, 1000.0, 1200.0])},
                    "ratio_vllm_over_hf": s([2.1, 2.0, 2.2]),
                    "agreement": {"same_shape": True, "relative_error_per_slot": [1e-6, 2e-6, 3e-6, 4e-6],
                                  "max_relative_error": 4e-6},
                    "decoder_params": 106_168_320, "flops_per_token": 2.2e8,
                    "ceiling_tokens_per_s": {"float32": 1364.0, "bfloat16": 727.0},
                    "fraction_of_ceiling": {"float32": 1.69, "bfloat16": 3.2}},
        "generation": {"output_tokens_per_s": 208.0, "batch_size": 50, "max_tokens": 256, "samples": 300,
                       "prompt_tokens": 9000, "completion_tokens": 51945, "generation_seconds": 250.0,
                       "flops_per_token": 3.1e8, "ceiling_tokens_per_s": {"float32": 967.0, "bfloat16": 516.0},
                       "fraction_of_ceiling": {"float32": 0.22, "bfloat16": 0.4}},
        "training": {"bf16": training, "fp8": training, "pipeline": {**training, "epochs": 8}, "ratio_bf16_over_fp8": 1.0},
        "serving": {**serving, "baseline": "none", "modes": modes},
        "storage_serving": {**serving, "baseline": "eagle3-bf16", "modes": storage_modes},
        "storage": {"bf16": storage, "fp8": {**storage, "bytes_per_token": 2320.0, "bytes_per_1k_samples": 5e8},
                    "ratio_fp8_over_bf16": 0.5},
        "fp8_cost": {"epochs": 3, "bf16": 1.3, "fp8": 1.28, "difference": -0.02, "stderr": 0.028,
                     "verdict": figures.fp8_verdict(-0.02, 0.028, 1.3, "bfloat16")},
        "pipeline": {"run_dir": "runs/tiny", "finished_at": "2026-11-30T23:30:00+00:00", "total_wall_s": 1321.0,
                     "stages_wall_s": {"01_generate_data": 273.0, "02_extract_hidden": 118.0, "03_build_vocab_map": 2.0,
                                       "04_train": 655.0, "05_convert": 74.0, "06_serve_test": 198.0},
                     "serving": {"mean_acceptance_length": 1.497, "tokens_per_s": {"eagle3": 65.5, "none": 85.0, "ngram": None},
                                 "verdict": "FAIL: mean acceptance length 1.50 is below serve.min_acceptance_length 1.50"}},
    }


def test_markdown_has_every_figure_with_its_baseline():
    text = report.render_markdown(_results())
    check_benchmarks_md(text)
    assert "| 1 | hidden-state capture, tokens/s (vLLM, stage 02's path) | 2,300 [2,200-2,400] | HF transformers 1,100 [1,000-1,200] | 2.10x |" in text
    assert "| 5 | training data, bytes per token, bf16 storage | 4,617 | fp8 2,320 | 0.50x |" in text
    assert "even a good drafter does not speed it up here" in text
    assert "| float32 | 120 | 300 | 300 |" in text
    assert "| total | 1,321.0 | 100% |" in text
    assert "tokens/s eagle3 65.5, none 85.0; its verdict: FAIL: mean acceptance length 1.50" in text
    assert "| fp8 storage | 65.5 [65.0-66.0] | 0.78x [0.77-0.78] | 1.280 | 0.300 / 0.100 / 0.050 | 1 of 24 |" in text


def test_benchmarks_md_is_the_benchmarks_output_alone():
    """BENCHMARKS.md holds what bench/report.py writes and nothing added by hand: the same sections, in order
    (findings of other commands go to docs/benchmarks/), so that rerunning the benchmark loses nothing."""
    def headings(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.startswith("#")]

    committed = (REPO / "BENCHMARKS.md").read_text()
    assert headings(committed) == headings(report.render_markdown(_results()))
    check_benchmarks_md(committed)


# ---------------------------------------------------------------- what a finished run must hold


def test_complete_results_have_no_missing_figure():
    assert checks.missing_figures(_results()) == []


def test_each_part_that_measured_nothing_is_named():
    results = _results()
    results["capture"]["tokens_per_s"]["hf"] = None
    results["capture"]["agreement"]["max_relative_error"] = 0.2  # another layer than HF's
    results["serving"]["modes"]["ngram"]["tokens_per_s"] = None
    results["storage_serving"]["modes"]["eagle3-fp8"]["tokens_per_s"] = stats.spread([0.0])
    results["fp8_cost"]["fp8"] = None
    results["storage"]["ratio_fp8_over_bf16"] = 1.0  # fp8 stored as wide as bf16
    results["training"]["bf16"] = {**results["training"]["bf16"], "steps_per_s": 0.0}
    missing = checks.missing_figures(results)
    assert missing == [
        "capture: no tokens/s for the hf side",
        "capture: vLLM's states differ from HF's by 0.2 (relative), above 0.03: not the same layers",
        "serving: no output tokens/s for ngram",
        "storage_serving: no output tokens/s for eagle3-fp8",
        "storage: no mean acceptance length for the fp8-storage drafter (None)",
        "storage: fp8 / bf16 bytes per token is 1.0, not between 0.4 and 0.6",
        "training: no steps_per_s for the bf16-storage drafter",
    ]
    results["capture"]["agreement"] = {"same_shape": False, "vllm_shape": [5, 4, 8], "hf_shape": [5, 3, 8]}
    assert checks.missing_figures(results)[1].startswith("capture: vLLM and HF returned different hidden states")


def test_a_document_without_a_figure_is_named():
    text = report.render_markdown(_results())
    assert checks.document_problems(text) == []
    broken = text.replace("## 3. Training", "## 3. Trained").replace("| 2,300 [2,200-2,400] |", "| - |", 1)
    assert checks.document_problems(broken) == [
        "no section '## 3. Training'",
        "summary: the measured figure is not a number: | 1 | hidden-state capture, tokens/s (vLLM, stage 02's path) "
        "| - | HF transformers 1,100 [1,000-1,200] | 2.10x |",
    ]


def test_a_run_missing_a_figure_writes_both_files_and_exits_1_naming_it(tmp_path, capsys):
    results = _results()
    results["serving"]["modes"]["ngram"]["tokens_per_s"] = None
    json_path, out_md = tmp_path / "benchmarks.json", tmp_path / "BENCHMARKS.md"
    with pytest.raises(IncompleteFigures, match="serving: no output tokens/s for ngram"):
        write_and_check(results, json_path, out_md)
    assert json.loads(json_path.read_text())["serving"]["modes"]["ngram"]["tokens_per_s"] is None
    assert out_md.read_text() == report.render_markdown(results)

    def run(args):
        write_and_check(results, json_path, out_md)

    assert run_command(run, None, interrupted="-", logs="-") == 1
    err = capsys.readouterr().err
    assert err.startswith("failed: ") and "serving: no output tokens/s for ngram" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_drift_names_each_figure_that_moved_beyond_its_band_and_counts_the_rest():
    published = report.render_markdown(_results())
    today = _results()
    today["capture"]["ratio_vllm_over_hf"] = stats.spread([1.4])  # 2.10x -> 1.40x: -33%, band 20%
    today["storage"]["bf16"] = {**today["storage"]["bf16"], "bytes_per_token": 4640.0}  # +0.5%: noise
    today["generation"]["output_tokens_per_s"] = 100.0  # -52%, but a quick run measures it at another size
    today["meta"]["mode"] = "quick"
    lines = drift.compare(published, report.render_markdown(today), quick=True)
    assert lines[0] == "benchmark drift against BENCHMARKS.md: 5 figure(s) within their noise band, 1 moved:"
    assert lines[1] == "  moved: capture, vLLM over HF transformers: 2.10 -> 1.40 (-33%; band ±20%)"
    assert lines[2].startswith("  not compared (measured at another size in a quick run): capture tokens/s (vLLM), "
                               "generation output tokens/s,")
    full = drift.compare(published, report.render_markdown(today), quick=False)
    assert "  moved: generation output tokens/s: 208 -> 100 (-52%; band ±25%)" in full
    assert drift.compare(published, published, quick=False) == [
        f"benchmark drift against BENCHMARKS.md: {len(drift.FIGURES)} figure(s) within their noise band, 0 moved"]


def test_the_committed_benchmarks_md_has_every_figure_the_drift_compares():
    rows = drift.summary_rows((REPO / "BENCHMARKS.md").read_text())
    assert all(drift.first_number(rows[f.row][f.column]) is not None for f in drift.FIGURES)


def test_a_run_prints_its_drift_and_still_passes(tmp_path):
    lines = []
    published = report.render_markdown(_results()).replace("| 0.50x |", "| 0.90x |")
    write_and_check(_results(), tmp_path / "benchmarks.json", tmp_path / "BENCHMARKS.md", published=published,
                    log=lines.append)
    assert "  moved: training data, fp8 over bf16 bytes: 0.90 -> 0.50 (-44%; band ±5%)" in lines


def test_complete_results_are_written_and_pass(tmp_path):
    write_and_check(_results(), tmp_path / "benchmarks.json", tmp_path / "BENCHMARKS.md")
    check_benchmarks_md((tmp_path / "BENCHMARKS.md").read_text())
