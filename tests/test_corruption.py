"""Corruption: every file type a later stage reads is damaged in a finished run (torn, garbage, the wrong JSON
shape, deleted, unreadable) and the stage that reads it is run. Each case must exit 2 with one `error:` line
naming the file, and leave every file of the run as it was (names, sizes, modification times). Then a few
representative damages are repaired the way the error line says, by rerunning the stage that made the
file, which must redo only the damaged part.

The run is a copy of the session's `finished_small_run`. Refusals happen before any model loads, so the
stages are called in-process (`stage.main`); the unreadable cases run as a subprocess, without the
capabilities that let root read any file, so that permissions apply as they do for other users.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
from conftest import REPO, copy_of_run, ok, run_stage, run_stage_in_process

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STAGE_NUMBERS = {"01_generate_data.py": 1, "02_extract_hidden.py": 2, "03_build_vocab_map.py": 3, "04_train.py": 4,
                 "05_convert.py": 5, "06_serve_test.py": 6}
BEST = "{best}"  # the best checkpoint folder of stage 04, read from its manifest


# --------------------------------------------------------------------------------------------------------
# Ways to damage a file


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def garbage(path: Path) -> None:
    """The first bytes overwritten (a garbage header), the size kept."""
    data = bytearray(path.read_bytes())
    noise = np.random.default_rng(0).integers(0, 256, min(64, len(data)), dtype=np.uint8).tobytes()
    data[: len(noise)] = noise
    path.write_bytes(bytes(data))


def json_list(path: Path) -> None:
    path.write_text("[1, 2]\n")


def no_status(path: Path) -> None:
    path.write_text(json.dumps({"inputs": {}, "counts": {}}))


def bad_outputs(path: Path) -> None:
    manifest = json.loads(path.read_text())
    manifest["outputs"] = "all fine"
    path.write_text(json.dumps(manifest))


def running(path: Path) -> None:
    manifest = json.loads(path.read_text())
    manifest["status"] = "running"
    path.write_text(json.dumps(manifest))


def other_array(path: Path) -> None:
    with open(path, "wb") as f:
        np.save(f, np.zeros(7, dtype=np.float32))


def delete(path: Path) -> None:
    path.unlink()


def unreadable(path: Path) -> None:
    path.chmod(0)


MANIFEST = (truncate, garbage, json_list, no_status, bad_outputs, delete)
JSON = (truncate, garbage, json_list, delete)
BINARY = (truncate, garbage, delete)

# (file under the run folder, the stage script that reads it, the damages tried)
FILES: list[tuple[str, str, tuple[Callable[[Path], None], ...]]] = [
    ("01_generate_data/manifest.json", "02_extract_hidden.py", (*MANIFEST, running, unreadable)),
    ("02_extract_hidden/manifest.json", "03_build_vocab_map.py", MANIFEST),
    ("03_build_vocab_map/manifest.json", "04_train.py", (*MANIFEST, running)),
    ("04_train/manifest.json", "05_convert.py", MANIFEST),
    ("05_convert/manifest.json", "06_serve_test.py", MANIFEST),
    ("06_serve_test/manifest.json", "06_serve_test.py", (truncate, garbage, json_list, no_status, bad_outputs)),
    ("01_generate_data/conversations/data-00000-of-00001.arrow", "02_extract_hidden.py", (*BINARY, unreadable)),
    ("01_generate_data/conversations/state.json", "02_extract_hidden.py", JSON),
    ("02_extract_hidden/data/data-00000-of-00001.arrow", "03_build_vocab_map.py", BINARY),
    ("02_extract_hidden/data/state.json", "03_build_vocab_map.py", JSON),
    ("02_extract_hidden/data/hidden_states/hs_3.safetensors", "04_train.py", (*BINARY, unreadable)),
    ("03_build_vocab_map/d2t.npy", "04_train.py", (*BINARY, other_array, unreadable)),
    ("03_build_vocab_map/t2d.npy", "04_train.py", (*BINARY, other_array)),
    (f"04_train/{BEST}/config.json", "05_convert.py", (*JSON, unreadable)),
    (f"04_train/{BEST}/model.safetensors", "05_convert.py", BINARY),
    ("04_train/best.json", "05_convert.py", JSON),
    ("05_convert/vllm/config.json", "06_serve_test.py", (*JSON, unreadable)),
    ("05_convert/vllm/model.safetensors", "06_serve_test.py", BINARY),
]
CASES = [(file, script, damage) for file, script, damages in FILES for damage in damages]
REPORT_DAMAGES = (truncate, garbage, json_list, no_status, delete)


# --------------------------------------------------------------------------------------------------------
# The run, its snapshot, and running a stage on it


@pytest.fixture(scope="module")
def run(finished_small_run, tmp_path_factory):
    """A copy of the finished small run: (config, run_dir)."""
    return copy_of_run(finished_small_run[1], tmp_path_factory.mktemp("corruption"), "c")


def resolve(run_dir: Path, file: str) -> Path:
    best = json.loads((run_dir / "04_train" / "manifest.json").read_text())["counts"]["best"]["checkpoint"]
    return run_dir / file.replace(BEST, best)


def snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file of the run (stage logs left out: a refused run may log why) with its size and mtime."""
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in run_dir.rglob("*") if p.is_file() and "logs" not in p.relative_to(run_dir).parts}


def run_without_root_powers(script: str, config: Path) -> subprocess.CompletedProcess:
    """The stage as a subprocess; as root, without the capabilities that bypass file permissions."""
    command = [sys.executable, str(REPO / script), "--config", str(config)]
    if os.geteuid() == 0:
        caps = "-dac_override,-dac_read_search"
        command = ["setpriv", "--bounding-set", caps, "--inh-caps", caps, *command]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@contextlib.contextmanager
def damaged(path: Path, damage: Callable[[Path], None], keep: Path):
    """The file damaged for the duration; put back afterwards, bytes, mode and mtime included."""
    shutil.copy2(path, keep)
    damage(path)
    try:
        yield
    finally:
        if path.exists():
            path.unlink()
        shutil.copy2(keep, path)


def assert_one_error_naming(code: int, stderr: str, named: list[Path], case: str) -> None:
    lines = stderr.strip().splitlines()
    errors = [line for line in lines if line.startswith("error")]
    assert code == 2, f"{case}: exit {code}\n{stderr[-2000:]}"
    assert len(errors) == 1 and lines[-1] == errors[0] and errors[0].startswith("error: "), f"{case}:\n{stderr[-2000:]}"
    assert any(str(p) in errors[0] for p in named), f"{case}: {errors[0]!r} names none of {named}"


# --------------------------------------------------------------------------------------------------------
# Every damage is refused, with one line, and changes nothing


@pytest.mark.parametrize("case", CASES, ids=[f"{f.replace(BEST, 'best')}-{d.__name__}" for f, _, d in CASES])
def test_damaged_file_is_refused_by_its_reader_with_one_line_and_nothing_changes(run, case, tmp_path, capsys, monkeypatch):
    config, run_dir = run
    file, script, damage = case
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = resolve(run_dir, file)
    # A deleted or unfinished manifest is reported as its stage not having finished, naming the stage folder.
    named = [path, path.parent] if path.name == "manifest.json" else [path]
    with damaged(path, damage, tmp_path / "kept"):
        before = snapshot(run_dir)
        if damage is unreadable:
            result = run_without_root_powers(script, config)
            code, stderr = result.returncode, result.stderr
        else:
            code, _, stderr = run_stage_in_process(script, config, capsys)
        assert_one_error_naming(code, stderr, named, f"{file} {damage.__name__} -> {script}")
        assert snapshot(run_dir) == before, f"{file} {damage.__name__}: {script} changed files of the run"


@pytest.mark.parametrize("damage", REPORT_DAMAGES, ids=[d.__name__ for d in REPORT_DAMAGES])
def test_damaged_report_is_refused_by_its_reader_and_not_trusted_as_complete(run, damage, tmp_path):
    from eagle_pipeline.config import load_config
    from eagle_pipeline.errors import BadInput
    from eagle_pipeline.serve.report import read_report
    from eagle_pipeline.stage import Stage, read_manifest

    config, run_dir = run
    path = run_dir / "06_serve_test" / "report.json"
    stage = Stage(6, load_config(config), force=False)
    inputs = read_manifest(stage.dir)["inputs"]
    assert stage.already_complete(inputs)
    with damaged(path, damage, tmp_path / "kept"):
        before = snapshot(run_dir)
        with pytest.raises(BadInput) as refused:
            read_report(path)
        assert str(refused.value).startswith(f"{path}: ") and "\n" not in str(refused.value)
        # What stage 06 does on its rerun: the report no longer counts as complete, so it measures again.
        assert not stage.already_complete(inputs)
        assert snapshot(run_dir) == before
    assert stage.already_complete(inputs)


def test_every_stage_is_complete_again_once_the_files_are_back(run, capsys, monkeypatch):
    config, run_dir = run
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = snapshot(run_dir)
    for script, number in STAGE_NUMBERS.items():
        code, out, err = run_stage_in_process(script, config, capsys)
        assert code == 0 and f"stage {number:02d} already complete" in out, f"{script}: exit {code}\n{err[-2000:]}"
    assert snapshot(run_dir) == before


# --------------------------------------------------------------------------------------------------------
# Repaired as the error line says: the producing stage redoes only what is damaged


def _mtimes(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file() and "logs" not in p.parts}


def test_deleted_vocab_map_is_rebuilt_byte_for_byte_and_training_stays_complete(run):
    config, run_dir = run
    d2t = run_dir / "03_build_vocab_map" / "d2t.npy"
    original = d2t.read_bytes()
    d2t.unlink()
    refused = run_stage("04_train.py", config)
    assert refused.returncode == 2 and f"error: {d2t}: missing" in refused.stderr and "rerun 03_build_vocab_map.py" in refused.stderr
    rebuilt = ok(run_stage("03_build_vocab_map.py", config))
    assert "d2t.npy: missing" in rebuilt.stderr and "stage 03 done" in rebuilt.stdout
    assert d2t.read_bytes() == original
    assert "stage 04 already complete" in ok(run_stage("04_train.py", config)).stdout


def test_torn_best_json_is_rewritten_without_training_again(run):
    config, run_dir = run
    train = run_dir / "04_train"
    best = train / "best.json"
    original = best.read_bytes()
    checkpoints = _mtimes(train / "checkpoints")
    truncate(best)
    refused = run_stage("05_convert.py", config)
    assert refused.returncode == 2 and f"error: {best}: " in refused.stderr and "rerun 04_train.py" in refused.stderr
    redone = ok(run_stage("04_train.py", config))
    assert "best.json" in redone.stderr and "stage 04 done" in redone.stdout
    assert best.read_bytes() == original
    assert _mtimes(train / "checkpoints") == checkpoints  # no epoch trained again, no checkpoint rewritten
    assert "stage 05 already complete" in ok(run_stage("05_convert.py", config)).stdout


def test_torn_conversations_are_rebuilt_from_the_finished_parts_without_generating(run):
    config, run_dir = run
    arrow = run_dir / "01_generate_data" / "conversations" / "data-00000-of-00001.arrow"
    original = arrow.read_bytes()
    parts = _mtimes(run_dir / "01_generate_data" / "parts")
    truncate(arrow)
    refused = run_stage("02_extract_hidden.py", config)
    assert refused.returncode == 2 and f"error: {arrow}: " in refused.stderr and "rerun 01_generate_data.py" in refused.stderr
    redone = ok(run_stage("01_generate_data.py", config))
    assert ", 0 to generate" in redone.stdout
    assert arrow.read_bytes() == original and _mtimes(run_dir / "01_generate_data" / "parts") == parts
    assert "stage 02 already complete" in ok(run_stage("02_extract_hidden.py", config)).stdout


def test_deleted_hidden_state_sample_is_captured_again_alone(run):
    config, run_dir = run
    samples = run_dir / "02_extract_hidden" / "data" / "hidden_states"
    lost = samples / "hs_3.safetensors"
    kept = {k: v for k, v in _mtimes(samples).items() if k != lost.name}
    lost.unlink()
    refused = run_stage("04_train.py", config)
    assert refused.returncode == 2 and f"error: {lost}: missing" in refused.stderr and "rerun 02_extract_hidden.py" in refused.stderr
    redone = ok(run_stage("02_extract_hidden.py", config))
    assert "5 of 6 samples already captured, 1 to capture" in redone.stdout
    assert lost.is_file() and {k: v for k, v in _mtimes(samples).items() if k != lost.name} == kept
    assert "stage 04 already complete" in ok(run_stage("04_train.py", config)).stdout
