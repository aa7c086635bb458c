"""The one nvidia-smi reader (eagle_pipeline/gpus.py) as the memory plan and the GPU count use it, against a stub
nvidia-smi on PATH."""

from __future__ import annotations

import os
from pathlib import Path

from eagle_pipeline import gpus
from eagle_pipeline.gpus import gpu_memory_bytes


def stub(folder: Path, body: str) -> Path:
    """An nvidia-smi running `body` (sh) that logs its arguments to folder/args."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / "nvidia-smi"
    script.write_text(f'#!/bin/sh\necho "$*" >> {folder / "args"}\n{body}\n')
    script.chmod(0o755)
    return folder


def test_memory_is_the_smallest_figure_of_the_gpus_asked_for(tmp_path, monkeypatch):
    folder = stub(tmp_path / "bin", "printf '97887\\n95000\\n'")
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    assert gpu_memory_bytes("memory.free", ["1", "2"]) == 95000 * 2**20
    assert (folder / "args").read_text().split() == ["--query-gpu=memory.free", "--format=csv,noheader,nounits",
                                                     "-i", "1,2"]


def test_a_failing_or_missing_nvidia_smi_reads_as_no_figure_and_says_why(tmp_path, monkeypatch):
    folder = stub(tmp_path / "bin", "echo 'No devices were found'; exit 6")
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    rows, problem = gpus.query(["memory.total"])
    assert rows == [] and problem.endswith("failed (exit 6: No devices were found)"), problem
    assert gpu_memory_bytes() is None and gpus.listed_count()[0] == 0
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpus.visible_gpus() is None
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert gpus.query(["memory.total"]) == ([], gpus.NOT_ON_PATH) and gpu_memory_bytes() is None
