"""Fault injection, the machinery shared by tests/test_faults_01_03.py and tests/test_faults_04_06.py: every
stage is SIGKILLed at seeded points, rerun until it succeeds, and must end with what an uninterrupted run made
(the session's `small_run` and `finished_small_run`); a disk without room is refused up front, and a disk
that fills midway keeps the finished files for a rerun to complete.

Kill points are observable progress (a manifest saying "running", the first part file, a checkpoint
folder, a server log) plus a delay drawn from a seeded generator, so the same points are chosen on every
run and each kill lands midway. Each stage starts in its own session, and the kill takes its whole process
group at once, as a job scheduler's kill -9 would. Nothing of the stage may survive it, not even the vLLM
servers of stage 06, which run in a session of their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Callable

import pytest
import torch
from conftest import REPO, write_smoke_config

SEED = 6
# Inherited by everything a stage starts, including a vLLM server in its own session.
TAG_VARIABLE = "EAGLE_FAULT_TEST_TAG"
PAGE = os.sysconf("SC_PAGE_SIZE")  # tmpfs gives out whole pages


# --------------------------------------------------------------------------------------------------------
# Starting, killing and rerunning a stage


def read_manifest(stage_dir: Path) -> dict | None:
    path = stage_dir / "manifest.json"
    return json.loads(path.read_text()) if path.exists() else None


def status(stage_dir: Path) -> str | None:
    manifest = read_manifest(stage_dir)
    return manifest and manifest["status"]


def _processes() -> dict[int, tuple[int, int, str, bytes]]:
    """pid -> (parent pid, session id, state, environment) of every live process we can read."""
    table = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        table[int(entry.name)] = (int(fields[1]), int(fields[3]), fields[0], environ)
    return table


def stage_processes(session: int, tag: str) -> list[int]:
    """Live processes of a stage started as the leader of `session`: its session, whatever carries its
    tag (a server in a session of its own), and their descendants wherever they were reparented to."""
    table = _processes()
    needle = f"{TAG_VARIABLE}={tag}".encode()
    found = {pid for pid, (_, sid, state, env) in table.items()
             if state != "Z" and (sid == session or needle in env.split(b"\0"))}
    grew = True
    while grew:
        children = {pid for pid, (ppid, _, state, _) in table.items() if ppid in found and state != "Z"}
        grew = not children <= found
        found |= children
    return sorted(found)


def describe(pids: list[int]) -> str:
    lines = []
    for pid in pids:
        try:
            command = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        lines.append(f"{pid}: {command[:160].decode(errors='replace')}")
    return "\n".join(lines)


def server_ports(stage_dir: Path) -> list[int]:
    """The ports stage 06's servers were started on, from the command line at the top of each server log."""
    ports = []
    for log in sorted((stage_dir / "logs").glob("server-*.log")):
        found = re.search(r"--port (\d+)", log.read_text(errors="replace"))
        if found:
            ports.append(int(found.group(1)))
    return ports


def port_in_use(port: int) -> bool:
    """The probe stage 06 itself runs before it starts a server on a fixed port."""
    from eagle_pipeline.errors import BadInput
    from eagle_pipeline.serve.server import check_port_free

    try:
        check_port_free(port)
    except BadInput:
        return True
    return False


def kill_at(script: str, config: Path, *args: str, stage_dir: Path, when: Callable[[], bool], delay: float,
            log_path: Path, timeout_s: float = 900) -> str:
    """Run the stage until `when()` holds, `delay` seconds more, then SIGKILL its process group.

    Fails when the stage exits before that point (the kill would not land midway) or when any process it
    started outlives it by more than a minute. Returns the stage's output up to the kill.
    """
    tag = uuid.uuid4().hex
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", TAG_VARIABLE: tag}
    with open(log_path, "wb") as log:
        process = subprocess.Popen([sys.executable, str(REPO / script), "--config", str(config), *args], cwd=REPO,
                                   env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not when():
            assert process.poll() is None, f"{script} exited with {process.returncode} before the kill point:\n" \
                                           f"{log_path.read_text(errors='replace')[-3000:]}"
            assert time.monotonic() < deadline, f"{script}: no kill point within {timeout_s:.0f} s"
            time.sleep(0.02)
        time.sleep(delay)
        assert process.poll() is None, f"{script} finished before the kill: the kill point is too late"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        # A server outlives the stage by a few seconds: its guard sends SIGTERM, and SIGKILL after 30 s.
        deadline = time.monotonic() + 60
        while (left := stage_processes(process.pid, tag)) and time.monotonic() < deadline:
            time.sleep(0.5)
        leaked = describe(left)
        for pid in left:  # never leave them running for the next test
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"processes outlived the killed {script}:\n{leaked}"
    busy = [port for port in server_ports(stage_dir) if port_in_use(port)]
    assert not busy, f"ports still bound after the killed {script}: {busy}"
    assert status(stage_dir) == "running", f"the kill must land while {script} works (manifest: {status(stage_dir)})"
    return log_path.read_text(errors="replace")


def link_stages(reference: Path, run_dir: Path, *stages: str) -> None:
    """Earlier stages' output, hard-linked from the reference run: later stages only read it."""
    for name in stages:
        shutil.copytree(reference / name, run_dir / name, copy_function=os.link)


# --------------------------------------------------------------------------------------------------------
# What a finished stage folder must look like


def safetensors_is_whole(path: Path) -> bool:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            return False
        (size,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(size))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    return path.stat().st_size == 8 + size + end


def assert_complete_and_whole(stage_dir: Path) -> dict:
    manifest = read_manifest(stage_dir)
    assert manifest is not None and manifest["status"] == "complete" and manifest["finished_at"]
    leftovers = [str(p.relative_to(stage_dir)) for p in stage_dir.rglob(".tmp-*")]
    assert not leftovers, f"torn temporary files left: {leftovers}"
    for path in stage_dir.rglob("*.json"):
        json.loads(path.read_text())
    for path in stage_dir.rglob("*.safetensors"):
        assert safetensors_is_whole(path), f"{path} is torn"
    return manifest


def assert_same_hidden_states(got_dir: Path, want_dir: Path, names: list[str] | None = None) -> None:
    from safetensors.torch import load_file

    for name in names or sorted(p.name for p in want_dir.glob("hs_*.safetensors")):
        got, want = load_file(str(got_dir / name)), load_file(str(want_dir / name))
        assert torch.equal(got["token_ids"], want["token_ids"]), name
        # Captured with another batch composition than the reference: equal up to rounding.
        torch.testing.assert_close(got["hidden_states"].float(), want["hidden_states"].float(), rtol=0.05, atol=0.05)


def dataset_rows(folder: Path) -> list[dict]:
    from datasets import load_from_disk

    return load_from_disk(str(folder)).with_format(None).to_list()


def fresh_run(tmp_path: Path) -> tuple[Path, Path]:
    """A fresh run folder and the smoke config pointing at it: (config, run_dir)."""
    config = write_smoke_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="f")
    return config, tmp_path / "data" / "f"


# --------------------------------------------------------------------------------------------------------
# Disks without room


@contextlib.contextmanager
def tmpfs(path: Path, size: int):
    """A tmpfs of `size` bytes mounted on `path`: a small disk that really fills up."""
    path.mkdir(parents=True, exist_ok=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                 capture_output=True, text=True)
    except FileNotFoundError:
        pytest.skip("needs `mount` to make a small disk that fills up, and this machine has none")
    if mounted.returncode != 0:
        pytest.skip(f"needs a small tmpfs to fill a disk for real, and mounting one is not permitted here: "
                    f"{mounted.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def pages(size: int) -> int:
    return -(-size // PAGE) * PAGE
