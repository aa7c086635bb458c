"""The SSH driver in its local mode: sync, detached run, status after a failed stage, log."""

import json
import os
import subprocess
import time

from conftest import REPO, write_config


def remote(tmp_path, *args, timeout=120):
    env = {**os.environ, "EAGLE_HOST": "local", "EAGLE_REMOTE_DIR": str(tmp_path / "host"), "EAGLE_NO_TMUX": "1"}
    return subprocess.run([str(REPO / "scripts" / "remote.sh"), *args], env=env, capture_output=True, text=True, timeout=timeout)


def wait_for(path, timeout=120):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


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

    result = remote(tmp_path, "status", str(config))
    assert result.returncode == 0, result.stderr
    table = {line.split()[0]: line for line in result.stdout.splitlines() if line.startswith("0")}
    assert table["03_build_vocab_map"].split()[1] == "failed"
    assert "exit 2: error:" in table["03_build_vocab_map"] and "run 02_extract_hidden.py" in table["03_build_vocab_map"]
    assert table["01_generate_data"].split()[1] == "pending"


def test_status_reads_manifests_of_finished_and_interrupted_stages(tmp_path):
    config = write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="r")
    run_dir = tmp_path / "data" / "r"
    for stage, status in (("01_generate_data", "complete"), ("02_extract_hidden", "running")):
        (run_dir / stage).mkdir(parents=True)
        (run_dir / stage / "manifest.json").write_text(json.dumps({
            "status": status, "counts": {"samples": 300}, "wall_time_s": 125.0,
            "finished_at": "2026-11-29T10:00:00+00:00" if status == "complete" else None}))
    out = subprocess.run([str(REPO / ".venv" / "bin" / "python"), str(REPO / "scripts" / "status.py"), "--config", str(config), "--json"],
                         capture_output=True, text=True, check=True).stdout
    rows = {r["stage"]: r for r in json.loads(out)}
    assert rows["01_generate_data"]["state"] == "done" and rows["01_generate_data"]["samples"] == 300
    assert rows["01_generate_data"]["time"] == "0:02:05"
    assert rows["02_extract_hidden"]["state"] == "interrupted"
    assert rows["04_train"]["state"] == "pending"
