"""Shared fixtures: the repository root, the Python that runs stage scripts, small configs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def write_config(path: Path, **overrides) -> Path:
    """A config file that extends configs/tiny.yaml with nested overrides."""
    data = {"extends": str(REPO / "configs" / "tiny.yaml"), **overrides}
    path.write_text(yaml.safe_dump(data))
    return path


def run_stage(script: str, config: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, str(REPO / script), "--config", str(config), *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )


@pytest.fixture
def tiny_config(tmp_path: Path) -> Path:
    return write_config(tmp_path / "run.yaml", data_root=str(tmp_path / "data"), run_name="t")


# A pipeline run small enough for tests: 6 conversations of at most 24 tokens, eager vLLM engines.
SMALL = dict(
    data={"num_samples": 6, "num_eval_prompts": 3},
    generation={"max_tokens": 24, "batch_size": 4},
    hidden_states={"batch_size": 2},
    vocab={"draft_vocab_size": 512},
    verifier={"cpu_kvcache_gib": 1},
)


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
    config = write_config(root / "run.yaml", data_root=str(root / "data"), run_name="t", **SMALL)
    for script in ("01_generate_data.py", "02_extract_hidden.py", "03_build_vocab_map.py"):
        ok(run_stage(script, config))
    return root, config, root / "data" / "t"


# Stages 04-06 on the small run: short training and serving, and an acceptance floor any drafter passes.
LATER = ["--set", "train.epochs=2", "--set", "convert.parity_prompts=2", "--set", "convert.parity_max_tokens=16",
         "--set", "serve.max_tokens=24", "--set", "serve.min_acceptance_length=1.0", "--set", "serve.concurrency=2"]


@pytest.fixture(scope="session")
def finished_small_run(small_run):
    """The small run with stages 04-06 done as well, once per test session: (config, run_dir)."""
    root, config, run_dir = small_run
    for script in ("04_train.py", "05_convert.py", "06_serve_test.py"):
        ok(run_stage(script, config, *LATER, timeout=1800))
    return config, run_dir
