"""Shared fixtures: the repository root, the Python that runs stage scripts, small configs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


TINY_CONFIG = REPO / "configs" / "tiny.yaml"
# The suite's one small pipeline run: 6 conversations of at most 24 tokens, short training and serving, an
# acceptance floor any drafter passes. It is also what users get as their first try.
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


def run_stage(script: str, config: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(REPO / script), "--config", str(config), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    return write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="t")


def skip_without_bf16_matmul() -> None:
    """Skip, saying why, on a CPU where torch has no bf16 matmul kernel. vLLM's CPU linear layers fall back
    from oneDNN (which has no bf16 matmul on AVX2-only CPUs) to torch's kernel, so a bf16 engine fails only
    when that one is missing too."""
    from bench.flops import unavailable_matmul_kernels

    missing = unavailable_matmul_kernels("bfloat16")
    if "torch" in missing:
        pytest.skip(f"a bf16 vLLM engine cannot run here: torch matmul {missing['torch']}")


def ok(result: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


@pytest.fixture(scope="session")
def small_run(tmp_path_factory):
    """Stages 01-03 run for real once per test session: (root, config, run_dir)."""
    root = tmp_path_factory.mktemp("pipeline")
    config = write_smoke_config(root / "run.yaml", data_root=str(root / "data"), run_name="t")
    for script in ("01_generate_data.py", "02_extract_hidden.py", "03_build_vocab_map.py"):
        ok(run_stage(script, config))
    return root, config, root / "data" / "t"


@pytest.fixture(scope="session")
def finished_small_run(small_run):
    """The small run with stages 04-06 done as well, once per test session: (config, run_dir)."""
    root, config, run_dir = small_run
    for script in ("04_train.py", "05_convert.py", "06_serve_test.py"):
        ok(run_stage(script, config, timeout=1800))
    return config, run_dir


def pytest_terminal_summary(terminalreporter):
    """How many generated bad-input cases tests/test_schema_fuzz.py tried (the figure BENCHMARKS.md quotes)."""
    fuzz = sys.modules.get("test_schema_fuzz")
    if fuzz is not None and fuzz.CASES_TRIED[0]:
        terminalreporter.write_line(f"schema fuzz: {fuzz.CASES_TRIED[0]} generated bad-input cases tried")
