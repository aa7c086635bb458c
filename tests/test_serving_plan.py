"""How to serve the drafter across load (eagle_pipeline/serve/plan.py): the schedule chosen from per-position
acceptance and step times, the collapse findings, the `vllm serve` command, the config's levels and schedule,
and vLLM's own code taking the schedule: `create_engine_config()` and the scheduler of the CPU build, which picks
k from the batch size (no model loads). Stage 06's sweep and confirming server run through the stand-in servers
of tests/test_serve_records.py."""

from __future__ import annotations

import json
import shlex

import pytest
from conftest import REPO, run_stage_in_process, write_config
from test_serve_records import FakeServers, drafter_run, stopped

from eagle_pipeline.config import load_config
from eagle_pipeline.errors import BadInput
from eagle_pipeline.serve.plan import (
    acceptance_lengths,
    batch_ranges,
    choose_k,
    collapse_findings,
    estimate_speedups,
    plan_serving,
    plan_speculative_config,
    serve_command,
    served_by,
    stuck_requests,
    withdraw_slower,
)

PER_POSITION = [0.8, 0.6, 0.4]  # L(k) = 1, 1.8, 2.4, 2.8


def level(concurrency: int, tpot_ms: float, per_position=None, length=None, per_request=None, drafts=100) -> dict:
    row = {"concurrency": concurrency, "tpot_ms": tpot_ms, "tokens_per_s": 1000.0 / tpot_ms}
    if per_position is not None:
        row.update(per_position_acceptance=per_position, num_drafts=drafts,
                   mean_acceptance_length=length if length is not None else 1 + sum(per_position),
                   per_request=per_request or [])
    return row


def modes_with(step_ratios: dict[int, float], t0: float = 10.0) -> dict:
    """none at `t0` ms per token at every level; the drafter (k_max 3, PER_POSITION) whose verification step at each
    level takes `ratio` x t0, so that its time per output token is ratio x t0 / L(3)."""
    none = {"levels": [level(c, t0) for c in step_ratios]}
    eagle = {"levels": [level(c, ratio * t0 / 2.8, PER_POSITION) for c, ratio in step_ratios.items()]}
    return {"none": none, "eagle3": eagle}


def test_acceptance_of_every_k_comes_from_the_positions_of_the_k_max_run():
    assert acceptance_lengths(PER_POSITION, 3) == pytest.approx([1.0, 1.8, 2.4, 2.8])
    assert acceptance_lengths([0.5], 3) == [1.0, 1.5, None, None]  # positions never measured are not guessed


def test_the_estimate_interpolates_the_step_time_between_no_speculation_and_k_max():
    none, drafter = level(1, 10.0), level(1, 13.0 / 2.8, PER_POSITION)
    # Batch 1: three drafts cost 30% of a step; every k pays, k_max most.
    assert estimate_speedups(none, drafter, 3) == pytest.approx([1.0, 1.8 / 1.1, 2.4 / 1.2, 2.8 / 1.3])
    assert choose_k(estimate_speedups(none, drafter, 3)) == 3
    # Compute-bound: a k_max step takes three plain steps; only one draft token still pays.
    heavy = estimate_speedups(level(64, 10.0), level(64, 30.0 / 2.8, PER_POSITION), 3)
    assert heavy == pytest.approx([1.0, 1.8 / (10 + 20 / 3) * 10, 2.4 / (10 + 40 / 3) * 10, 2.8 / 3])
    assert choose_k(heavy) == 1
    # Four plain steps per k_max step: nothing pays, and a gain under MIN_GAIN does not count either.
    assert choose_k(estimate_speedups(level(64, 10.0), level(64, 40.0 / 2.8, PER_POSITION), 3)) == 0
    assert choose_k([1.0, 1.01, 0.9]) == 0
    assert choose_k([1.0, 1.5, 1.5]) == 1  # a tie goes to fewer draft tokens
    # Without a time per output token there is nothing to estimate from.
    assert estimate_speedups(level(1, 10.0), {**drafter, "tpot_ms": None}, 3) is None and choose_k(None) is None


def test_the_levels_choices_become_vllms_batch_ranges():
    # Split at the geometric middle between levels, merged where k repeats; the last range ends at its level.
    assert batch_ranges([(1, 3), (16, 1), (64, 0)]) == [[1, 4, 3], [5, 32, 1], [33, 64, 0]]
    assert batch_ranges([(1, 3), (4, 3), (16, 1), (64, 1)]) == [[1, 8, 3], [9, 64, 1]]
    assert batch_ranges([(4, 2)]) == [[1, 4, 2]]

    plan = plan_serving(modes_with({1: 1.3, 16: 3.0, 64: 4.0}), [1, 16, 64], 3)
    assert [row["k"] for row in plan["estimate"]] == [3, 1, 0]
    assert plan["schedule"] == [[1, 4, 3], [5, 32, 1], [33, 64, 0]] and plan["kind"] == "schedule" and plan["k"] == 3
    spec = plan_speculative_config(plan, {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3})
    assert spec == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3,
                    "num_speculative_tokens_per_batch_size": [[1, 4, 3], [5, 32, 1], [33, 64, 0]]}
    assert served_by(plan, 3) is None  # needs its own, confirming server


def test_a_setting_already_served_needs_no_confirming_server():
    off = plan_serving(modes_with({1: 4.0, 4: 5.0}), [1, 4], 3)
    assert off["schedule"] == [[1, 4, 0]] and off["kind"] == "none" and served_by(off, 3) == "none"
    assert plan_speculative_config(off, {"method": "eagle3", "num_speculative_tokens": 3}) is None
    full = plan_serving(modes_with({1: 1.1, 4: 1.2}), [1, 4], 3)
    assert full["schedule"] == [[1, 4, 3]] and full["kind"] == "static" and served_by(full, 3) == "eagle3"
    assert plan_speculative_config(full, {"method": "eagle3", "num_speculative_tokens": 3}) == {
        "method": "eagle3", "num_speculative_tokens": 3}
    # One k below k_max everywhere is a setting of its own: served to confirm it, without a schedule.
    two = plan_serving(modes_with({1: 2.0}), [1], 3)
    assert two["kind"] == "static" and two["k"] == 2 and served_by(two, 3) is None
    # A configured schedule is what is served, beside the estimate's own choice.
    configured = plan_serving(modes_with({1: 4.0, 4: 5.0}), [1, 4], 3, [(1, 1, 3), (2, 2, 1)])
    assert configured["schedule"] == [[1, 1, 3], [2, 2, 1]] and configured["chosen_schedule"] == [[1, 4, 0]]
    assert configured["source"] == "configured" and configured["kind"] == "schedule"
    # A level measured without one of the runs (a baseline from a run of other levels) is left out of the choice.
    partial = modes_with({1: 1.3, 4: 1.3})
    partial["none"]["levels"] = partial["none"]["levels"][:1]
    assert [row["k"] for row in plan_serving(partial, [1, 4], 3)["estimate"]] == [3, None]
    # No level with both: no plan, and the command serves the drafter as it was measured, which its run confirms.
    partial["none"]["levels"] = []
    nothing = plan_serving(partial, [1, 4], 3)
    assert nothing["kind"] is None and nothing["schedule"] is None and served_by(nothing, 3) == "eagle3"
    assert plan_speculative_config(nothing, {"method": "eagle3", "num_speculative_tokens": 3}) == {
        "method": "eagle3", "num_speculative_tokens": 3}


def request(length: float, drafts: int, first: float | None = None) -> dict:
    return {"mean_acceptance_length": length, "num_drafts": drafts,
            "per_position_acceptance": [first if first is not None else min(1.0, length - 1.0), 0.0, 0.0]}


def test_acceptance_that_collapses_with_load_is_a_finding_with_its_numbers():
    healthy = [request(1.9, 40, 0.6) for _ in range(6)]
    eagle = {"levels": [level(1, 10.0, [0.6, 0.2, 0.1], 1.9, healthy), level(4, 9.0, [0.6, 0.2, 0.1], 1.85, healthy),
                        level(16, 8.0, [0.1, 0.0, 0.0], 1.1, healthy)]}
    findings = collapse_findings(eagle, [1, 4, 16])
    assert [f["kind"] for f in findings] == ["level_collapse"]
    assert findings[0]["concurrency"] == 16 and findings[0]["previous"] == 4
    assert "mean acceptance length 1.10 against 1.85 at concurrency 4" in findings[0]["text"]

    # A level that accepts nothing at all while another accepts (the 1.00 of a "healthy" server).
    eagle["levels"][2] = level(16, 8.0, [0.0, 0.0, 0.0], 1.0, [request(1.0, 40) for _ in range(6)])
    kinds = {f["kind"] for f in collapse_findings(eagle, [1, 4, 16])}
    assert kinds == {"level_collapse", "level_accepts_nothing"}

    # Requests at exactly 1.00 among others that accept their first draft token 60% of the time: 40 drafts
    # without one accepted is not chance (0.4^40); 3 drafts may be (0.4^3 = 6%).
    mixed = [request(1.9, 40, 0.6)] * 4 + [request(1.0, 40), request(1.0, 3)]
    stuck = stuck_requests(mixed)
    assert stuck["requests"] == [4] and stuck["num_drafts"] == [40]
    assert stuck["others_first_position"] == pytest.approx(0.6)
    eagle = {"levels": [level(1, 10.0, [0.6, 0.2, 0.1], 1.9, healthy), level(4, 9.0, [0.6, 0.2, 0.1], 1.8, mixed)]}
    [finding] = collapse_findings(eagle, [1, 4])
    assert finding["kind"] == "requests_accept_nothing" and finding["concurrency"] == 4
    assert "1 request(s) [4] read exactly 1.00 over 40-40 drafts" in finding["text"]


def test_a_weak_drafter_is_not_a_collapse():
    # On the embedded default acceptance is low everywhere: a dip of a few hundredths, or a request that
    # accepted nothing over drafts a low rate explains, is no finding.
    weak = [request(1.05, 20, 0.05)] * 5 + [request(1.0, 20)]
    eagle = {"levels": [level(1, 10.0, [0.05, 0.0, 0.0], 1.05, weak), level(4, 9.0, [0.02, 0.0, 0.0], 1.02, weak)]}
    assert collapse_findings(eagle, [1, 4]) == []


def test_the_serve_command_is_the_servers_own_flags_without_the_measurements(tmp_path):
    from eagle_pipeline.engine import server_kwargs
    from eagle_pipeline.serve.measure import mode_server

    cfg = load_config(REPO / "configs" / "kimi-k2.5-10.yaml")
    kwargs = server_kwargs(cfg)
    env = kwargs.pop("env")
    schedule = [[1, 4, 3], [5, 64, 0]]
    (tmp_path / "config.json").write_text("{}")  # all mode_server asks of a drafter folder
    server = mode_server("schedule", "/models/kimi", tmp_path, num_speculative_tokens=3, log_path="x.log",
                         schedule=schedule, drafter_settings={"attention_backend": "TRITON_ATTN"}, **kwargs)
    command = serve_command(server.serve_argv(8000), env, cfg.env)
    argv = command["argv"]
    assert argv[:3] == ["vllm", "serve", "/models/kimi"]
    for flag in ("--host", "--port", "--disable-uvicorn-access-log", "--per-request-spec-decode-metrics", "--model"):
        assert flag not in argv
    for flag, value in (("--tensor-parallel-size", "8"), ("--attention-backend", "TRITON_MLA"),
                        ("--kv-cache-dtype", "auto"), ("--max-model-len", str(cfg.verifier.max_model_len))):
        assert argv[argv.index(flag) + 1] == value
    assert "--enable-expert-parallel" in argv and "--trust-remote-code" in argv
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "eagle3" and spec["attention_backend"] == "TRITON_ATTN"
    assert spec["num_speculative_tokens_per_batch_size"] == schedule
    # The shell reads it back as the same words.
    assert shlex.split(command["command"]) == [f"{k}={v}" for k, v in command["env"].items()] + argv


@pytest.mark.parametrize("sets, problem", [
    (["serve.concurrency=[4, 1]"], "ascending order"),
    (["serve.concurrency=[]"], "measures nothing"),
    (["serve.concurrency=[1, 0]"], "not a number of requests"),
    (["serve.num_speculative_tokens_per_batch_size=[[2, 4, 3]]"], "must start at batch 1"),
    (["serve.num_speculative_tokens_per_batch_size=[[1, 4, 3], [4, 8, 0]]"], "overlaps"),
    (["serve.num_speculative_tokens_per_batch_size=[[1, 4, 5]]"], "between 0 and num_speculative_tokens 3"),
    (["serve.num_speculative_tokens_per_batch_size=[[1, 4, 0]]"], "serves no speculation"),
])
def test_the_levels_and_the_schedule_are_checked_when_the_config_loads(tmp_path, sets, problem):
    config = write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "d"), run_name="r")
    with pytest.raises(BadInput, match=problem) as caught:
        load_config(config, sets)
    assert caught.value.args[0].startswith(f"--set {sets[0]}: serve.")


def test_one_level_is_still_a_config_and_a_list_is_a_sweep(tmp_path):
    config = write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "d"), run_name="r", serve={"concurrency": 4})
    assert load_config(config).serve.concurrency_levels == [4] and load_config(config).serve.concurrency == 4
    assert load_config(config, ["serve.concurrency=[1, 4, 16]"]).serve.concurrency_levels == [1, 4, 16]
    kimi = load_config(REPO / "configs" / "kimi-k2.5-10.yaml").serve
    assert kimi.concurrency_levels == [1, 4, 16, 64] and kimi.confirm_schedule


def test_the_dry_run_line_counts_the_sweeps_server_starts_and_its_duration():
    from eagle_pipeline.serve.plan import sweep_plan_line

    line = sweep_plan_line([1, 4, 16, 64], ["none", "eagle3"], 80, 512, True, "cuda")
    assert "concurrency [1, 4, 16, 64] on each of none, eagle3, then the chosen schedule" in line
    # 3 x (20 min + (80 + 20 + 5 + 2 waves) x 512 tokens x 30 ms) = 3 x (1200 + 1643) s
    assert ": 3 server starts, roughly 2.4 h (~20 min per start, ~27 min of requests per server" in line
    assert ": 2 server starts" in sweep_plan_line([1], ["none", "eagle3"], 80, 512, False, "cuda")


def test_stage_06_sweeps_every_level_confirms_the_chosen_schedule_once_and_ends_with_its_command(
        tmp_path, monkeypatch, capsys):
    servers = FakeServers(monkeypatch)
    # Verification steps of the drafter's k_max (3) cost 1.15 plain steps alone, 3 at four requests in flight.
    servers.tpot_ms = {("none", 1): 10.0, ("none", 4): 10.0, ("eagle3", 1): 11.5 / 1.875, ("eagle3", 4): 30.0 / 1.875,
                       ("schedule", 1): 7.0, ("schedule", 4): 9.0}
    config, stage = drafter_run(tmp_path, concurrency=[1, 4])
    code, out, err = run_stage_in_process("06_serve_test.py", config, capsys)
    assert code == 0, err
    assert servers.started == ["none", "eagle3", "schedule"]
    assert servers.levels == {"none": [1, 4], "eagle3": [1, 4], "schedule": [1, 4]}
    report = json.loads((stage / "report.json").read_text())
    plan = report["serving_plan"]
    # FakeServers accept 0.5/0.25/0.125: L(k) = 1.5, 1.75, 1.875. Alone, k_max's 1.875 / 1.15 wins (k = 2: 1.75 /
    # 1.1); at four in flight 1.5 / (1 + 2/3) = 0.9 at best: no speculation.
    assert [row["k"] for row in plan["estimate"]] == [3, 0]
    assert plan["schedule"] == [[1, 2, 3], [3, 4, 0]] and plan["kind"] == "schedule"
    assert plan["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 2, 3], [3, 4, 0]]
    confirmed = plan["confirmed"]
    assert confirmed["by"] == "schedule" and [row["concurrency"] for row in confirmed["levels"]] == [1, 4]
    assert plan["speedup_by_concurrency"]["eagle3"] == pytest.approx([1.5, 1.5])  # tokens/s over none's
    assert report["concurrency"] == 1 and report["concurrency_levels"] == [1, 4]
    for field in ("num_prompts", "num_speculative_tokens", "per_position_acceptance", "tokens_per_s", "speedup"):
        assert field in report
    served = json.loads((stage / "served" / "schedule.json").read_text())
    assert served["inputs"]["speculative_config"] == plan["speculative_config"]
    md = (stage / "report.md").read_text()
    assert md.rstrip().endswith("```") and plan["command"] in md.splitlines()[-2]
    assert md.splitlines()[-2].startswith("VLLM_CPU_KVCACHE_SPACE=") and "vllm serve" in md.splitlines()[-2]
    assert "## Acceptance and speed-up across load" in md and "no collapse found" in md

    # A rerun of the same inputs serves nothing: the schedule's run is kept under the schedule it served.
    stopped(stage)
    servers.started = []
    code, out, err = run_stage_in_process("06_serve_test.py", config, capsys)
    assert code == 0, err
    assert servers.started == [] and "confirmed by an earlier run" in out



def test_a_confirming_server_that_does_not_start_leaves_the_plan_unconfirmed_and_the_stage_goes_on(
        tmp_path, monkeypatch, capsys):
    servers = FakeServers(monkeypatch)
    servers.tpot_ms = {("none", 1): 10.0, ("none", 4): 10.0, ("eagle3", 1): 11.5 / 1.875, ("eagle3", 4): 30.0 / 1.875}
    servers.fail = {"schedule"}
    config, stage = drafter_run(tmp_path, concurrency=[1, 4])
    code, out, err = run_stage_in_process("06_serve_test.py", config, capsys)
    assert code == 0, err
    assert servers.started == ["none", "eagle3", "schedule"] and "the chosen setting is not confirmed" in out
    report = json.loads((stage / "report.json").read_text())
    plan = report["serving_plan"]
    assert plan["confirmed"] is None and "server-schedule.log" in plan["confirm_failed"]
    assert plan["schedule"] == [[1, 2, 3], [3, 4, 0]] and "num_speculative_tokens_per_batch_size" in plan["command"]
    assert "not confirmed (its server failed to start" in (stage / "report.md").read_text()
    assert report["verdict"].startswith("PASS") and not (stage / "served" / "schedule.json").exists()


def test_switching_the_confirmation_off_keeps_the_modes_already_served(tmp_path, monkeypatch, capsys):
    servers = FakeServers(monkeypatch)
    servers.fail = {"eagle3"}
    config, stage = drafter_run(tmp_path, concurrency=[1, 4])
    assert run_stage_in_process("06_serve_test.py", config, capsys)[0] == 1
    servers.fail, servers.started = set(), []
    code, out, err = run_stage_in_process("06_serve_test.py", config, capsys, "--set", "serve.confirm_schedule=false")
    assert code == 0, err  # no --force: what none served is kept
    assert servers.started == ["eagle3"] and "serving eagle3 only" in out

def test_no_speculation_everywhere_is_said_and_served_without_a_drafter(tmp_path, monkeypatch, capsys):
    servers = FakeServers(monkeypatch)
    servers.tpot_ms = {("none", 1): 10.0, ("none", 4): 10.0, ("eagle3", 1): 30.0 / 1.875, ("eagle3", 4): 40.0 / 1.875}
    config, stage = drafter_run(tmp_path, concurrency=[1, 4])
    code, out, err = run_stage_in_process("06_serve_test.py", config, capsys)
    assert code == 0, err
    assert servers.started == ["none", "eagle3"]  # the run without speculation confirms it
    plan = json.loads((stage / "report.json").read_text())["serving_plan"]
    assert plan["speculation_off_everywhere"] and plan["schedule"] == [[1, 4, 0]] and plan["confirmed"]["by"] == "none"
    assert plan["speculative_config"] is None and "--speculative-config" not in plan["argv"]
    md = (stage / "report.md").read_text()
    assert "k = 0 at every level measured" in md and md.rstrip().endswith("```")


def test_a_level_its_confirming_run_served_slower_goes_back_to_no_speculation():
    plan = plan_serving(modes_with({1: 1.1, 4: 2.2, 16: 2.2}), [1, 4, 16], 3)
    assert [row["k"] for row in plan["estimate"]] == [3, 2, 2] and plan["schedule"] == [[1, 2, 3], [3, 16, 2]]
    confirmed = [{"concurrency": 1, "speedup": 2.1}, {"concurrency": 4, "speedup": 1.0},
                 {"concurrency": 16, "speedup": 0.9}]
    revised = withdraw_slower(plan, confirmed)
    # 16 served slower than none: k = 0 there; 4 served even with none and keeps its k.
    assert [row["k"] for row in revised["estimate"]] == [3, 2, 0]
    assert revised["schedule"] == [[1, 2, 3], [3, 8, 2], [9, 16, 0]] and revised["kind"] == "schedule"
    assert revised["estimate"][2]["withdrawn_k"] == 2 and revised["estimate"][2]["withdrawn_speedup"] == 0.9
    spec = plan_speculative_config(revised, {"method": "eagle3", "model": "d", "num_speculative_tokens": 3})
    assert spec["num_speculative_tokens_per_batch_size"] == [[1, 2, 3], [3, 8, 2], [9, 16, 0]]
    assert withdraw_slower(plan, [{**row, "speedup": 1.2} for row in confirmed]) is plan
    configured = plan_serving(modes_with({1: 1.1, 4: 2.2, 16: 2.2}), [1, 4, 16], 3, [[1, 16, 2]])
    assert withdraw_slower(configured, confirmed) is configured  # the config's schedule is served as configured


def test_a_schedule_its_confirming_run_served_slower_is_not_the_command(tmp_path, monkeypatch, capsys):
    servers = FakeServers(monkeypatch)
    servers.tpot_ms = {("none", 1): 10.0, ("none", 4): 10.0, ("eagle3", 1): 11.5 / 1.875, ("eagle3", 4): 30.0 / 1.875,
                       ("schedule", 1): 7.0, ("schedule", 4): 9.0}
    servers.tokens_per_s["schedule"] = 15.0  # none serves 20 tokens/s: the schedule is slower at every level
    config, stage = drafter_run(tmp_path, concurrency=[1, 4])
    code, out, err = run_stage_in_process("06_serve_test.py", config, capsys)
    assert code == 0, err
    assert servers.started == ["none", "eagle3", "schedule"]
    plan = json.loads((stage / "report.json").read_text())["serving_plan"]
    assert [row["k"] for row in plan["estimate"]] == [0, 0] and plan["estimate"][0]["withdrawn_k"] == 3
    assert plan["chosen_schedule"] == plan["schedule"] == [[1, 4, 0]] and plan["speculation_off_everywhere"]
    assert plan["speculative_config"] is None and "--speculative-config" not in plan["argv"]
    assert plan["confirmed"]["by"] == "schedule" and plan["confirmed"]["levels"][0]["speedup"] == pytest.approx(0.75)
    md = (stage / "report.md").read_text()
    assert "| 0 (k = 3 served slower) |" in md
    assert "The confirming run served k = 3 at concurrency 1 at 0.75x of no speculation's tokens/s" in md
    served = json.loads((stage / "served" / "schedule.json").read_text())
    assert served["inputs"]["speculative_config"]["num_speculative_tokens_per_batch_size"] == [[1, 2, 3], [3, 4, 0]]

    # A rerun withdraws the same levels from the kept confirming run, with no server.
    stopped(stage)
    servers.started = []
    code, out, err = run_stage_in_process("06_serve_test.py", config, capsys)
    assert code == 0, err
    assert servers.started == [] and json.loads((stage / "report.json").read_text())["serving_plan"] == plan


@pytest.fixture(scope="module")
def schedule_config(tmp_path_factory):
    """vLLM's config of the embedded target speculating with a stand-in drafter under a schedule (CPU build)."""
    from released_drafter_standin import SMOLLM2, write_released_standin

    from eagle_pipeline.embedded import materialize
    from eagle_pipeline.plan.rehearsal import planned_engines  # noqa: F401 - the path stage 06 builds it by
    from eagle_pipeline.vllm_config import create_config, quiet_vllm

    root = tmp_path_factory.mktemp("schedule")
    drafter = write_released_standin(root / "drafter", SMOLLM2)
    spec = {"method": "eagle3", "model": str(drafter), "num_speculative_tokens": 3,
            "num_speculative_tokens_per_batch_size": [[1, 1, 3], [2, 4, 1], [5, 8, 0]]}
    args = {"model": str(materialize("smollm2-135m-instruct")), "max_model_len": 1024, "dtype": "float32",
            "enforce_eager": True, "speculative_config": spec}
    with quiet_vllm():
        return create_config(args), args


def test_vllms_config_takes_the_schedule_and_its_scheduler_changes_k_with_the_batch_size(schedule_config):
    """create_engine_config() keeps the schedule; the engine core's scheduler of this CPU build (the one its V1
    model runner takes `num_spec_tokens_to_schedule` from, docs/engines.md) drafts 3 tokens for one request, 1 for
    two to four and none above four. The scheduler is vLLM's own, given a KV-cache layout; no model loads."""
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    from eagle_pipeline.vllm_config import quiet_vllm

    config, _ = schedule_config
    assert config.speculative_config.num_speculative_tokens_per_batch_size == [(1, 1, 3), (2, 4, 1), (5, 8, 0)]
    assert not config.use_v2_model_runner  # the CPU build has no Triton: the V1 runner, which reads the step's k
    block = config.cache_config.block_size
    config.cache_config.num_gpu_blocks = 64
    layout = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=block, num_kv_heads=1, head_size=8, dtype=torch.float32))])
    drafted = {}
    for batch in (1, 2, 4, 5, 9):
        with quiet_vllm():
            scheduler = Scheduler(config, layout, StructuredOutputManager(config), block_size=block)
        for i in range(batch):
            scheduler.add_request(Request(request_id=str(i), prompt_token_ids=[1, 2, 3], pooling_params=None,
                                          sampling_params=SamplingParams(max_tokens=4)))
        output = scheduler.schedule()
        assert len(output.num_scheduled_tokens) == batch
        drafted[batch] = output.num_spec_tokens_to_schedule
    assert drafted == {1: 3, 2: 1, 4: 1, 5: 0, 9: 0}


def test_the_cpu_builds_model_runner_drafts_the_k_the_scheduler_chose():
    """The CPU worker's V1 runner is vLLM's GPUModelRunner, whose drafting passes the step's
    `num_spec_tokens_to_schedule` to the EAGLE proposer, which returns no drafts for k = 0."""
    import inspect

    from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    assert issubclass(CPUModelRunner, GPUModelRunner) and "propose_draft_token_ids" not in vars(CPUModelRunner)
    drafting = inspect.getsource(GPUModelRunner.propose_draft_token_ids)
    assert "num_spec_tokens_to_schedule = scheduler_output.num_spec_tokens_to_schedule" in drafting
    assert "num_speculative_tokens=num_spec_tokens_to_schedule" in drafting
    proposing = inspect.getsource(SpecDecodeBaseProposer.propose)
    assert "self.num_speculative_tokens = num_speculative_tokens" in proposing
    assert "if self.num_speculative_tokens == 0:" in proposing


def test_the_rehearsal_refuses_a_schedule_vllms_scheduler_would_refuse(schedule_config):
    from eagle_pipeline.vllm_config import check_engine

    _, args = schedule_config
    good = check_engine("cpu", {k: v for k, v in args.items()})
    assert good.error is None, good.error
    bad = {**args, "speculative_config": {**args["speculative_config"],
                                         "num_speculative_tokens_per_batch_size": [[2, 4, 1]]}}
    refused = check_engine("cpu", bad)
    assert "must start at 1" in refused.error and "[[2, 4, 1]]" in refused.error


def test_the_command_serves_the_method_that_served_fastest_over_the_levels(tmp_path, monkeypatch, capsys):
    """The drafter as planned confirmed at 1.1x and 1.03x while n-gram served 1.25x at both levels: the plan says so
    per level and the command serves n-gram's speculative_config, not the drafter's; where the drafter is faster it
    keeps the command."""
    servers = FakeServers(monkeypatch)
    servers.tpot_ms = {("none", 1): 10.0, ("none", 4): 10.0, ("eagle3", 1): 11.5 / 1.875, ("eagle3", 4): 30.0 / 1.875,
                       ("schedule", 1): 9.0, ("schedule", 4): 9.5}
    servers.tokens_per_s |= {"ngram": 25.0, "schedule": 21.0}  # none serves 20 tokens/s
    config, stage = drafter_run(tmp_path, concurrency=[1, 4], ngram_baseline=True)
    code, out, err = run_stage_in_process("06_serve_test.py", config, capsys)
    assert code == 0, err
    plan = json.loads((stage / "report.json").read_text())["serving_plan"]
    assert plan["method"] == "ngram" and [row["fastest"] for row in plan["method_by_concurrency"]] == ["ngram"] * 2
    assert plan["method_by_concurrency"][0]["speedup"] == {"eagle3": 1.05, "ngram": 1.25, "none": 1.0}
    assert plan["speculative_config"]["method"] == "ngram" and '"method": "ngram"' in plan["command"]
    assert "ngram served faster than the drafter as planned (1.25x at concurrency 1, 1.25x at concurrency 4), so " \
           "the command serves ngram." in (stage / "report.md").read_text()

    servers.tokens_per_s["ngram"] = 19.0
    code, _, err = run_stage_in_process("06_serve_test.py", config, capsys, "--force")
    plan = json.loads((stage / "report.json").read_text())["serving_plan"]
    assert code == 0 and plan["method"] == "eagle3" and plan["speculative_config"]["method"] == "eagle3", err
