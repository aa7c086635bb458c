"""Runs one vLLM job of the drafter checks (`python -m eagle_pipeline.drafter_checks.cli ...`) in a fresh
process and returns the JSON it writes.

vLLM spawns workers and keeps process-global state (distributed groups, current config) that must not
leak into the caller, so each job gets its own interpreter. Its whole output goes to a log file the caller
names (stage 05: `05_convert/logs/`), because the reason an engine fails to start on a multi-GPU host is
seldom in the last lines; a failure carries the log's tail and its path.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

# Default for one vLLM job (a start, a load or a parity run); stage 05 passes convert.engine_timeout_s.
SUBPROCESS_TIMEOUT_S = 1800


def subprocess_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env |= extra or {}
    return env


def run_json_subprocess(args: list[str], env: dict[str, str] | None = None,
                        timeout: float = SUBPROCESS_TIMEOUT_S, log_path: Path | None = None) -> dict[str, Any]:
    """Run `python -m eagle_pipeline.drafter_checks.cli ARGS --out FILE` and return FILE's JSON (or the failure).
    The job's output is written to `log_path` (kept), or to a temporary file when none is given."""
    command = [sys.executable, "-m", "eagle_pipeline.drafter_checks.cli", *args]
    with tempfile.TemporaryDirectory(prefix="eagle-verify-") as tmp:
        out = Path(tmp) / "result.json"
        log = Path(log_path) if log_path is not None else Path(tmp) / "log.txt"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as log_file:
            log_file.write(f"$ {shlex.join(command)}\n".encode())
            log_file.flush()
            proc = subprocess.run([*command, "--out", str(out)], stdout=log_file, stderr=subprocess.STDOUT,
                                  env=subprocess_env(env), timeout=timeout)
        if proc.returncode != 0 or not out.exists():
            tail = log.read_text(errors="replace")[-3000:]
            whole = f" (whole log: {log})" if log_path is not None else ""
            raise RuntimeError(f"vLLM subprocess {args[0]} exited with {proc.returncode}{whole}:\n{tail}")
        return json.loads(out.read_text())
