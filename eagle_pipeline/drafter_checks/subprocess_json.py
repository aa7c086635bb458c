"""Runs one vLLM job of the drafter checks (`python -m eagle_pipeline.drafter_checks.cli ...`) in a process
of its own and returns the JSON it writes.

vLLM spawns workers and keeps process-global state (distributed groups, current config) that must not
leak into the caller, so each job gets its own process. Its whole output goes to a log file the caller
names (stage 05: `05_convert/logs/`), because the reason an engine fails to start on a multi-GPU host is
seldom in the last lines; a failure carries the log's tail and its path.

Where the job's engine runs in its own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), the job is forked
from a process that imported vLLM once (job_host) rather than started as a fresh interpreter; the log and
the rules below are the same.

A job that runs past its timeout is killed with everything it started: vLLM's engine core and its workers
do not exit when the job dies (they were seen running on as orphans), and on a GPU host they would keep the
GPUs' memory from the next engine.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from eagle_pipeline.engine import MULTIPROCESSING_VARIABLE

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
    The job's output is written to `log_path` (kept), or to a temporary file when none is given. Where the
    job's engine runs in its own process, the job is forked from this process's job host (job_host), which
    imported vLLM once, instead of starting a fresh interpreter."""
    command = [sys.executable, "-m", "eagle_pipeline.drafter_checks.cli", *args]
    job_env = subprocess_env(env)
    with tempfile.TemporaryDirectory(prefix="eagle-verify-") as tmp:
        out = Path(tmp) / "result.json"
        log = Path(log_path) if log_path is not None else Path(tmp) / "log.txt"
        if job_env.get(MULTIPROCESSING_VARIABLE) == "0":
            code = run_forked([*command, "--out", str(out)], log, env or {}, job_env, timeout)
        else:
            code = run_logged([*command, "--out", str(out)], log, job_env, timeout)
        if code != 0 or not out.exists():
            tail = log.read_text(errors="replace")[-3000:]
            whole = f" (whole log: {log})" if log_path is not None else ""
            what = f"did not finish within {timeout:g} s and was killed" if code is None else f"exited with {code}"
            raise RuntimeError(f"vLLM subprocess {args[0]} {what}{whole}:\n{tail}")
        return json.loads(out.read_text())


def run_forked(command: list[str], log: Path, settings: dict[str, str], env: dict[str, str],
               timeout: float) -> int | None:
    """`run_logged`'s contract for a job forked from the job host shared by jobs with these `settings` (the
    caller's variables; `env`, the whole environment, is the job's): the log headed by the command that runs
    the same job in a fresh process, then the host's note, then the job's output."""
    from eagle_pipeline.drafter_checks.job_host import FORK_NOTE, shared_host

    log.parent.mkdir(parents=True, exist_ok=True)
    try:
        host = shared_host(settings, env)
    except RuntimeError:  # a fresh process fails the same way, and shows why in the job's log
        return run_logged(command, log, env, timeout)
    log.write_text(f"$ {shlex.join(command)}\n{FORK_NOTE.format(pid=host.pid)}\n")
    return host.run(command[3:], log, timeout, env)  # the cli's own arguments, after `python -m MODULE`


def run_logged(command: list[str], log: Path, env: dict[str, str], timeout: float) -> int | None:
    """Run `command` with its output in `log` (headed by the command); its exit code, or None when it ran
    past `timeout` and was killed together with every process below it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as log_file:
        log_file.write(f"$ {shlex.join(command)}\n".encode())
        log_file.flush()
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        try:
            return process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tree(process)
            return None
        except BaseException:  # Ctrl-C while waiting: nothing of the job may outlive the stage
            kill_tree(process)
            raise


def kill_tree(process: subprocess.Popen) -> None:
    """SIGKILL a process that this one started, and all its descendants."""
    kill_pid_tree(process.pid, reap=process.wait)


def kill_pid_tree(pid: int, reap: Callable[[], object] | None = None) -> None:
    """SIGKILL a process and all its descendants. Each is stopped first, until no new one appears, so none
    can start another or be orphaned (and so lost from the tree) while the others are killed. `reap` waits
    for the process itself where this one is its parent."""
    stopped: list[int] = []
    while True:
        found = [p for p in [pid, *descendants(pid)] if p not in stopped]
        if not found:
            break
        for p in found:
            _signal(p, signal.SIGSTOP)
        stopped += found
    for p in stopped:
        _signal(p, signal.SIGKILL)
    if reap is not None:
        reap()
    # The others are reaped by whoever inherits them, not by us: wait until each is dead (gone or a zombie).
    deadline = time.monotonic() + 10
    while any(_state(p) not in ("Z", "X", None) for p in stopped) and time.monotonic() < deadline:
        time.sleep(0.05)


def descendants(pid: int) -> list[int]:
    """The live processes below `pid`, read from /proc (Linux)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # gone meanwhile
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
