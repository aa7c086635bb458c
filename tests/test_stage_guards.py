"""What a stage refuses or survives before it touches its folder: a second process on the same stage, GPUs in
use by another run, a stage folder that is a file or a link out of the run, SIGTERM, a full disk."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import REPO, run_stage, write_config

from eagle_pipeline import gpus, locks
from eagle_pipeline.config import load_config
from eagle_pipeline.stage import Stage, disk_full_error, uses_gpus


@pytest.fixture
def config(tmp_path):
    return write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "root"), run_name="r")


def run_dir(tmp_path):
    return tmp_path / "root" / "r"


def test_a_second_process_on_the_same_stage_is_refused_naming_the_holder(tmp_path, config):
    lock = run_dir(tmp_path) / "logs" / "03_build_vocab_map.lock"
    with locks.HeldLocks() as held:
        locks.take(lock, locks.holder_record(run="r", stage="03_build_vocab_map"), held, busy="busy")
        result = run_stage("03_build_vocab_map.py", config)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"pid {os.getpid()}" in lines[0]
    assert "stage 03_build_vocab_map of this run is already running" in lines[0]
    assert not (run_dir(tmp_path) / "03_build_vocab_map").exists()
    # Released: the next run gets past the lock (and stops at its own missing input, stage 02).
    result = run_stage("03_build_vocab_map.py", config)
    assert result.returncode == 2 and "02_extract_hidden has not finished" in result.stderr


def test_a_lock_left_by_a_dead_process_is_taken_over_with_a_note(tmp_path):
    lock = tmp_path / "x.lock"
    # A process that takes the lock and dies without releasing it.
    code = ("import sys, os; from eagle_pipeline import locks; h = locks.HeldLocks(); "
            f"locks.take(__import__('pathlib').Path({str(lock)!r}), locks.holder_record(run='old', stage='s'), h, busy='b'); "
            "os._exit(9)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 9
    with locks.HeldLocks() as held:
        locks.take(lock, locks.holder_record(run="new", stage="s"), held, busy="b")
        assert len(held.notes) == 1 and "taken over" in held.notes[0] and "run 'old'" in held.notes[0]
    # A clean release leaves nothing to note.
    with locks.HeldLocks() as held:
        locks.take(lock, locks.holder_record(run="again", stage="s"), held, busy="b")
        assert held.notes == []


def test_a_job_holds_its_run_lock_through_the_command_line_as_a_stage_holds_its_own(tmp_path):
    """scripts/launch.sh and jobs.sh take and read the run lock with `python -m eagle_pipeline.locks`."""
    lock, link = tmp_path / "logs" / "run.lock", tmp_path / "jobs.lock"

    def cli(*args, **kwargs):
        return subprocess.run([sys.executable, "-m", "eagle_pipeline.locks", *args], cwd=REPO, capture_output=True,
                              text=True, timeout=60, **kwargs)

    job = subprocess.Popen([sys.executable, "-m", "eagle_pipeline.locks", "hold", str(lock), "--link", str(link),
                            "stages=01_generate_data", "config=c.yaml", "--", "sleep", "60"], cwd=REPO)
    try:
        deadline = time.monotonic() + 30
        while locks.probe(lock)[0] != "live":
            assert time.monotonic() < deadline and job.poll() is None, "the job never took its lock"
            time.sleep(0.1)
        assert link.resolve() == lock and cli("state", str(lock)).stdout == "live\n"
        assert cli("get", str(lock), "pid").stdout == f"{job.pid}\n"
        described = cli("describe", str(lock)).stdout
        assert described.startswith(f"stages 01_generate_data of c.yaml (pid {job.pid} on "), described
        second = cli("hold", str(lock), "stages=02_extract_hidden", "config=c.yaml", "--", "true")
        assert second.returncode == 2 and second.stderr.startswith(f"error: {lock}: held by {described.strip()}")
        assert cli("clear", str(lock)).returncode == 1
        job.kill()  # as SIGKILL or a reboot leave it: the kernel releases the flock, the record stays
        job.wait()
        assert cli("state", str(lock)).stdout == "stale\n" and cli("clear", str(lock)).returncode == 0
        assert locks.probe(lock) == ("free", None)
        # A clean end releases the lock and its link and passes the command's exit code on.
        assert cli("hold", str(lock), "--link", str(link), "stages=x", "--", "sh", "-c", "exit 3").returncode == 3
        assert locks.probe(lock) == ("free", None) and not link.is_symlink()
    finally:
        job.kill()
        job.wait()


def test_gpu_locks_cover_the_visible_gpus_and_disjoint_sets_run_side_by_side(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with locks.HeldLocks() as first:
        assert locks.take_gpu_locks({"run": "a"}, first, lock_dir=tmp_path) == ["0", "1"]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
        with locks.HeldLocks() as second:
            assert locks.take_gpu_locks({"run": "b"}, second, lock_dir=tmp_path) == ["2", "3"]
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
        with locks.HeldLocks() as third, pytest.raises(Exception, match=r"GPU 1 is in use by another pipeline job.*CUDA_VISIBLE_DEVICES"):
            locks.take_gpu_locks({"run": "c"}, third, lock_dir=tmp_path)
    # Without CUDA_VISIBLE_DEVICES, every GPU nvidia-smi lists.
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: NVIDIA RTX PRO 6000 (UUID: a)'\necho 'GPU 1: NVIDIA RTX PRO 6000 (UUID: b)'\n")
    (stub / "nvidia-smi").chmod(0o755)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setenv("PATH", f"{stub}:{os.environ['PATH']}")
    assert gpus.visible_gpus() == ["0", "1"]


def test_which_stages_hold_the_gpus(config):
    cuda = load_config(config, ["device=cuda", "train.num_gpus=0"])
    assert [uses_gpus(Stage(n, cuda, force=False)) for n in range(1, 7)] == [True, True, False, False, True, True]
    assert uses_gpus(Stage(4, load_config(config, ["device=cuda", "train.num_gpus=8"]), force=False))
    assert not any(uses_gpus(Stage(n, load_config(config), force=False)) for n in range(1, 7))


def test_a_stage_folder_linked_out_of_the_run_is_refused_and_left_alone(tmp_path, config):
    elsewhere = tmp_path / "other-run" / "03_build_vocab_map"
    elsewhere.mkdir(parents=True)
    (elsewhere / "d2t.npy").write_bytes(b"precious")
    run_dir(tmp_path).mkdir(parents=True)
    (run_dir(tmp_path) / "03_build_vocab_map").symlink_to(elsewhere)
    result = run_stage("03_build_vocab_map.py", config, "--force")
    assert result.returncode == 2 and "outside the run folder" in result.stderr and "remove the link" in result.stderr
    assert (elsewhere / "d2t.npy").read_bytes() == b"precious"


def test_a_stage_folder_that_is_a_file_is_refused(tmp_path, config):
    run_dir(tmp_path).mkdir(parents=True)
    (run_dir(tmp_path) / "03_build_vocab_map").write_text("not a folder")
    result = run_stage("03_build_vocab_map.py", config)
    assert result.returncode == 2 and "is a file, not the stage's folder" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_sigterm_stops_a_stage_like_ctrl_c_and_names_it(tmp_path):
    # Stage 01 with self-written prompts and a tiny engine would take minutes; a stage blocked on the stage lock
    # of a live holder cannot be used either (it refuses at once). The stage's own handler is what matters:
    # run a stage body that waits, through stage.main, in a subprocess.
    script = tmp_path / "waits.py"
    config = write_config(tmp_path / "c.yaml", data_root=str(tmp_path / "root"), run_name="r")
    script.write_text(
        "import sys, time\nfrom eagle_pipeline.stage import main\n"
        "def body(stage, dry_run):\n    print('ready', flush=True)\n    time.sleep(60)\n"
        f"main(4, 'test', body, ['--config', {str(config)!r}])\n")
    process = subprocess.Popen([sys.executable, str(script)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert process.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=30)
    assert process.returncode == 130
    assert "interrupted: stage 04_train stopped by SIGTERM; finished work is kept" in stderr
    # The stage's lock went with it.
    with locks.HeldLocks() as held:
        locks.take(run_dir(tmp_path) / "logs" / "04_train.lock", {}, held, busy="b")
        assert held.notes == []


def test_a_full_disk_is_found_behind_the_errors_that_wrap_it():
    full = OSError(errno.ENOSPC, "No space left on device", "/data/run/03/d2t.npy")
    try:
        try:
            raise full
        except OSError as inner:
            raise RuntimeError("numpy could not write the array") from inner
    except RuntimeError as outer:
        assert disk_full_error(outer) is full
    assert disk_full_error(ValueError("x")) is None


def _refusal(script: str, config, capsys) -> str:
    """The one `error:` line of a stage refused in this process (exit 2)."""
    from conftest import run_stage_in_process, without_log_records

    code, _, stderr = run_stage_in_process(script, config, capsys)
    lines = without_log_records(stderr)
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (code, stderr[-2000:])
    return lines[0]


def test_a_lock_that_is_a_folder_or_under_a_file_is_one_error_line(tmp_path, config, capsys):
    logs = run_dir(tmp_path) / "logs"
    (logs / "03_build_vocab_map.lock").mkdir(parents=True)
    line = _refusal("03_build_vocab_map.py", config, capsys)
    assert "03_build_vocab_map.lock: is a folder where the lock file belongs; remove it" in line
    (logs / "03_build_vocab_map.lock").rmdir()
    logs.rmdir()
    logs.write_text("not a folder")
    line = _refusal("03_build_vocab_map.py", config, capsys)
    assert f"{logs}: is a file where the folder of the lock 03_build_vocab_map.lock belongs" in line
    assert logs.read_text() == "not a folder"


def test_a_lock_file_of_another_user_is_one_error_line(tmp_path, config, capsys, monkeypatch):
    lock = run_dir(tmp_path) / "logs" / "03_build_vocab_map.lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    lock.chmod(0o444)
    if os.getuid() == 0:  # root opens it anyway: the kernel's answer to any other user, given here
        real_open = os.open

        def refused(path, *args, **kwargs):
            if str(path) == str(lock):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(locks.os, "open", refused)
    line = _refusal("03_build_vocab_map.py", config, capsys)
    assert f"{lock}: cannot open the lock file (Permission denied" in line
    assert "data_root (or run_name) of your own" in line


def test_two_stages_starting_together_each_probe_the_data_root_with_their_own_file(tmp_path, config, monkeypatch):
    # The second stage's probe written and removed while the first one's is on disk, as two reruns 0.5 s apart do.
    from eagle_pipeline import atomic, stage

    cfg = load_config(config)
    real_write = atomic.write_bytes
    other = []

    def write_then_let_the_other_run(path, data):
        real_write(path, data)
        if not other:
            other.append(path)
            stage.check_data_root_writable(cfg, create=True)

    monkeypatch.setattr(stage.atomic, "write_bytes", write_then_let_the_other_run)
    stage.check_data_root_writable(cfg, create=True)
    assert other and [p.name for p in cfg.run_dir.iterdir()] == []
