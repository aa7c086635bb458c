"""Shared fixtures: the repository root, the Python that runs stage scripts, small configs."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import yaml

from eagle_pipeline.process_tree import process_state

REPO = Path(__file__).resolve().parent.parent


TINY_CONFIG = REPO / "configs" / "tiny.yaml"
# The suite's one small pipeline run (the `small_run` and `finished_small_run` fixtures): 6 conversations of
# at most 24 tokens, short training and serving, an acceptance floor any drafter passes. It is also what
# users get as their first try.
SMOKE_CONFIG = REPO / "configs" / "tiny-smoke.yaml"
SMOKE = yaml.safe_load(SMOKE_CONFIG.read_text())


def write_config(path: Path, base: Path = TINY_CONFIG, **overrides) -> Path:
    """A config file that extends `base` (configs/tiny.yaml) with nested overrides."""
    data = {"extends": str(base), **overrides}
    path.write_text(yaml.safe_dump(data))
    return path


def write_smoke_config(path: Path, **overrides) -> Path:
    """A config file that extends configs/tiny-smoke.yaml with nested overrides."""
    return write_config(path, base=SMOKE_CONFIG, **overrides)


def run_stage(script: str, config: Path, *args: str, timeout: int = 900,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, str(REPO / script), "--config", str(config), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )


def run_stage_in_process(script: str, config: Path, capsys, *args: str) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a stage's command line run in this process: a stage that refuses before
    loading a model answers in milliseconds instead of a fresh interpreter's seconds."""
    from eagle_pipeline.stage import main

    module = stage_module(script)
    capsys.readouterr()
    try:
        with mock.patch.dict(os.environ):  # the stage sets its engine's environment for this process only
            main(int(script[:2]), module.__doc__, module.run, ["--config", str(config), *args],
                 rehearsal=getattr(module, "dry_run_lines", None))
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def without_log_records(stderr: str) -> list[str]:
    """The lines of an in-process stage's stderr that the stage printed itself: the libraries' log records
    (timestamped, or starting with their level) reach the same stream when the stage runs in this process."""
    return [line for line in stderr.strip().splitlines() if not line.startswith(("20", "INFO", "WARNING"))]


def stage_module(script: str):
    """A stage script loaded as a module, to run its command line in this process: `stage.main(n, m.__doc__, m.run, argv)`."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"stage_script_{script[:2]}", REPO / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    return write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="t")


@pytest.fixture(autouse=True)
def deepseek_v3_config_keeps_its_name():
    """vLLM renames transformers' DeepseekV3Config to "kimi_k2" (the class attribute) in a process that has read a
    Kimi config (vllm/transformers_utils/config.py, _register_config_class), as the engine rehearsal's tests do in
    the test process. A DeepSeek-V3 stand-in saved afterwards in the same process would lose the per-expert
    checkpoint layout transformers writes for "deepseek_v3" only, and vLLM would refuse it. The product meets
    the same rename in stage 05 and 06 (patches/speculators_mla.py takes both names)."""
    from transformers import DeepseekV3Config

    yield
    DeepseekV3Config.model_type = "deepseek_v3"  # transformers' own name, whatever a fixture set up before


def skip_without_bf16_matmul() -> None:
    """Skip, saying why, on a CPU where torch has no bf16 matmul kernel. vLLM's CPU linear layers fall back
    from oneDNN (which has no bf16 matmul on AVX2-only CPUs) to torch's kernel, so a bf16 engine fails only
    when that one is missing too."""
    from bench.flops import unavailable_matmul_kernels

    missing = unavailable_matmul_kernels("bfloat16")
    if "torch" in missing:
        pytest.skip(f"a bf16 vLLM engine cannot run here: torch matmul {missing['torch']}")


def process_alive(pid: int) -> bool:
    """True while the process runs; a zombie (exited, its parent not yet reaping it) counts as ended."""
    return process_state(pid) not in ("Z", "X", None)


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker keeps to its own share of the cores, and so does everything it starts (vLLM binds
    its threads to the cores a process may use, torch sizes its thread pool by them). Two workers on one
    machine's cores would otherwise each start two-thread engines on both, whose threads spin waiting for each
    other."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    workers, index = int(workerinput["workercount"]), int(workerinput["workerid"].removeprefix("gw"))
    share = len(cores) // workers
    if share >= 1:
        os.sched_setaffinity(0, cores[index * share:(index + 1) * share])
    else:  # more workers than cores: each on one core, taking turns
        os.sched_setaffinity(0, [cores[index % len(cores)]])


FIRST_STAGES = ("01_generate_data.py", "02_extract_hidden.py", "03_build_vocab_map.py")
LAST_STAGES = ("04_train.py", "05_convert.py", "06_serve_test.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that needs the shared smoke run is `slow`: the first one waits minutes for it."""
    for item in items:
        if {"small_run", "finished_small_run"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


def build_shared_run(folder: Path, stages: tuple[str, ...]) -> Path:
    """Run `stages` of the smoke config in `folder` once per test session, whichever test process asks
    first; the others wait on the lock and find them done. A failure is recorded, so the next one to ask
    fails at once with the same log instead of building again. Returns the run's config."""
    folder.mkdir(parents=True, exist_ok=True)
    config = write_smoke_config(folder / "run.yaml", data_root=str(folder / "data"), run_name="t")
    log, failed = folder / "build.log", folder / "failed"
    with open(folder / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not failed.exists():
            for script in stages:
                if (folder / f"{script}.done").exists():
                    continue
                with open(log, "a") as out:
                    out.write(f"==> {script}\n")
                    out.flush()
                    code = subprocess.run([sys.executable, str(REPO / script), "--config", str(config)], cwd=REPO,
                                          env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"},
                                          stdout=out, stderr=subprocess.STDOUT, timeout=3600).returncode
                if code != 0:
                    failed.write_text(f"{script} exited {code}")
                    break
                (folder / f"{script}.done").touch()
    if failed.exists():
        raise RuntimeError(f"the shared smoke run in {folder} failed: {failed.read_text()}\n"
                           f"{log.read_text(errors='replace')[-6000:]}")
    return config


@pytest.fixture(scope="session")
def shared_run_folder(tmp_path_factory, worker_id) -> Path:
    """One folder for the whole session: beside the pytest-xdist workers' own temporary folders."""
    base = tmp_path_factory.getbasetemp()
    return (base if worker_id == "master" else base.parent) / "smoke"


@pytest.fixture(scope="session")
def small_run(shared_run_folder):
    """Stages 01-03 of the shared smoke run: (folder, config, run_dir)."""
    config = build_shared_run(shared_run_folder, FIRST_STAGES)
    return shared_run_folder, config, shared_run_folder / "data" / "t"


@pytest.fixture(scope="session")
def finished_small_run(shared_run_folder):
    """The shared smoke run with all six stages done: (config, run_dir)."""
    config = build_shared_run(shared_run_folder, FIRST_STAGES + LAST_STAGES)
    return config, shared_run_folder / "data" / "t"


def copy_of_run(reference: Path, root: Path, run_name: str) -> tuple[Path, Path]:
    """A copy of the finished run `reference` under `root`, and a smoke config that points at it: (config, run_dir)."""
    import shutil

    run_dir = root / "data" / run_name
    shutil.copytree(reference, run_dir, symlinks=True)
    return write_smoke_config(root / "run.yaml", data_root=str(root / "data"), run_name=run_name), run_dir
