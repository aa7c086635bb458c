"""Runs one vLLM job of the drafter checks (`python -m eagle_pipeline.drafter_checks.cli ...`) in a fresh
process of its own and returns the JSON it writes (docs/engines.md, "Drafter check jobs"). Its whole output goes to
a log file the caller names, because the reason an engine fails to start on a multi-GPU host is seldom in the last
lines; a failure carries the log's tail and its path.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from eagle_pipeline import engine_starts
from eagle_pipeline.child_process import run_logged

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
        with engine_starts.timed(f"vLLM job {args[0]}", loads_target=args[0] != "inspect"):
            code = run_logged([*command, "--out", str(out)], log, subprocess_env(env), timeout)
        if code != 0 or not out.exists():
            tail = log.read_text(errors="replace")[-3000:]
            whole = f" (whole log: {log})" if log_path is not None else ""
            what = f"did not finish within {timeout:g} s and was killed" if code is None else f"exited with {code}"
            raise RuntimeError(f"vLLM subprocess {args[0]} {what}{whole}:\n{tail}")
        return json.loads(out.read_text())
