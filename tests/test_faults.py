"""Fault injection: every stage is SIGKILLed at seeded points, rerun until it succeeds, and must end with
what an uninterrupted run made (the session's `small_run` and `finished_small_run`); a disk without room is
refused up front, and a disk that fills midway keeps the finished files for a rerun to complete.

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
import random
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

import numpy as np
import pytest
import torch
from conftest import REPO, ok, run_stage, write_smoke_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

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


# --------------------------------------------------------------------------------------------------------
# Stages 01-03 against the session's small_run


@pytest.fixture
def run(tmp_path):
    """A fresh run folder and the smoke config pointing at it: (config, run_dir)."""
    config = write_smoke_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="f")
    return config, tmp_path / "data" / "f"


def test_stage_01_killed_three_times_gives_the_reference_conversations(small_run, run, tmp_path):
    _, _, reference = small_run
    config, run_dir = run
    stage = run_dir / "01_generate_data"
    parts = lambda: sorted((stage / "parts").glob("part-*.jsonl"))  # noqa: E731
    rng = random.Random(SEED + 1)

    # While the engine loads: nothing generated yet.
    kill_at("01_generate_data.py", config, stage_dir=stage, when=lambda: status(stage) == "running",
            delay=rng.uniform(0.5, 4.0), log_path=tmp_path / "kill-1.log")
    assert parts() == []
    # Right after the first batch of 4 (tiny-smoke.yaml) is written, while the second is generated.
    kill_at("01_generate_data.py", config, stage_dir=stage, when=lambda: len(parts()) >= 1,
            delay=rng.uniform(0.0, 0.05), log_path=tmp_path / "kill-2.log")
    assert len(parts()) == 1
    # Once both batches are written, while the dataset and the plot are: the rerun generates nothing.
    output = kill_at("01_generate_data.py", config, stage_dir=stage, when=lambda: len(parts()) >= 2,
                     delay=rng.uniform(0.0, 0.2), log_path=tmp_path / "kill-3.log")
    assert "4 of 6 conversations already done, 2 to generate" in output

    result = ok(run_stage("01_generate_data.py", config))
    assert "6 of 6 conversations already done, 0 to generate" in result.stdout
    manifest = assert_complete_and_whole(stage)
    expected = read_manifest(reference / "01_generate_data")

    rows = dataset_rows(stage / "conversations")
    assert [r["sample_id"] for r in rows] == [f"s{i:06d}" for i in range(6)]
    in_parts = [json.loads(line)["sample_id"] for part in parts() for line in part.read_text().splitlines()]
    assert sorted(in_parts) == [r["sample_id"] for r in rows], "each sample in exactly one part file"
    # Greedy decoding: the same texts, token counts and finish reasons as the uninterrupted run.
    assert rows == dataset_rows(reference / "01_generate_data" / "conversations")
    assert manifest["output_fingerprint"] == expected["output_fingerprint"]
    assert manifest["counts"]["samples"] == 6


def test_stage_02_killed_twice_gives_the_reference_hidden_states(small_run, tmp_path):
    _, _, reference = small_run
    run_dir = tmp_path / "data" / "f"
    # One sample per engine call: a file every fraction of a second, so kills land between files.
    config = write_smoke_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="f",
                                hidden_states={"batch_size": 1})
    link_stages(reference, run_dir, "01_generate_data")
    stage = run_dir / "02_extract_hidden"
    hs_dir = stage / "data" / "hidden_states"
    files = lambda: len(list(hs_dir.glob("hs_*.safetensors"))) if hs_dir.exists() else 0  # noqa: E731
    rng = random.Random(SEED + 2)

    first = rng.choice([1, 2])
    kill_at("02_extract_hidden.py", config, stage_dir=stage, when=lambda: files() >= first,
            delay=rng.uniform(0.0, 0.03), log_path=tmp_path / "kill-1.log")
    kept = files()
    assert 1 <= kept < 6
    second = kept + rng.choice([1, 2])
    output = kill_at("02_extract_hidden.py", config, stage_dir=stage, when=lambda: files() >= second,
                     delay=rng.uniform(0.0, 0.03), log_path=tmp_path / "kill-2.log")
    assert f"{kept} of 6 samples already captured" in output
    kept = files()
    assert second <= kept < 6

    result = ok(run_stage("02_extract_hidden.py", config))
    assert f"{kept} of 6 samples already captured, {6 - kept} to capture" in result.stdout
    manifest = assert_complete_and_whole(stage)
    want = reference / "02_extract_hidden"
    want_names = sorted(p.name for p in (want / "data" / "hidden_states").iterdir())
    assert sorted(p.name for p in hs_dir.iterdir()) == want_names
    assert_same_hidden_states(hs_dir, want / "data" / "hidden_states")
    assert dataset_rows(stage / "data") == dataset_rows(want / "data")
    assert manifest["output_fingerprint"] == read_manifest(want)["output_fingerprint"]
    assert not (stage / "connector_scratch").exists()


def test_stage_03_killed_twice_gives_the_reference_vocabulary_bytes(small_run, run, tmp_path):
    _, _, reference = small_run
    config, run_dir = run
    link_stages(reference, run_dir, "01_generate_data", "02_extract_hidden")
    stage = run_dir / "03_build_vocab_map"
    rng = random.Random(SEED + 3)

    # While it reads the dataset and counts tokens.
    kill_at("03_build_vocab_map.py", config, stage_dir=stage, when=lambda: status(stage) == "running",
            delay=rng.uniform(0.0, 0.3), log_path=tmp_path / "kill-1.log")
    # Between its first file and the manifest (the other maps, the plot).
    kill_at("03_build_vocab_map.py", config, stage_dir=stage, when=lambda: (stage / "d2t.npy").exists(),
            delay=rng.uniform(0.0, 0.05), log_path=tmp_path / "kill-2.log")

    ok(run_stage("03_build_vocab_map.py", config))
    manifest = assert_complete_and_whole(stage)
    want = reference / "03_build_vocab_map"
    for name in ("d2t.npy", "t2d.npy", "token_counts.npy"):
        assert (stage / name).read_bytes() == (want / name).read_bytes(), name
    assert manifest["counts"] == read_manifest(want)["counts"]
    assert manifest["output_fingerprint"] == read_manifest(want)["output_fingerprint"]


# --------------------------------------------------------------------------------------------------------
# Stages 04-06 against the session's finished_small_run (tiny-smoke.yaml settings)


def test_stage_04_killed_while_saving_and_while_training_resumes_to_the_reference_steps(finished_small_run, run,
                                                                                      tmp_path):
    from eagle_pipeline.train import checkpoints as train_checkpoints
    from eagle_pipeline.train import metrics

    _, reference = finished_small_run
    config, run_dir = run
    link_stages(reference, run_dir, "01_generate_data", "02_extract_hidden", "03_build_vocab_map")
    stage = run_dir / "04_train"
    checkpoints = stage / "checkpoints"
    rng = random.Random(SEED + 4)

    # While speculators writes or validates the first checkpoint: a torn folder the rerun must delete.
    kill_at("04_train.py", config, stage_dir=stage, when=lambda: (checkpoints / "0").is_dir(),
            delay=rng.uniform(0.0, 0.3), log_path=tmp_path / "kill-1.log")
    assert train_checkpoints.complete_checkpoints(checkpoints) == {}
    # In the second epoch, once the first checkpoint is complete: the rerun resumes from it.
    output = kill_at("04_train.py", config, stage_dir=stage,
                     when=lambda: (checkpoints / "0" / train_checkpoints.COMPLETE_MARKER).exists(),
                     delay=rng.uniform(0.0, 0.5), log_path=tmp_path / "kill-2.log")
    assert "Removed incomplete checkpoint 0" in output
    assert list(train_checkpoints.complete_checkpoints(checkpoints)) == [0]

    ok(run_stage("04_train.py", config, timeout=1800))
    manifest = assert_complete_and_whole(stage)
    want = reference / "04_train"
    expected = read_manifest(want)
    assert manifest["counts"]["epochs_completed"] == expected["counts"]["epochs_completed"] == 2
    complete = train_checkpoints.complete_checkpoints(checkpoints)
    assert {e: s["global_step"] for e, s in complete.items()} == {
        e: s["global_step"] for e, s in train_checkpoints.complete_checkpoints(want / "checkpoints").items()}
    assert json.loads((stage / "best.json").read_text())["checkpoint"] in {f"checkpoints/{e}" for e in complete}
    for epoch in complete:
        validation = json.loads((checkpoints / str(epoch) / train_checkpoints.COMPLETE_MARKER).read_text())
        assert np.isfinite(validation["loss"])
    rows = metrics.read_metrics(stage / "metrics.csv")
    want_rows = metrics.read_metrics(want / "metrics.csv")
    # Every step logged exactly once: rows the killed runs logged past their checkpoint were dropped.
    assert [r["step"] for r in rows if r["split"] == "train"] == [r["step"] for r in want_rows if r["split"] == "train"]
    assert [r["epoch"] for r in rows if r["split"] == "val"] == [0, 1]
    # Epoch 0 was trained from scratch after the first kill: the same bytes as the uninterrupted run.
    first = "checkpoints/0/model.safetensors"
    assert (stage / first).read_bytes() == (want / first).read_bytes()
    # speculators checkpoints weights and AdamW moments in bf16 while it trains in fp32, so an epoch resumed
    # from a checkpoint is close to the uninterrupted one, not identical; resumed from the wrong checkpoint
    # (or from scratch) its validation loss would be far off.
    last = max(complete)
    want_loss = train_checkpoints.complete_checkpoints(want / "checkpoints")[last]["val_loss"]
    assert complete[last]["val_loss"] == pytest.approx(want_loss, rel=0.02)


def test_stage_05_killed_twice_converts_the_same_bytes_and_passes(finished_small_run, run, tmp_path):
    _, reference = finished_small_run
    config, run_dir = run
    link_stages(reference, run_dir, "01_generate_data", "02_extract_hidden", "03_build_vocab_map", "04_train")
    stage = run_dir / "05_convert"
    rng = random.Random(SEED + 5)

    # While it converts.
    kill_at("05_convert.py", config, stage_dir=stage, when=lambda: status(stage) == "running",
            delay=rng.uniform(0.0, 0.5), log_path=tmp_path / "kill-1.log")
    # While vLLM verifies the converted folder.
    kill_at("05_convert.py", config, stage_dir=stage,
            when=lambda: (stage / "vllm" / "model.safetensors").exists(),
            delay=rng.uniform(2.0, 10.0), log_path=tmp_path / "kill-2.log")
    assert not (stage / "verify.json").exists()

    ok(run_stage("05_convert.py", config, timeout=1800))
    manifest = assert_complete_and_whole(stage)
    want = reference / "05_convert"
    for name in ("config.json", "model.safetensors"):
        assert (stage / "vllm" / name).read_bytes() == (want / "vllm" / name).read_bytes(), name
    checks = json.loads((stage / "verify.json").read_text())["checks"]
    assert {name: check["ok"] for name, check in checks.items()} == {
        "shapes": True, "config": True, "vllm_load": True, "parity": True}
    assert manifest["output_fingerprint"] == read_manifest(want)["output_fingerprint"]


def test_stage_06_killed_while_serving_leaves_no_server_and_reruns_to_a_report(finished_small_run, run, tmp_path):
    _, reference = finished_small_run
    config, run_dir = run
    link_stages(reference, run_dir, "01_generate_data", "02_extract_hidden", "03_build_vocab_map", "04_train",
                "05_convert")
    stage = run_dir / "06_serve_test"
    first_log = stage / "logs" / "server-none.log"
    # Two servers instead of three, and no offline replay after them: what a kill leaves behind does not
    # depend on the mode, and the replay (its own capture engine) is tested in test_predict.py and test_diagnosis.py.
    settings = ["--set", "serve.ngram_baseline=false", "--set", "serve.predict=false"]
    rng = random.Random(SEED + 6)

    # While the first server's engine loads the weights: API server, engine core and worker all running.
    loading = "Loading safetensors checkpoint"
    kill_at("06_serve_test.py", config, *settings, stage_dir=stage,
            when=lambda: first_log.exists() and loading in first_log.read_text(errors="replace"),
            delay=rng.uniform(0.0, 2.0), log_path=tmp_path / "kill-1.log")
    # Once it serves: during the warm-up request or the measured prompts.
    kill_at("06_serve_test.py", config, *settings, stage_dir=stage,
            when=lambda: "[none] server healthy" in (tmp_path / "kill-2.log").read_text(errors="replace"),
            delay=rng.uniform(0.0, 1.0), log_path=tmp_path / "kill-2.log")
    assert not (stage / "report.json").exists()

    ok(run_stage("06_serve_test.py", config, *settings, timeout=1800))
    manifest = assert_complete_and_whole(stage)
    report = json.loads((stage / "report.json").read_text())
    expected = json.loads((reference / "06_serve_test" / "report.json").read_text())
    for field in ("num_prompts", "num_speculative_tokens", "mean_acceptance_length", "acceptance_rate",
                  "per_position_acceptance", "tokens_per_s", "speedup", "greedy_match"):
        assert field in report
    assert report["tokens_per_s"]["none"] > 0 and report["tokens_per_s"]["eagle3"] > 0
    assert report["num_prompts"] == expected["num_prompts"] == 3
    assert report["prompt_ids"] == expected["prompt_ids"]
    assert report["greedy_match"] is True and manifest["counts"]["passed"] is True
    responses = [json.loads(line) for line in (stage / "responses.jsonl").read_text().splitlines()]
    want = [json.loads(line) for line in (reference / "06_serve_test" / "responses.jsonl").read_text().splitlines()]
    assert [r["index"] for r in responses] == [0, 1, 2]
    # Greedy decoding in float32: the same texts as the uninterrupted run, with and without the drafter.
    for mode in ("none", "eagle3"):
        assert [r["responses"][mode] for r in responses] == [r["responses"][mode] for r in want], mode
    assert not [port for port in server_ports(stage) if port_in_use(port)]


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


def test_disk_full_midway_through_stage_02_keeps_finished_samples_and_a_rerun_completes(small_run, run, tmp_path):
    _, _, reference = small_run
    config, run_dir = run
    link_stages(reference, run_dir, "01_generate_data")
    want = reference / "02_extract_hidden"
    want_files = sorted((want / "data" / "hidden_states").glob("hs_*.safetensors"))
    counts = read_manifest(want)["counts"]
    # The stage's own estimate (bf16 states). Each file also holds its token ids and a header, and tmpfs
    # gives out whole pages: a disk of exactly the estimate passes the up-front check, then fills midway.
    estimate = counts["tokens"] * counts["num_hidden_states"] * counts["hidden_size"] * 2
    size = pages(estimate)
    assert sum(pages(p.stat().st_size) for p in want_files) > size, "this disk would hold every file"
    stage = run_dir / "02_extract_hidden"
    hs_dir = stage / "data" / "hidden_states"

    with tmpfs(hs_dir, size):
        assert shutil.disk_usage(hs_dir).free >= estimate
        result = run_stage("02_extract_hidden.py", config)
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
        # vLLM's resource tracker may still print warnings after the stage's own line.
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, result.stderr[-3000:]
        assert errors[0].startswith("error: disk full while writing") and str(hs_dir) in errors[0], errors[0]
        kept = sorted(p.name for p in hs_dir.glob("hs_*.safetensors"))
        assert 1 <= len(kept) < 6
        assert not list(hs_dir.glob(".tmp-*")), "the failed write must not leave its temporary file"
        assert all(safetensors_is_whole(hs_dir / name) for name in kept)
        assert_same_hidden_states(hs_dir, want / "data" / "hidden_states", kept)
        assert status(stage) == "running"

        # Space freed: the same disk, grown.
        subprocess.run(["mount", "-o", f"remount,size={2 * size}", str(hs_dir)], check=True)
        result = ok(run_stage("02_extract_hidden.py", config))
        assert f"{len(kept)} of 6 samples already captured, {6 - len(kept)} to capture" in result.stdout
        manifest = assert_complete_and_whole(stage)
        assert sorted(p.name for p in hs_dir.iterdir()) == [p.name for p in want_files]
        assert_same_hidden_states(hs_dir, want / "data" / "hidden_states")
        assert manifest["output_fingerprint"] == read_manifest(want)["output_fingerprint"]


def test_stage_04_refuses_a_disk_without_room_for_its_checkpoints(small_run, run):
    _, _, reference = small_run
    config, run_dir = run
    link_stages(reference, run_dir, "01_generate_data", "02_extract_hidden", "03_build_vocab_map")
    dry = ok(run_stage("04_train.py", config, "--dry-run"))
    need = re.search(r"checkpoints ~([\d.]+) GB", dry.stdout).group(1)
    stage = run_dir / "04_train"

    with tmpfs(stage, 16 * 2**20):
        result = run_stage("04_train.py", config)
        free = f"{shutil.disk_usage(stage).free / 1e9:.2f}"
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
        last = result.stderr.strip().splitlines()[-1]
        assert last.startswith("error:"), result.stderr[-3000:]
        assert f"drafter checkpoints needs about {need} GB but only {free} GB is free" in last, last
        assert float(need) > float(free)
        # Refused before anything but its log was written.
        assert sorted(p.name for p in stage.iterdir()) == ["logs"]
