"""Online training for real, on the CPU: vLLM capture servers, a Mooncake master and store over TCP on localhost,
and stage 04 training through speculators' online dataset, on the shared smoke run's conversations (stage 01
reused, stages 02-03 redone in online mode). Each test starts vLLM servers: run them one at a time.

- Mooncake: master, store, capture server and trainer are four processes; the capture server is killed midway
  through an epoch, its supervisor starts it again, and training finishes on every sample.
- A capture server elsewhere (`python -m eagle_pipeline.online.serve_capture`): checked before training (a
  transfer it does not serve is refused in one line naming it), killed for good mid-epoch (stage 04 stops naming
  it), started again; the rerun resumes from the last complete checkpoint and ends where an unbroken run ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import REPO, ok, run_stage, run_stage_in_process, write_smoke_config

from eagle_pipeline.online.mooncake import mooncake_problem
from eagle_pipeline.process_tree import descendants, kill_pid_tree, process_state
from eagle_pipeline.serve.server import find_free_port

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def online_run(small_run, folder: Path, **hidden_states) -> tuple[Path, Path]:
    """The smoke run's conversations (its stage 01) with stages 02-03 redone in online mode: (config, run dir)."""
    _, _, reference = small_run
    run_dir = folder / "data" / "t"
    run_dir.mkdir(parents=True)
    shutil.copytree(reference / "01_generate_data", run_dir / "01_generate_data")
    config = write_smoke_config(folder / "run.yaml", data_root=str(folder / "data"), run_name="t",
                                hidden_states={"mode": "online", "online_window": 1, **hidden_states})
    ok(run_stage("02_extract_hidden.py", config))
    ok(run_stage("03_build_vocab_map.py", config))
    assert not list((run_dir / "02_extract_hidden" / "data" / "hidden_states").glob("*.safetensors"))
    return config, run_dir


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    return process_state(pid) not in ("Z", "X", None)


def wait_for(condition, what: str, timeout: float = 600, process: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if process is not None and process.poll() is not None:
            raise AssertionError(f"exited with {process.returncode} while waiting for {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def capture_server_below(pid: int) -> tuple[int, int] | None:
    """(pid, port) of the vLLM API server among a process's descendants."""
    for child in descendants(pid):
        line = cmdline(child)
        if "vllm.entrypoints.openai.api_server" in line and "extract_hidden_states" in line:
            words = line.split()
            return child, int(words[words.index("--port") + 1])
    return None


def finished_requests(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return 0
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:request_success_total")))


def stage04(config: Path, log: Path, *args: str) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, str(REPO / "04_train.py"), "--config", str(config), *args], cwd=REPO,
                                env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "04_train" / "manifest.json").read_text())


# Online training through a real capture server is shown in the suite by the test below; this one adds the
# Mooncake transfer and a server restart.
@pytest.mark.heavy
def test_mooncake_online_training_survives_a_capture_server_restart(small_run, tmp_path):
    problem = mooncake_problem()
    if problem:
        pytest.skip(f"the Mooncake transfer cannot run here: {problem}; pip install -r requirements/online.txt")
    config, run_dir = online_run(small_run, tmp_path, transfer="mooncake", capture_retry_s=300)
    log = tmp_path / "04.log"
    stage = stage04(config, log)
    try:
        # Kept validation rows captured: the master, the store and the server are up and checked.
        wait_for(lambda: list((run_dir / "04_train" / "kept_states").glob("hs_*.safetensors")), "the kept rows",
                 process=stage)
        server, port = capture_server_below(stage.pid)
        programs = {pid: cmdline(pid) for pid in descendants(stage.pid)}
        master = [pid for pid, line in programs.items() if "mooncake_master" in line]
        store = [pid for pid, line in programs.items() if "mooncake_client" in line]
        assert len(master) == len(store) == 1, programs
        assert len({stage.pid, server, master[0], store[0]}) == 4  # trainer, capture server, master, store
        # The probe and the kept row, then the first training samples: kill the server midway through epoch 0.
        wait_for(lambda: finished_requests(port) >= 3, "the first training samples", process=stage)
        os.killpg(server, signal.SIGKILL)
        assert stage.wait(timeout=1200) == 0, log.read_text()[-5000:]
    finally:
        if stage.poll() is None:
            os.killpg(stage.pid, signal.SIGKILL)
    counts = manifest(run_dir)["counts"]
    online = counts["online"]
    assert counts["epochs_completed"] == 2 and online["server_restarts"] == 1
    assert online["transfer"] == "mooncake" and online["started_here"] == {"capture_servers": 1, "mooncake": True}
    assert 0 < online["store_peak_bytes"] <= online["window_bound_bytes"]
    assert online["kept_rows"] and online["leftover_files"] == 0
    text = log.read_text()
    assert "started again (restart 1 of 3)" in text
    # No sample was dropped for the restart (speculators would say so), and the epochs took their usual steps.
    assert "dropped" not in text
    state = json.loads((run_dir / "04_train" / "checkpoints" / "1" / "training_state.json").read_text())
    assert state["global_step"] == 2
    for pid in (server, master[0], store[0]):
        assert not alive(pid)


def test_a_capture_server_elsewhere_is_checked_named_when_gone_and_training_resumes(small_run, tmp_path, capsys):
    port = find_free_port()
    endpoint = f"http://127.0.0.1:{port}/v1"
    config, run_dir = online_run(small_run, tmp_path, capture_endpoints=[endpoint], capture_retry_s=10)

    code, _, stderr = run_stage_in_process("04_train.py", config, capsys, "--set", "hidden_states.mode=offline",
                                           "--set", "hidden_states.capture_endpoints=[]")
    assert code == 2
    assert "error: hidden_states.mode: offline, but stage 02 prepared its data for mode online" in stderr

    server_log = tmp_path / "capture.log"

    def serve() -> subprocess.Popen:
        with open(server_log, "ab") as out:
            process = subprocess.Popen([sys.executable, "-m", "eagle_pipeline.online.serve_capture", "--config", str(config),
                                        "--port", str(port), "--host", "127.0.0.1"], cwd=REPO, env=ENV, stdout=out,
                                       stderr=subprocess.STDOUT, start_new_session=True)
        wait_for(lambda: server_log.read_text().count(f"capture server {endpoint}") > serve.started, "the capture server",
                 process=process)
        serve.started += 1
        return process

    serve.started = 0
    server = serve()
    try:
        code, _, stderr = run_stage_in_process("04_train.py", config, capsys, "--set", "hidden_states.transfer=fp8")
        assert code == 2
        assert stderr.strip() == (
            f"error: hidden_states.capture_endpoints: {endpoint} captures transfer 'file' but this run needs 'fp8' "
            f"(hidden_states.transfer); start it with this run's config (scripts/remote.sh capture CONFIG, or python -m "
            f"eagle_pipeline.online.serve_capture)")
        assert not (run_dir / "04_train" / "manifest.json").exists()  # refused before anything was written

        log = tmp_path / "04.log"
        stage = stage04(config, log)
        checkpoint = run_dir / "04_train" / "checkpoints" / "0" / "validation.json"
        wait_for(checkpoint.exists, "epoch 0's checkpoint", process=stage)
        # The host gone: the capture server and the vLLM server it started, at once.
        kill_pid_tree(server.pid, reap=server.wait)
        assert stage.wait(timeout=600) == 1
        text = log.read_text()
        assert f"failed: CaptureUnavailable: capture server {endpoint} delivered no hidden states" in text
        assert "rerun stage 04: it resumes from the last complete checkpoint" in text
        assert manifest(run_dir)["status"] != "complete"
        assert (run_dir / "04_train" / "capture_failed.txt").is_file()

        server = serve()
        ok(run_stage("04_train.py", config))
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            server.wait(timeout=120)
    stats = json.loads((run_dir / "04_train" / "run_stats.json").read_text())
    assert stats["resumed_from"] == {"epoch": 0, "step": 1}
    done = manifest(run_dir)
    assert done["counts"]["epochs_completed"] == 2 and done["counts"]["last_checkpoint"] == "checkpoints/1"
    state = json.loads((run_dir / "04_train" / "checkpoints" / "1" / "training_state.json").read_text())
    assert state["global_step"] == 2  # one step per epoch on the smoke run, as an unbroken run takes
    online = done["counts"]["online"]
    assert online["started_here"] == {"capture_servers": 0, "mooncake": False}
    assert online["kept_captured_now"] == 0  # kept by the first attempt
    assert 0 < online["disk_peak_bytes"] <= online["window_bound_bytes"]
    assert not (run_dir / "04_train" / "capture_failed.txt").exists()
