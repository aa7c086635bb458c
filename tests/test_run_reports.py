"""scripts/status.py reads a run's stages through stage.read_stage_records: the stage list of
eagle_pipeline.stage.STAGES, and a damaged manifest reported with the stages' own message, as JSON and as a table."""

import json
import subprocess

from conftest import REPO, write_config

from eagle_pipeline.stage import STAGES

PYTHON = str(REPO / ".venv" / "bin" / "python")


def fake_run(tmp_path):
    config = write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="r")
    run_dir = tmp_path / "data" / "r"
    (run_dir / STAGES[1]).mkdir(parents=True)
    (run_dir / STAGES[1] / "manifest.json").write_text(json.dumps({
        "status": "complete", "inputs": {}, "wall_time_s": 125.0, "finished_at": "2026-11-29T10:00:00+00:00",
        "counts": {"samples": 300, "completion_tokens": 4000, "finish_reasons": {"stop": 300}, "output_tokens_per_s": 51.25},
        "engine_starts": {"target_starts": 1, "target_start_s": 1234.5, "starts": [
            {"what": "answering engine", "loads_target": True, "seconds": 1234.5}]}}))
    (run_dir / STAGES[2]).mkdir()
    (run_dir / STAGES[2] / "manifest.json").write_text('{"status": "comp')  # torn by hand
    return config


def test_status_json_and_table_list_every_stage_and_the_same_damage(tmp_path):
    config = fake_run(tmp_path)
    status = subprocess.run([PYTHON, str(REPO / "scripts" / "status.py"), "--config", str(config), "--json"],
                            capture_output=True, text=True, check=True).stdout
    rows = {r["stage"]: r for r in json.loads(status)}
    report = subprocess.run([PYTHON, str(REPO / "scripts" / "status.py"), "--config", str(config)],
                            capture_output=True, text=True)
    assert report.returncode == 0, report.stderr
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in report.stdout.splitlines()[3:]]
    table = {row[0]: row for row in cells}

    assert list(rows) == list(STAGES.values()) and list(table) == [*STAGES.values(), "total"]
    assert rows[STAGES[1]]["state"] == "done" and table[STAGES[1]][1] == "done"
    assert "300 conversations, 4000 answer tokens (finish_reason stop 300), 51.2 output tok/s" in table[STAGES[1]][4]
    assert table[STAGES[1]][3] == "1 (1234)" and table[STAGES[2]][3] == ""
    damage = rows[STAGES[2]]["note"]
    assert rows[STAGES[2]]["state"] == "damaged" and "manifest is not valid JSON" in damage and "--force" in damage
    assert table[STAGES[2]][1] == "damaged" and table[STAGES[2]][4] == damage
    assert rows[STAGES[3]]["state"] == "pending" and table[STAGES[3]][1] == "pending"
    assert table["total"][2] == "125" and table["total"][3] == "1 (1234)"


def test_report_refuses_a_config_that_does_not_load_with_one_error_line(tmp_path):
    result = subprocess.run([PYTHON, str(REPO / "scripts" / "status.py"), "--config", str(tmp_path / "absent.yaml")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stdout == ""
    assert [line for line in result.stderr.splitlines() if line.strip()][0].startswith("error:"), result.stderr


def test_the_plan_counts_the_targets_cold_starts_of_a_full_pass():
    from eagle_pipeline.config import load_config
    from eagle_pipeline.plan.engines import target_starts

    kimi = REPO / "configs" / "kimi-k2.5-10.yaml"
    assert sum(target_starts(load_config(kimi)).values()) == 6
    # Rerunning stage 06 with the first run's baseline kept: the EAGLE-3 server and the chosen schedule's.
    assert target_starts(load_config(kimi, ["serve.baseline=/data/k/06_serve_test"]))[STAGES[6]] == 2
    # Without confirming the schedule, stage 06 starts what it did before the sweep: none, EAGLE-3, the capture.
    assert target_starts(load_config(kimi, ["serve.confirm_schedule=false"]))[STAGES[6]] == 3
    # The two-engine parity of stage 05, and n-gram, each cost their starts.
    assert target_starts(load_config(kimi, ["convert.parity=vllm", "serve.ngram_baseline=true"]))[STAGES[5]] == 2
    assert sum(target_starts(load_config(kimi, ["serve.ngram_baseline=true"])).values()) == 7
    # The smoke run's plan is what its manifests record (tests/test_stages_04_06.py).
    assert sum(target_starts(load_config(REPO / "configs" / "tiny-smoke.yaml")).values()) == 7
    result = subprocess.run([PYTHON, str(REPO / "scripts" / "status.py"), "--config", str(kimi), "--plan"],
                            capture_output=True, text=True)
    assert "| total | 6 |" in result.stdout
    # The whole plan first; on a host without the config's 8 GPUs its last line says so (exit 2).
    last = (result.stderr.strip().splitlines() or [""])[-1]
    assert result.returncode == 0 or (result.returncode == 2 and last.startswith("error: ") and "GPU" in last), result.stderr
    variants = len(load_config(kimi).serve.engine_variants)
    assert variants and f"engine probe adds up to {variants} more, only after an engine verdict" in result.stdout
    assert target_starts(load_config(kimi, ["serve.probe_engine=always"]))[STAGES[6]] == 4 + variants


def finished_serving(tmp_path, name: str, drafter: str, levels: dict[str, dict[int, float]], trained: bool = True):
    """A run whose stage 06 finished (and stage 04, `trained`), stage 06 having served `levels` (mode ->
    concurrency -> tokens/s); a run not `trained` served the first run's converted drafter (serve.drafter)."""
    run_dir = tmp_path / "data" / name
    elsewhere = {"serve": {"drafter": str(tmp_path / "data" / "chain" / STAGES[5] / "vllm")}} if not trained else {}
    for stage, counts, config in ((STAGES[4], {"peak_rss_mb": 2500.0}, {}), (STAGES[6], {}, elsewhere)):
        if stage == STAGES[4] and not trained:
            continue
        (run_dir / stage).mkdir(parents=True)
        (run_dir / stage / "manifest.json").write_text(json.dumps(
            {"status": "complete", "inputs": {}, "wall_time_s": 300.0, "counts": counts, "config": config}))
    modes = {mode: {"levels": [{"concurrency": c, "tokens_per_s": v} for c, v in served.items()]}
             for mode, served in levels.items()}
    (run_dir / STAGES[6] / "report.json").write_text(json.dumps({
        "num_prompts": 4, "num_speculative_tokens": 7 if drafter == "dflash" else 3, "mean_acceptance_length": 2.0,
        "tokens_per_s": {mode: max(served.values()) for mode, served in levels.items()},
        "per_position_acceptance": [0.6, 0.4], "predicted_mean_acceptance_length": 2.0, "modes": modes}))
    return run_dir


def test_two_finished_runs_side_by_side_name_the_method_that_wins_each_load(tmp_path):
    """A block drafter wins alone, the chain drafter under load, n-gram nowhere: the comparison says so per level,
    with the training cost of the run that trained a drafter served from elsewhere."""
    eagle = finished_serving(tmp_path, "chain", "eagle3", {"none": {1: 10.0, 4: 30.0}, "ngram": {1: 11.0, 4: 31.0},
                                                           "eagle3": {1: 15.0, 4: 42.0}})
    dflash = finished_serving(tmp_path, "block", "dflash", {"none": {1: 10.0, 4: 30.0}, "dflash": {1: 19.0, 4: 36.0}})
    served = finished_serving(tmp_path, "chain-again", "eagle3", {"none": {4: 30.0}, "eagle3": {4: 40.0}},
                              trained=False)
    out = tmp_path / "families.md"
    result = subprocess.run([PYTHON, str(REPO / "scripts" / "compare_runs.py"), "--run", str(eagle), "--run",
                             str(dflash), "--run", str(served), "--out", str(out)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.strip().strip("|").split("|")]
            for line in result.stdout.splitlines() if line.startswith("| ")}
    assert rows["chain"][1] == "eagle3" and rows["block"][1:3] == ["dflash", "7"]
    assert rows["chain-again"][5:] == rows["chain"][5:] == ["300", "2.5"]  # trained by the run its drafter came from
    assert rows["1"][1:4] == ["15.0 (1.50x)", "19.0 (1.90x)", "- (-x)"] and rows["1"][-1] == "block dflash"
    assert rows["4"][-1] == "chain eagle3"
    assert out.read_text().startswith("Regenerated by `scripts/compare_runs.py") and out.with_suffix(".png").is_file()
    unfinished = tmp_path / "data" / "u"
    result = subprocess.run([PYTHON, str(REPO / "scripts" / "compare_runs.py"), "--run", str(eagle), "--run",
                             str(unfinished)], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "has not finished" in result.stderr
