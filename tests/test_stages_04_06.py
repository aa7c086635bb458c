"""Stages 04-06 for real on the small run of stages 01-03: train, convert + verify, serve and measure."""

import json
import subprocess
import sys

import pytest
from conftest import REPO, run_stage

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture(scope="module")
def finished(finished_small_run):
    return finished_small_run


def read(path):
    return json.loads(path.read_text())


def test_the_first_try_config_completes_every_stage(finished):
    # configs/tiny-smoke.yaml is also what users run first (README).
    from eagle_pipeline.stage import STAGES, read_manifest

    _, run_dir = finished
    assert {name: (read_manifest(run_dir / name) or {}).get("status") for name in STAGES.values()} == {
        name: "complete" for name in STAGES.values()}


def test_training_wrote_checkpoints_metrics_and_plots(finished):
    _, run_dir = finished
    train = run_dir / "04_train"
    counts = read(train / "manifest.json")["counts"]
    assert counts["epochs_completed"] == 2 and counts["train_tokens_per_s"] > 0 and counts["peak_rss_mb"] > 0
    assert (train / "metrics.csv").read_text().count("\n") >= 3
    assert (train / "loss_curves.png").stat().st_size > 1000
    assert counts["best"]["checkpoint"].startswith("checkpoints/")


def test_converted_drafter_passes_its_checks_and_the_mla_only_one_is_skipped(finished):
    _, run_dir = finished
    result = read(run_dir / "05_convert" / "verify.json")
    assert {name: check.get("skipped") or check["ok"] for name, check in result["checks"].items()} == {
        "shapes": True, "config": True, "vllm_load": True, "vllm_logits": True, "parity": True}
    assert result["ok"] and "a Llama-shaped drafter" in result["checks"]["vllm_logits"]["detail"]
    config = read(run_dir / "05_convert" / "vllm" / "config.json")
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert config["draft_vocab_size"] == 512 and config["vocab_size"] == 49152
    from safetensors import safe_open

    with safe_open(str(run_dir / "05_convert" / "vllm" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("d2t").dtype.is_floating_point is False
    assert "d2t" in keys and "t2d" in keys and not any("embed_tokens" in k for k in keys)
    assert any(k.startswith("midlayer.") for k in keys)
    # The vLLM job's whole output is kept beside the stage's own log, headed by its command.
    logs = run_dir / "05_convert" / "logs"
    assert " inspect " in (logs / "vllm-load.log").read_text().splitlines()[0]
    # Parity replayed both formats offline on held-out conversations: no engine, the same drafts.
    parity = result["checks"]["parity"]["detail"]
    assert parity["method"] == "replay" and parity["a"]["num_drafts"] == parity["b"]["num_drafts"] > 0
    assert parity["a"]["accepted_per_position"] == parity["b"]["accepted_per_position"]
    assert parity["b"]["drafter"] == str(run_dir / "05_convert" / "vllm")
    assert not (logs / "parity-a.log").exists()


def test_serve_report_has_every_field_and_greedy_text_is_unchanged(finished):
    _, run_dir = finished
    report = read(run_dir / "06_serve_test" / "report.json")
    for field in ("num_prompts", "num_speculative_tokens", "mean_acceptance_length", "acceptance_rate",
                  "per_position_acceptance", "tokens_per_s", "speedup", "greedy_match"):
        assert field in report
    assert report["num_prompts"] == 3 and report["num_speculative_tokens"] == 3
    assert len(report["per_position_acceptance"]) == 3
    assert set(report["tokens_per_s"]) == {"eagle3", "none", "ngram"} and all(v > 0 for v in report["tokens_per_s"].values())
    assert report["mean_acceptance_length"] >= 1.0
    assert report["greedy_match"] is True
    # The converted drafter was served as stage 05 wrote it, and its counters add up: three draft tokens per
    # draft, the headline acceptance length from them, and the server counted exactly the tokens the responses
    # report (the warm-up request excluded).
    eagle = report["modes"]["eagle3"]
    assert eagle["speculative_config"] == {"method": "eagle3", "model": str(run_dir / "05_convert" / "vllm"),
                                           "num_speculative_tokens": 3}
    assert eagle["num_drafts"] > 0 and eagle["num_draft_tokens"] == 3 * eagle["num_drafts"]
    assert report["mean_acceptance_length"] == pytest.approx(1 + eagle["num_accepted_tokens"] / eagle["num_drafts"])
    for mode in ("none", "ngram", "eagle3"):
        assert report["modes"][mode]["server_generation_tokens"] == report["modes"][mode]["output_tokens"] > 0
        assert report["modes"][mode]["tpot_ms"] > 0
    # n-gram drafts too, and greedy decoding under it is lossless: the same texts as without speculation.
    ngram = report["modes"]["ngram"]
    assert ngram["num_drafts"] > 0 and ngram["num_draft_tokens"] == 3 * ngram["num_drafts"]
    assert 0 < ngram["num_accepted_tokens"] <= ngram["num_draft_tokens"] and len(ngram["per_position_acceptance"]) == 3
    assert report["greedy_mismatches"]["ngram"] == []
    assert (run_dir / "06_serve_test" / "report.png").stat().st_size > 1000
    assert "acceptance" in (run_dir / "06_serve_test" / "report.md").read_text().lower()


def test_the_sweep_serves_every_level_and_vllms_cpu_build_changes_k_with_the_batch_size(finished):
    """The smoke config sweeps concurrency [1, 2] and confirms its own schedule [[1, 1, 3], [2, 2, 1]]: the server
    drafted 3 tokens per step alone and fewer with two requests in flight (1 while both run, 3 once one is left)."""
    _, run_dir = finished
    report = read(run_dir / "06_serve_test" / "report.json")
    assert report["concurrency_levels"] == [1, 2] and report["concurrency"] == 1
    for mode in ("none", "ngram", "eagle3"):
        levels = report["modes"][mode]["levels"]
        assert [row["concurrency"] for row in levels] == [1, 2] and all(row["tokens_per_s"] > 0 for row in levels)
    eagle = report["modes"]["eagle3"]["levels"]
    assert [row["num_requests"] for row in eagle] == [3, 4] and len(eagle[1]["per_request"]) == 4
    plan = report["serving_plan"]
    assert plan["source"] == "configured" and plan["schedule"] == [[1, 1, 3], [2, 2, 1]]
    assert [row["k"] is not None for row in plan["estimate"]] == [True, True]
    confirmed = plan["confirmed"]
    assert confirmed["by"] == "schedule" and confirmed["greedy_mismatches"] == []
    alone, two = (row["draft_tokens_per_draft"] for row in confirmed["levels"])
    assert alone == 3.0 and 1.0 <= two < 3.0, confirmed
    served = read(run_dir / "06_serve_test" / "served" / "schedule.json")
    spec = served["record"]["summary"]["speculative_config"]
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 1, 3], [2, 2, 1]]
    lines = (run_dir / "06_serve_test" / "report.md").read_text().rstrip().splitlines()
    assert lines[-1] == "```" and lines[-2] == plan["command"] and " vllm serve " in f" {lines[-2]}"
    # The command serves whichever method served fastest over the levels: timing decides it, not this test.
    command, method = lines[-2], plan["method"]
    if method == "none":
        assert "--speculative-config" not in command and plan["speculative_config"] is None
    else:
        assert {"eagle3": "num_speculative_tokens_per_batch_size", "ngram": '"method": "ngram"'}[method] in command


def test_acceptance_below_the_floor_fails_the_stage(finished):
    config, _ = finished
    result = run_stage("06_serve_test.py", config, "--set", "serve.min_acceptance_length=3.99")
    assert result.returncode == 1 and "FAIL: mean acceptance length" in result.stdout


def test_offline_prediction_of_the_intact_drafter_agrees_with_what_vllm_served(finished):
    _, run_dir = finished
    report = read(run_dir / "06_serve_test" / "report.json")
    predicted, served = report["predicted_per_position_acceptance"], report["per_position_acceptance"]
    assert len(predicted) == len(served) == 3
    # The replay counts the drafts of the same greedy answers vLLM verified (all but each answer's last few
    # tokens), so a drafter served as trained measures what it predicts, up to a few drafts' worth.
    assert report["predicted_num_drafts"] > 0
    assert abs(report["predicted_mean_acceptance_length"] - report["mean_acceptance_length"]) <= 0.2
    assert all(abs(p - s) <= 0.15 for p, s in zip(predicted, served))
    assert "Predicted offline vs served" in (run_dir / "06_serve_test" / "report.md").read_text()


def test_the_run_summary_has_a_row_per_stage_with_its_key_figures(finished):
    config, run_dir = finished
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "status.py"), "--config", str(config)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = {line.split(" | ")[0].strip("| "): line for line in result.stdout.splitlines()[3:]}
    assert list(rows) == ["01_generate_data", "02_extract_hidden", "03_build_vocab_map", "04_train", "05_convert",
                          "06_serve_test", "total"]
    report = read(run_dir / "06_serve_test" / "report.json")
    assert "6 conversations" in rows["01_generate_data"] and "layers [2, 15, 27] + final" in rows["02_extract_hidden"]
    assert "checks all ok" in rows["05_convert"] and "; skipped: vllm_logits)" in rows["05_convert"]
    # The target's cold starts, per stage and in all: the answering engine, the capture engine, none in stage 05
    # (its parity replays offline), and stage 06's three servers, the one confirming its schedule and its
    # prediction's capture engine.
    starts = {name: [cell.strip() for cell in row.strip().strip("|").split("|")][3] for name, row in rows.items()}
    assert [starts[name].split(" ")[0] for name in rows] == ["1", "1", "0", "0", "0", "5", "7"], starts
    manifest = read(run_dir / "06_serve_test" / "manifest.json")
    assert sorted(s["what"] for s in manifest["engine_starts"]["starts"]) == [
        "hidden-state capture engine", "vLLM server (server-eagle3)", "vLLM server (server-ngram)",
        "vLLM server (server-none)", "vLLM server (server-schedule)"]
    assert (f"acceptance length {report['mean_acceptance_length']:.2f} served, "
            f"{report['predicted_mean_acceptance_length']:.2f} predicted (agrees), "
            f"n-gram {report['ngram_acceptance']['mean_acceptance_length']:.2f}") in rows["06_serve_test"]
