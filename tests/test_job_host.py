"""The drafter checks' job host: jobs forked from one process keep the contract of a fresh process each
(exit code, output in the job's log, killed with everything below them past their timeout). These tests run
the host with a jobs module of their own and nothing preloaded; the smoke run's stage 05 (tests/test_stages_04_06.py)
shows vLLM's jobs forked from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from conftest import process_alive

from eagle_pipeline.drafter_checks.job_host import JobHost

JOBS = '''
import os, subprocess, sys, time

def main(argv):
    what = argv[0]
    print(f"job {what} in {os.getpid()}, program {os.path.basename(sys.argv[0])}", flush=True)
    if what == "exit":
        raise SystemExit(int(argv[1]))
    if what == "raise":
        raise ValueError("the job's own failure")
    if what == "hang":  # as vLLM's engine core would, a child that runs on after the job is killed
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open(argv[1], "w").write(f"{os.getpid()} {child.pid}")
        time.sleep(600)
'''


@pytest.fixture
def host(tmp_path):
    (tmp_path / "jobs_for_test.py").write_text(JOBS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    host = JobHost(env, preload=(), jobs_module="jobs_for_test")
    yield host
    host.close()


def test_a_forked_job_exits_and_logs_as_a_fresh_process_would(host, tmp_path):
    log = tmp_path / "job.log"
    log.write_text("$ the command\n")
    assert host.run(["ok"], log, timeout=60) == 0
    assert host.run(["exit", "3"], log, timeout=60) == 3
    assert host.run(["raise"], log, timeout=60) == 1
    lines = log.read_text().splitlines()
    assert lines[0] == "$ the command"
    jobs = [line for line in lines if line.startswith("job ")]
    assert [line.split()[1] for line in jobs] == ["ok", "exit", "raise"]
    # Each job is a process of its own below the host, named as `python -m` names its program.
    pids = {int(line.split()[3].rstrip(",")) for line in jobs}
    assert len(pids) == 3 and host.pid not in pids and os.getpid() not in pids
    assert all(line.endswith("program jobs_for_test.py") for line in jobs)
    assert "ValueError: the job's own failure" in log.read_text()


def test_answers_that_arrive_together_are_read_one_at_a_time(host, tmp_path):
    # A job that fails at once: the host has written both its pid and its exit before the owner reads.
    request = {"argv": ["exit", "3"], "log": str(tmp_path / "job.log"), "env": None}
    host.process.stdin.write((json.dumps(request) + "\n").encode())
    host.process.stdin.flush()
    time.sleep(2)
    assert set(host._answer(timeout=5)) == {"pid"}
    assert host._answer(timeout=5) == {"exit": 3}
    assert host.run(["ok"], tmp_path / "next.log", timeout=60) == 0


def test_a_job_past_its_timeout_is_killed_with_its_children_and_the_host_runs_the_next(host, tmp_path):
    pids = tmp_path / "pids"
    started = time.monotonic()
    assert host.run(["hang", str(pids)], tmp_path / "hang.log", timeout=3) is None
    assert time.monotonic() - started < 30
    job, child = (int(p) for p in pids.read_text().split())
    assert not process_alive(job) and not process_alive(child)
    assert host.alive() and host.run(["ok"], tmp_path / "next.log", timeout=60) == 0


def test_the_host_exits_with_its_owner_closing_it(host):
    host.close()
    assert host.process.returncode == 0


def test_a_host_that_cannot_start_is_refused_at_once(tmp_path):
    with pytest.raises(RuntimeError, match="did not start"):
        JobHost(dict(os.environ), preload=("no_such_module_anywhere",), output=tmp_path / "host.log")
    assert "No module named 'no_such_module_anywhere'" in (tmp_path / "host.log").read_text()


def test_jobs_that_start_engine_processes_run_in_a_fresh_process(tmp_path, monkeypatch):
    from eagle_pipeline.drafter_checks import job_host, subprocess_json
    from eagle_pipeline.engine import MULTIPROCESSING_VARIABLE

    def no_host(*args, **kwargs):
        raise AssertionError("a job host was asked for")

    monkeypatch.setattr(job_host, "shared_host", no_host)
    monkeypatch.delenv(MULTIPROCESSING_VARIABLE, raising=False)
    log = tmp_path / "vllm-load.log"
    with pytest.raises(RuntimeError, match="exited with 2"):
        subprocess_json.run_json_subprocess(["inspect", "--target", str(tmp_path)], log_path=log)
    assert job_host.FORK_NOTE.split("(")[0] not in log.read_text()
    assert sys.executable in log.read_text().splitlines()[0]


def test_a_killed_owner_leaves_neither_its_host_nor_a_running_job(tmp_path):
    (tmp_path / "jobs_for_test.py").write_text(JOBS)
    pids = tmp_path / "pids"
    owner = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from eagle_pipeline.drafter_checks.job_host import JobHost\n"
        f"host = JobHost(dict(os.environ, PYTHONPATH={str(tmp_path)!r}), preload=(), jobs_module='jobs_for_test')\n"
        f"open({str(tmp_path / 'host')!r}, 'w').write(str(host.pid))\n"
        f"host.run(['hang', {str(pids)!r}], Path({str(tmp_path / 'hang.log')!r}), timeout=600)\n")])
    deadline = time.monotonic() + 60
    while not (pids.exists() and len(pids.read_text().split()) == 2) and time.monotonic() < deadline:
        time.sleep(0.05)
    host, (job, _) = int((tmp_path / "host").read_text()), (int(p) for p in pids.read_text().split())
    owner.kill()
    owner.wait()
    deadline = time.monotonic() + 10
    while (process_alive(host) or process_alive(job)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not process_alive(host) and not process_alive(job)
