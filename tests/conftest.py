"""Shared fixtures: the repository root, the Python that runs stage scripts, small configs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


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
