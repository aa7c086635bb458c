"""The host's NVIDIA GPUs as nvidia-smi reports them, and the ones this process may use: the one place that runs
nvidia-smi. The GPU preflight imports it before any package is installed, so it imports only the standard library
and keeps to Python 3.7's syntax (eagle_pipeline/preflight.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import List, Optional, Sequence, Tuple

NOT_ON_PATH = "nvidia-smi is not on PATH"
GIB = 2**30
# What a CUDA process holds outside PyTorch's allocator: context, cuBLAS workspaces, NCCL buffers.
CUDA_CONTEXT_GIB = 1.5


def run_nvidia_smi(args: Sequence[str], timeout: float = 60) -> Tuple[str, Optional[str]]:
    """nvidia-smi's standard output for `args`, or why there is none: not on PATH, could not run (the command
    and the OS error or time-out), or failed (the command, its exit code and the first line it said)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return "", NOT_ON_PATH
    command = [smi] + list(args)
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return "", f"`{' '.join(command)}` could not run ({e})"
    if result.returncode != 0:
        lines = (line.strip() for line in (result.stdout + result.stderr).splitlines())
        said = next((line for line in lines if line), "no output")
        return "", f"`{' '.join(command)}` failed (exit {result.returncode}: {said})"
    return result.stdout, None


def query(fields: Sequence[str], gpus: Optional[Sequence[str]] = None,
          timeout: float = 60) -> Tuple[List[List[str]], Optional[str]]:
    """One row of `fields` (nvidia-smi --query-gpu names) per GPU, for the GPUs `gpus` (indices or UUIDs; every
    GPU when None), or why there are none. The last field may hold commas (a GPU's name does): list it last."""
    args = ["--query-gpu=" + ",".join(fields), "--format=csv,noheader,nounits"]
    if gpus:
        args += ["-i", ",".join(gpus)]
    out, problem = run_nvidia_smi(args, timeout)  # no output when there is a problem
    rows = [[part.strip() for part in line.split(",", len(fields) - 1)] for line in out.splitlines() if line.strip()]
    return [row for row in rows if len(row) == len(fields)], problem


def listed_count(timeout: float = 30) -> Tuple[int, Optional[str]]:
    """How many GPUs `nvidia-smi -L` lists, or 0 and why it lists none."""
    out, problem = run_nvidia_smi(["-L"], timeout)
    return sum(1 for line in out.splitlines() if line.startswith("GPU ")), problem


def visible_gpus() -> Optional[List[str]]:
    """The GPUs this process may use: CUDA_VISIBLE_DEVICES's entries when set, else every GPU nvidia-smi lists
    (by index); None when the host shows none."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    count, _ = listed_count()
    return [str(i) for i in range(count)] or None


def gpu_memory_bytes(field: str = "memory.total", gpus: Sequence[str] | None = None) -> int | None:
    """The smallest figure among the GPUs `gpus` (nvidia-smi's indices or UUIDs; all of them when None) of
    nvidia-smi's `field` (memory.total, memory.free), None without nvidia-smi."""
    rows, _ = query([field], gpus, timeout=30)
    try:
        return min(int(row[0]) for row in rows) * 2**20
    except ValueError:  # no GPU listed (or no nvidia-smi), or a figure that is not a number ("[N/A]")
        return None
