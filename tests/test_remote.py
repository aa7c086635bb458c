"""The SSH driver in its local mode: sync, detached run, the run lock, stop, status after a failed stage."""

import json
import os
import subprocess
import time
from pathlib import Path

from conftest import REPO, process_alive, write_config

from eagle_pipeline import locks


def remote(tmp_path, *args, timeout=120):
    env = {**os.environ, "EAGLE_HOST": "local", "EAGLE_REMOTE_DIR": str(tmp_path / "host"), "EAGLE_NO_TMUX": "1",
           "EAGLE_STOP_GRACE": "20", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(REPO / "scripts" / "remote.sh"), *args], env=env, capture_output=True, text=True, timeout=timeout)


def wait_for(path, timeout=120):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def wait_released(lock, timeout=30):
    """Until no job holds the run lock and none left its record there."""
    deadline = time.monotonic() + timeout
    while locks.probe(lock)[0] != "free":
        assert time.monotonic() < deadline, f"{lock} is still held: {locks.probe(lock)}"
        time.sleep(0.2)


def synced_host(tmp_path):
    """A host folder made by `sync`, with this checkout's .venv standing in for the one `setup` builds."""
    result = remote(tmp_path, "sync")
    assert result.returncode == 0, result.stderr
    os.symlink(REPO / ".venv", tmp_path / "host" / ".venv")
    return tmp_path / "host"


def lock_fields(lock):
    state, record = locks.probe(lock)
    assert state == "live", state
    return record


def running_in_group(pgid):
    """Pids of running (not zombie) processes in process group `pgid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if fields[2] == str(pgid) and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def one_error_line(result):
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.stderr
    return lines[0]


def test_run_detached_then_status_shows_failed_stage_with_its_error(tmp_path):
    result = remote(tmp_path, "sync")
    assert result.returncode == 0, result.stderr
    host = tmp_path / "host"
    assert (host / "01_generate_data.py").exists() and not (host / ".venv").exists()
    os.symlink(REPO / ".venv", host / ".venv")  # stands in for `remote.sh setup`, which builds it there
    config = write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="r")

    # Stage 03 before 02 fails with a bad-input error; the launcher returns at once.
    result = remote(tmp_path, "run", "3", str(config))
    assert result.returncode == 0 and "started 03_build_vocab_map" in result.stdout, result.stderr
    logs = tmp_path / "data" / "r" / "logs"
    wait_for(logs / "03_build_vocab_map.exit")
    assert (logs / "03_build_vocab_map.exit").read_text().strip() == "2"
    wait_released(logs / "run.lock")  # a failed stage releases the run lock as well
    assert not list((host / "logs" / "jobs").iterdir())

    result = remote(tmp_path, "status", str(config))
    assert result.returncode == 0, result.stderr
    table = {line.split()[1]: line for line in result.stdout.splitlines() if line.startswith("| 0")}
    assert table["03_build_vocab_map"].split()[3] == "failed"
    assert "exit 2: error:" in table["03_build_vocab_map"] and "run 02_extract_hidden.py" in table["03_build_vocab_map"]
    assert table["01_generate_data"].split()[3] == "pending"


def test_status_reads_manifests_of_finished_and_interrupted_stages(tmp_path):
    config = write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="r")
    run_dir = tmp_path / "data" / "r"
    for stage, status in (("01_generate_data", "complete"), ("02_extract_hidden", "running")):
        (run_dir / stage).mkdir(parents=True)
        (run_dir / stage / "manifest.json").write_text(json.dumps({
            "status": status, "inputs": {}, "counts": {"samples": 300}, "wall_time_s": 125.0,
            "finished_at": "2026-11-29T10:00:00+00:00" if status == "complete" else None}))
    (run_dir / "03_build_vocab_map").mkdir()
    (run_dir / "03_build_vocab_map" / "manifest.json").write_text('{"status": "comp')  # torn by hand
    out = subprocess.run([str(REPO / ".venv" / "bin" / "python"), str(REPO / "scripts" / "status.py"), "--config", str(config), "--json"],
                         capture_output=True, text=True, check=True).stdout
    rows = {r["stage"]: r for r in json.loads(out)}
    assert rows["01_generate_data"]["state"] == "done" and rows["01_generate_data"]["samples"] == 300
    assert rows["01_generate_data"]["time"] == "0:02:05"
    assert rows["02_extract_hidden"]["state"] == "interrupted"
    assert rows["03_build_vocab_map"]["state"] == "damaged"
    assert "manifest is not valid JSON" in rows["03_build_vocab_map"]["note"] and "--force" in rows["03_build_vocab_map"]["note"]
    assert rows["04_train"]["state"] == "pending"


def test_lock_is_released_after_success_and_a_stale_lock_is_taken_over(tmp_path):
    host = synced_host(tmp_path)
    config = write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="r")
    logs = tmp_path / "data" / "r" / "logs"
    result = remote(tmp_path, "run", "--no-sync", "1", str(config), "--dry-run")
    assert result.returncode == 0, result.stderr
    wait_for(logs / "01_generate_data.exit")
    assert (logs / "01_generate_data.exit").read_text().strip() == "0"
    wait_released(logs / "run.lock")
    assert not list((host / "logs" / "jobs").iterdir())

    # A lock left by a job that died without cleaning up (SIGKILL, reboot): its pid is gone.
    dead = subprocess.Popen(["true"])
    dead.wait()
    (logs / "run.lock").write_text(json.dumps({"pid": dead.pid, "pgid": dead.pid, "host": "h", "stages": "04_train",
                                               "config": str(config)}))
    result = remote(tmp_path, "run", "--no-sync", "1", str(config), "--dry-run")
    assert result.returncode == 0, result.stderr
    assert f"note: taking over the stale lock of stages 04_train of {config} (pid {dead.pid}" in result.stderr
    wait_for(logs / "01_generate_data.exit")
    wait_released(logs / "run.lock")


def test_second_run_and_sync_are_refused_while_a_job_runs_and_stop_ends_it(tmp_path):
    synced_host(tmp_path)
    # Stage 01 for real on the embedded model: starting its vLLM engine alone takes well over 10 s.
    config = write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="r")
    logs = tmp_path / "data" / "r" / "logs"
    result = remote(tmp_path, "run", "--no-sync", "1", str(config))
    assert result.returncode == 0 and "started 01_generate_data" in result.stdout, result.stderr
    lock = lock_fields(logs / "run.lock")
    pid = int(lock["pid"])
    assert process_alive(pid) and lock["stages"] == "01_generate_data" and lock["config"] == str(config)
    assert lock["pgid"] == pid  # the holder leads the job's process group, which stop signals
    assert f"(pid {pid})" in result.stdout

    for args in (("run", "1", str(config)), ("run", "--no-sync", "2", str(config)), ("sync",)):
        line = one_error_line(remote(tmp_path, *args))
        assert f"pid {pid}" in line and f"scripts/remote.sh stop {config}" in line, line
    assert process_alive(pid) and not (logs / "02_extract_hidden.pid").exists()

    result = remote(tmp_path, "stop", str(config))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stopped 01_generate_data of run r with SIGTERM" in result.stdout, result.stdout
    assert not process_alive(pid) and not (logs / "01_generate_data.pid").exists()
    assert locks.probe(logs / "run.lock") == ("free", None)
    assert (logs / "01_generate_data.exit").read_text().strip() != "0"
    assert not running_in_group(int(lock["pgid"]))  # nothing of the job's process group is left
    result = remote(tmp_path, "stop", str(config))
    assert result.returncode == 0 and "no job is running for run r" in result.stdout
    assert remote(tmp_path, "sync").returncode == 0


def test_sync_keeps_host_edited_configs_unless_told_to_overwrite(tmp_path):
    host = synced_host(tmp_path)
    local = (REPO / "configs" / "tiny.yaml").read_text()
    edited = local + "# edited on the host\n"
    (host / "configs" / "tiny.yaml").write_text(edited)
    (host / "configs" / "mine.yaml").write_text("extends: tiny.yaml\n")
    (host / "configs" / "tiny-smoke.yaml").unlink()
    (host / "README.md").write_text("stale code")

    result = remote(tmp_path, "sync")
    assert result.returncode == 0, result.stderr
    assert "kept host's configs/tiny.yaml (differs from local); pass --configs to overwrite" in result.stdout
    assert "added configs/tiny-smoke.yaml" in result.stdout
    assert (host / "configs" / "tiny.yaml").read_text() == edited
    assert (host / "configs" / "mine.yaml").exists()
    assert (host / "README.md").read_text() == (REPO / "README.md").read_text()  # code is always synced

    result = remote(tmp_path, "sync", "--configs")
    assert result.returncode == 0, result.stderr
    assert "overwrote host's configs/tiny.yaml" in result.stdout
    assert (host / "configs" / "tiny.yaml").read_text() == local
    assert (host / "configs" / "mine.yaml").exists()
    assert "kept" not in remote(tmp_path, "sync").stdout


def test_stop_sends_sigkill_to_a_job_that_ignores_sigterm_and_clears_its_lock(tmp_path):
    synced_host(tmp_path)
    config = write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="r")
    logs = tmp_path / "data" / "r" / "logs"
    logs.mkdir(parents=True)
    # A stand-in job in its own process group that shrugs off SIGTERM, holding the lock as a runner would.
    lock = logs / "run.lock"
    job = subprocess.Popen([str(REPO / ".venv" / "bin" / "python"), "-m", "eagle_pipeline.locks", "hold", str(lock),
                            "stages=04_train", f"config={config}", "--",
                            "bash", "-c", "trap '' TERM; while :; do sleep 0.1; done"], cwd=REPO, start_new_session=True)
    deadline = time.monotonic() + 30
    while locks.probe(lock)[0] != "live":
        assert time.monotonic() < deadline and job.poll() is None, "the stand-in job never took the lock"
        time.sleep(0.1)
    (logs / "04_train.pid").write_text(f"{job.pid}\n")
    env_grace = {**os.environ, "EAGLE_STOP_GRACE": "1"}
    result = subprocess.run([str(REPO / "scripts" / "remote.sh"), "stop", str(config)], capture_output=True, text=True,
                            timeout=60, env={**env_grace, "EAGLE_HOST": "local", "EAGLE_REMOTE_DIR": str(tmp_path / "host")})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "stopped 04_train of run r with SIGKILL" in result.stdout, result.stdout
    assert job.wait(timeout=5) == -9
    assert locks.probe(lock) == ("free", None) and not (logs / "04_train.pid").exists()


def test_command_line_mistakes_are_one_error_line_and_exit_2(tmp_path):
    script = str(REPO / "scripts" / "remote.sh")
    without_host = {k: v for k, v in os.environ.items() if k != "EAGLE_HOST"}
    no_host = subprocess.run([script, "status", "configs/tiny.yaml"], env=without_host, capture_output=True, text=True, timeout=60)
    assert one_error_line(no_host) == "error: EAGLE_HOST is not set; set EAGLE_HOST=user@host (or EAGLE_HOST=local to act on this machine)"
    for args in (["stats", "configs/tiny.yaml"], []):
        result = remote(tmp_path, *args)
        line = one_error_line(result)
        assert not result.stdout and "one of setup, sync, run, stop, log, status, capture, capture-stop" in line, line
    assert "unknown command 'stats'" in one_error_line(remote(tmp_path, "stats"))
    assert one_error_line(remote(tmp_path, "status")) == "error: usage: remote.sh status CONFIG"
    usage = subprocess.run([script, "help"], env=without_host, capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and "remote.sh capture-stop CONFIG" in usage.stdout and not usage.stderr
