"""Stage 06's served measurements on disk: each mode kept as it is served, a rerun serving only what is missing,
records that are torn or impossible, a swapped draft vocabulary, README's rerun against the run's own kept
baseline, and a server stop that meets a zombie.

Stage 06 runs in this process with its vLLM servers replaced by stand-ins (`FakeServers`), except in the test
of README's command line, which serves for real."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import REPO, copy_of_run, run_stage_in_process, without_log_records, write_config
from released_drafter_standin import write_released_standin

from eagle_pipeline.serve.client import PromptRun, RequestResult
from eagle_pipeline.serve.server import ServerFailed

K = 3  # serve.num_speculative_tokens of configs/tiny.yaml


class FakeServers:
    """Stands in for measure.VllmServer and the HTTP calls around it: every mode answers each prompt with two
    tokens; eagle3 (and the confirming "schedule") accepts its drafts as PER_POSITION says. `fail` names the modes
    whose server does not start; `tpot_ms[(mode, level)]` the server's time per output token at a level (none:
    not reported); `levels[mode]` records the levels each mode's prompts were run at."""

    PER_POSITION = [0.5, 0.25, 0.125]

    def __init__(self, monkeypatch):
        from eagle_pipeline.serve import measure

        self.started: list[str] = []
        self.fail: set[str] = set()
        self.tokens_per_s = {"none": 20.0, "ngram": 25.0, "eagle3": 30.0, "schedule": 35.0}
        self.tpot_ms: dict[tuple[str, int], float] = {}
        self.levels: dict[str, list[int]] = {}
        fakes = self

        class Server:
            def __init__(self, target_dir, *, speculative_config=None, log_path, **kwargs):
                self.log_path, self.speculative_config = log_path, speculative_config
                self.mode = Path(log_path).stem.removeprefix("server-")
                self.model, self.base_url, self.start_seconds = str(target_dir), self.mode, None

            def __enter__(self):
                fakes.started.append(self.mode)
                if self.mode in fakes.fail:
                    raise ServerFailed(f"vLLM server exited with code 1 before becoming healthy; log {self.log_path}")
                self.start_seconds = 1.0
                return self

            def __exit__(self, *exc_info):
                pass

        def run_prompts(base_url, model, prompts, **kwargs):
            if len(prompts) > 1:  # not the warm-up request
                fakes.levels.setdefault(base_url, []).append(kwargs["concurrency"])
            # wall time such that tokens/s is the mode's figure
            requests = [RequestResult(text=f"answer {i}", output_tokens=2, prompt_tokens=3, latency_s=0.1,
                                      finish_reason="length", prompt_token_ids=[1, 2, 3], token_ids=[4, 5])
                        for i in range(len(prompts))]
            return PromptRun(requests, wall_s=2 * len(prompts) / fakes.tokens_per_s[base_url])

        def counters(base_url, drafts):
            accepted = [p * drafts for p in fakes.PER_POSITION] if base_url != "none" else []
            tpot = fakes.tpot_ms.get((base_url, (fakes.levels.get(base_url) or [0])[-1])) if drafts else None
            return {"num_drafts": drafts if base_url != "none" else 0, "num_draft_tokens": K * drafts,
                    "num_accepted_tokens": sum(accepted), "accepted_per_pos": accepted, "generation_tokens": 0.0,
                    "tpot_sum_s": 0.0 if tpot is None else tpot / 1000, "tpot_count": 0.0 if tpot is None else 1.0,
                    "ttft_sum_s": 0.0, "ttft_count": 0.0}

        monkeypatch.setattr(measure, "VllmServer", Server)
        monkeypatch.setattr(measure, "run_prompts", run_prompts)
        monkeypatch.setattr(measure, "scrape_spec_metrics", lambda base_url: counters(base_url, 0))
        monkeypatch.setattr(measure, "wait_for_counted_tokens", lambda base_url, before, tokens: counters(base_url, 8))


@pytest.fixture
def servers(monkeypatch):
    return FakeServers(monkeypatch)


def drafter_run(tmp_path: Path, **serve) -> tuple[Path, Path]:
    """A config serving a stand-in drafter folder (serve.drafter: no stages 01-05 needed), without the offline
    prediction: (config, stage 06's folder)."""
    drafter = write_released_standin(tmp_path / "drafter")
    config = write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="r",
                          serve={"drafter": str(drafter), "predict": False, "ngram_baseline": False, **serve})
    return config, tmp_path / "data" / "r" / "06_serve_test"


def stopped(stage: Path) -> None:
    """The stage's manifest as a run that stopped after serving left it ("running", its digests kept)."""
    manifest = json.loads((stage / "manifest.json").read_text())
    (stage / "manifest.json").write_text(json.dumps({**manifest, "status": "running"}))


def test_an_edited_served_record_is_served_again_not_trusted(tmp_path, servers, capsys):
    """A served record whose figures were changed within what is possible, after a run that stopped: the digest
    the manifest keeps of it no longer matches, so that mode is served again and the report has its figures."""
    config, stage = drafter_run(tmp_path)
    assert run_stage_in_process("06_serve_test.py", config, capsys)[0] == 0
    assert set(json.loads((stage / "manifest.json").read_text())["kept"]) == {"served/none.json", "served/eagle3.json"}
    stopped(stage)
    path = stage / "served" / "eagle3.json"
    edited = json.loads(path.read_text())
    edited["record"]["summary"]["tokens_per_s"] = 600.0
    path.write_text(json.dumps(edited))
    servers.started = []
    code, out, err = run_stage_in_process("06_serve_test.py", config, capsys)
    assert code == 0, err
    assert servers.started == ["eagle3"] and "serving eagle3 only" in out
    assert json.loads((stage / "report.json").read_text())["tokens_per_s"]["eagle3"] == pytest.approx(30.0)


def test_a_failed_eagle3_start_keeps_the_served_no_speculation_run_and_the_rerun_starts_one_server(
        tmp_path, servers, capsys):
    config, stage = drafter_run(tmp_path)
    servers.fail = {"eagle3"}
    code, _, err = run_stage_in_process("06_serve_test.py", config, capsys)
    assert code == 1 and "ServerFailed" in err
    assert servers.started == ["none", "eagle3"]
    kept = json.loads((stage / "served" / "none.json").read_text())["record"]
    assert kept["summary"]["tokens_per_s"] == pytest.approx(20.0)
    assert json.loads((stage / "baseline" / "answers.json").read_text())["texts"] == kept["texts"]
    assert not (stage / "served" / "eagle3.json").exists()

    servers.fail, servers.started = set(), []
    servers.tokens_per_s["none"] = 99.0  # a second no-speculation run would show here
    code, out, err = run_stage_in_process("06_serve_test.py", config, capsys)
    assert code == 0, err
    assert servers.started == ["eagle3"] and "serving eagle3 only" in out
    report = json.loads((stage / "report.json").read_text())
    assert report["tokens_per_s"]["none"] == pytest.approx(20.0) and report["speedup"] == pytest.approx(1.5)
    assert report["mean_acceptance_length"] == pytest.approx(1 + sum(FakeServers.PER_POSITION))


def test_torn_or_lost_served_records_are_rebuilt_from_the_report_and_the_baseline_without_a_server(
        tmp_path, servers, capsys):
    config, stage = drafter_run(tmp_path, ngram_baseline=True)
    assert run_stage_in_process("06_serve_test.py", config, capsys)[0] == 0
    want = json.loads((stage / "report.json").read_text())
    (stage / "served" / "eagle3.json").write_text('{"inputs": {"drafter": "ab')  # torn
    (stage / "served" / "ngram.json").unlink()
    (stage / "served" / "none.json").unlink()

    servers.started = []
    code, out, err = run_stage_in_process("06_serve_test.py", config, capsys)
    assert code == 0, err
    assert servers.started == [] and "predicting without serving again" in out
    got = json.loads((stage / "report.json").read_text())
    for key in ("tokens_per_s", "mean_acceptance_length", "per_position_acceptance", "greedy_match", "modes"):
        assert got[key] == want[key], key
    for mode in ("none", "ngram", "eagle3"):  # whole again, for the next rerun
        assert json.loads((stage / "served" / f"{mode}.json").read_text())["mode"] == mode


def test_an_impossible_served_acceptance_is_not_trusted(tmp_path):
    from eagle_pipeline.errors import BadInput
    from eagle_pipeline.serve.report import read_report, read_served, write_served
    from eagle_pipeline.serve.spec_metrics import acceptance_problem

    possible = {"mean_acceptance_length": 1.875, "per_position_acceptance": [0.5, 0.25, 0.125]}
    assert acceptance_problem(possible, 3) is None
    assert "impossible with 3 draft tokens" in acceptance_problem({"mean_acceptance_length": 9.9}, 3)
    assert "not 1 + the sum" in acceptance_problem({"mean_acceptance_length": 3.9,
                                                    "per_position_acceptance": [0.5, 0.25, 0.125]}, 3)
    assert "per-position" in acceptance_problem({"mean_acceptance_length": 2.0, "per_position_acceptance": [1.5]}, 3)

    summary = {"tokens_per_s": 30.0, "mean_acceptance_length": 9.9, "per_position_acceptance": [0.5, 0.25, 0.125]}
    write_served(tmp_path, {"serve": "x"}, "eagle3", {"summary": summary, "texts": ["a"], "token_ids": [[[1], [2]]]})
    stage = SimpleNamespace(dir=tmp_path, kept_whole=lambda path: True, keep_file=lambda path: path)  # as written
    assert read_served(stage, {"serve": "x"}, ["eagle3"], K) == {}  # served again, not reported
    summary["mean_acceptance_length"] = 1.875
    write_served(tmp_path, {"serve": "x"}, "eagle3", {"summary": summary, "texts": ["a"], "token_ids": [[[1], [2]]]})
    assert read_served(stage, {"serve": "x"}, ["eagle3"], K)["eagle3"]["summary"] == summary
    assert read_served(stage, {"serve": "y"}, ["eagle3"], K) == {}
    stage.kept_whole = lambda path: False  # changed since it was written
    assert read_served(stage, {"serve": "x"}, ["eagle3"], K) == {}

    report = {"num_prompts": 1, "num_speculative_tokens": 3, "mean_acceptance_length": 9.9,
              "per_position_acceptance": [0.5, 0.25, 0.125], "tokens_per_s": {"eagle3": 30.0}}
    (tmp_path / "report.json").write_text(json.dumps(report))
    with pytest.raises(BadInput, match="mean acceptance length 9.9 is impossible with 3 draft tokens"):
        read_report(tmp_path / "report.json")


def test_a_swapped_draft_vocabulary_is_named_by_stages_05_and_06(tmp_path, servers, capsys):
    """Stage 03 rebuilt with another vocabulary after 04-06 finished (planted manifests): neither later stage
    calls itself complete."""
    run_dir = tmp_path / "data" / "r"

    def manifest(stage: str, **fields) -> None:
        (run_dir / stage).mkdir(parents=True, exist_ok=True)
        (run_dir / stage / "manifest.json").write_text(json.dumps({"status": "complete", "counts": {}, **fields}))

    manifest("03_build_vocab_map", inputs={}, output_fingerprint="vocab-a")
    manifest("04_train", inputs={"d2t": "vocab-a"}, output_fingerprint="weights")
    manifest("05_convert", inputs={"d2t": "vocab-a"}, output_fingerprint="weights")
    write_released_standin(run_dir / "05_convert" / "vllm")
    config = write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="r",
                          serve={"predict": False, "ngram_baseline": False})
    assert run_stage_in_process("06_serve_test.py", config, capsys)[0] == 0

    manifest("03_build_vocab_map", inputs={}, output_fingerprint="vocab-b")
    code, _, err = run_stage_in_process("05_convert.py", config, capsys)
    assert code == 2 and "trained with another draft vocabulary (d2t)" in without_log_records(err)[0]
    code, _, err = run_stage_in_process("06_serve_test.py", config, capsys)
    assert code == 2 and "input 'd2t' changed" in without_log_records(err)[0]


# A server's process group whose engine process outlives the API server as a zombie that nobody reaps: the
# process stopping the server is a subreaper (as a container's init may be) that never waits for orphans.
ZOMBIE_GROUP = r"""
import ctypes, json, os, subprocess, sys, time
from eagle_pipeline.child_process import ChildProcess
from eagle_pipeline.process_tree import process_state
from eagle_pipeline.serve.server import VllmServer

ctypes.CDLL(None).prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans of the group become ours, never reaped
server = VllmServer("/models/target", log_path=sys.argv[1], stop_grace_s=5.0)
server.child = ChildProcess([sys.executable, "-c", "import subprocess, sys, time\n"
                             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
                             "time.sleep(600)"], sys.argv[1], name="vLLM server", stop_grace_s=5.0)
server.child.start()
group, engine, deadline = server.process.pid, [], time.monotonic() + 60
while not engine and time.monotonic() < deadline:  # until the engine stand-in has started
    time.sleep(0.1)
    engine = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != group
              and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[2] == str(group)]
started = time.monotonic()
server.stop()
print(json.dumps({"engine": engine, "seconds": time.monotonic() - started, "state": process_state(engine[0])}))
"""


def test_a_server_stop_counts_an_unreaped_zombie_of_its_group_as_gone(tmp_path):
    result = subprocess.run([sys.executable, "-c", ZOMBIE_GROUP, str(tmp_path / "server.log")], cwd=REPO,
                            capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    stopped = json.loads(result.stdout.splitlines()[-1])
    assert len(stopped["engine"]) == 1
    assert stopped["state"] == "Z"  # still a member of the group when stop() returned: it used to fail the stage
    assert stopped["seconds"] < 5.0


@pytest.mark.vllm
def test_readmes_cheap_rerun_keeps_its_own_baseline_under_force(finished_small_run, tmp_path):
    """README's command line, as written there, on a copy of the finished smoke run: the run's own stage 06 is
    the baseline, --force keeps it, and one server (EAGLE-3) serves."""
    line = re.search(r"`(scripts/remote\.sh run 6 CONFIG --set serve\.baseline=[^`]+)`",
                     (REPO / "README.md").read_text()).group(1)
    config, run_dir = copy_of_run(finished_small_run[1], tmp_path / "copy", "c")
    # The config's, not the command's: no n-gram server, and the smoke config's schedule not served again.
    config.write_text(config.read_text() + "serve: {ngram_baseline: false, confirm_schedule: false}\n")
    stage = run_dir / "06_serve_test"
    baseline_before = (stage / "baseline" / "answers.json").read_bytes()
    states_before = sorted(p.name for p in (stage / "baseline").glob("hs_*.safetensors"))
    assert states_before
    argv = line.replace("CONFIG", str(config)).replace("/data/<run>", str(run_dir)).split()
    env = {**os.environ, "EAGLE_HOST": "local", "EAGLE_REMOTE_DIR": str(tmp_path / "host"), "EAGLE_NO_TMUX": "1",
           "HF_HUB_OFFLINE": "1"}
    (tmp_path / "host").mkdir()
    os.symlink(REPO / ".venv", tmp_path / "host" / ".venv")  # stands in for `remote.sh setup`
    launched = subprocess.run([str(REPO / argv[0]), *argv[1:]], env=env, capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stdout + launched.stderr
    done = run_dir / "logs" / "06_serve_test.exit"
    deadline = time.monotonic() + 1500
    while not done.exists():
        assert time.monotonic() < deadline, "README's rerun did not finish"
        time.sleep(1)
    out = (run_dir / "logs" / "06_serve_test.out").read_text(errors="replace")
    assert done.read_text().strip() == "0", out[-4000:]
    manifest = json.loads((stage / "manifest.json").read_text())
    # The EAGLE-3 server alone: the baseline holds the answers without speculation and their states.
    starts = [s["what"] for s in manifest["engine_starts"]["starts"] if s["loads_target"]]
    assert manifest["status"] == "complete" and starts == ["vLLM server (server-eagle3)"], manifest["engine_starts"]
    starts = [text for text in out.splitlines() if "starting vLLM server" in text]
    assert len(starts) == 1 and starts[0].startswith("[eagle3]"), out[-4000:]
    assert (stage / "baseline" / "answers.json").read_bytes() == baseline_before
    assert sorted(p.name for p in (stage / "baseline").glob("hs_*.safetensors")) == states_before
    report = json.loads((stage / "report.json").read_text())
    assert report["baseline"] == str(stage / "baseline") and report["predicted_mean_acceptance_length"] is not None
