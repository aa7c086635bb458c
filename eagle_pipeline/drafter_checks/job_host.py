"""A process that imports vLLM once and forks one child per drafter-check job, for the jobs whose engine runs
in the job's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, a CPU host without tensor parallelism).

Each job needs a process of its own (subprocess_json), and a fresh interpreter spends about 10 s of one core
importing vLLM before the job starts; stage 05 runs three jobs. A child forked from a host that has imported
vLLM, and has run no model computation (so no OpenMP thread pool to hand on), starts its job at once. Each
child runs `python -m eagle_pipeline.drafter_checks.cli`'s `main` with its output in the job's log, exactly
as a fresh process would, and the caller keeps the rule of a fresh process: a job past its timeout is killed
with everything below it (docs/engines.md, "Drafter check jobs on a CPU host").

The host is started as `python -m eagle_pipeline.drafter_checks.job_host --preload MODULE...` and speaks JSON
lines over its standard input and a pipe of its own: {"argv", "log", "env"} in; {"pid"}, then {"exit"} out. It
dies with the process that started it, and a running job with it (Linux's parent-death signal): a killed
stage leaves no vLLM job behind, as a fresh process would have been left running to its end.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

from eagle_pipeline.drafter_checks.subprocess_json import kill_pid_tree
from eagle_pipeline.parent_death import signal_on_parent_death

JOBS_MODULE = "eagle_pipeline.drafter_checks.cli"
# What a job imports before its engine starts (`from vllm import LLM` pulls in vLLM's config, engine and
# model loader), imported by the host instead.
VLLM_PRELOAD = ("vllm", "vllm.entrypoints.llm", "eagle_pipeline.drafter_checks.cli")
READY_TIMEOUT_S = 300
FORK_NOTE = "# forked from the drafter checks' job host (pid {pid}), which imported vLLM once; the line above runs the same job in a fresh process"


class JobHost:
    """One host process; `run` forks a job in it and waits for the job's exit."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...] = VLLM_PRELOAD, jobs_module: str = JOBS_MODULE,
                 output: Path | None = None):
        """`output` takes the host's own output (what importing vLLM prints); discarded when None."""
        sink = open(output, "ab") if output is not None else subprocess.DEVNULL
        read_end, write_end = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "eagle_pipeline.drafter_checks.job_host", "--answer-fd", str(write_end),
                 "--owner", str(os.getpid()), "--jobs-module", jobs_module, "--preload", *preload],
                stdin=subprocess.PIPE, stdout=sink, stderr=subprocess.STDOUT, env=env, pass_fds=(write_end,))
        finally:
            os.close(write_end)
            if output is not None:
                sink.close()
        self.answers, self.pending = read_end, b""
        try:
            ready = self._answer(READY_TIMEOUT_S)
        except (RuntimeError, TimeoutError):
            ready = None
        if ready != {"ready": True}:
            self.close()
            raise RuntimeError(f"the job host did not start (exit {self.process.returncode})")

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def run(self, argv: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> int | None:
        """Fork `jobs_module.main(argv)` with its output appended to `log` and `env` as its environment (the
        host's when None); its exit code, or None when it ran past `timeout` and was killed together with
        every process below it."""
        request = {"argv": argv, "log": str(log), "env": env}
        self.process.stdin.write((json.dumps(request) + "\n").encode())
        self.process.stdin.flush()
        job = self._answer(READY_TIMEOUT_S)["pid"]
        try:
            answer = self._answer(timeout)
        except TimeoutError:
            kill_pid_tree(job)
            self._answer(READY_TIMEOUT_S)  # the host reaps it and reports its exit: read, so the next job starts clean
            return None
        except BaseException:  # Ctrl-C while waiting: nothing of the job may outlive the stage
            kill_pid_tree(job)
            self.close()
            raise
        return answer["exit"]

    def close(self) -> None:
        if self.process.stdin and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.answers is not None:
            os.close(self.answers)
            self.answers = None

    def _answer(self, timeout: float) -> dict:
        """The host's next answer line. Read from the pipe unbuffered, keeping what follows a line for the next
        call: a job that fails at once has both its answers in the pipe together."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if select.select([self.answers], [], [], min(left, 1.0))[0]:
                chunk = os.read(self.answers, 65536)
                if not chunk:
                    self.process.wait()
                    raise RuntimeError(f"the job host (pid {self.pid}) exited with {self.process.returncode}")
                self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)


_HOSTS: dict[tuple, JobHost] = {}


def shared_host(settings: dict[str, str], env: dict[str, str]) -> JobHost:
    """This process's host for jobs run with the variables `settings` (started on first use with `env`, the
    whole environment they make, and closed at exit): one import of vLLM for all of a stage's jobs. Keyed by
    the variables the caller sets, not by the whole environment, which libraries change as they load (torch
    sets TORCHINDUCTOR_CACHE_DIR); each job still runs with the whole environment it was given."""
    key = tuple(sorted(settings.items()))
    host = _HOSTS.get(key)
    if host is None or not host.alive():
        host = _HOSTS[key] = JobHost(env)
    return host


@atexit.register
def _close_hosts() -> None:
    for host in _HOSTS.values():
        host.close()
    _HOSTS.clear()


# ------------------------------------------------------------------------------------------- the host itself


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when its parent dies, or now if it already has. Where the kernel cannot promise
    that, the host does not start, and its jobs run as fresh processes."""
    if not signal_on_parent_death(signal.SIGKILL):
        raise OSError("no parent-death signal on this platform: a job host could outlive its owner")
    if os.getppid() != parent:
        os._exit(1)


def serve(answer_fd: int, owner: int, jobs_module: str, preload: list[str]) -> None:
    die_with_parent(owner)
    answers = os.fdopen(answer_fd, "w")
    for module in preload:
        importlib.import_module(module)

    def answer(message: dict) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    answer({"ready": True})
    host = os.getpid()
    while line := sys.stdin.readline():
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            die_with_parent(host)
            run_job(jobs_module, request["argv"], request["log"], request["env"], answer_fd)
        answer({"pid": pid})
        _, status = os.waitpid(pid, 0)
        answer({"exit": os.waitstatus_to_exitcode(status)})


def run_job(jobs_module: str, argv: list[str], log: str, env: dict[str, str] | None, answer_fd: int) -> None:
    """In the forked child: the job's output to its log, the host's pipes closed, its environment, then the
    job; never returns."""
    code = 1
    try:
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        output = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.close(output)
        os.close(answer_fd)
        jobs = importlib.import_module(jobs_module)
        sys.argv = [jobs.__file__, *argv]  # as `python -m` would have it (argparse names its program by it)
        jobs.main(argv)
        code = 0
    except SystemExit as exit_:  # argparse's refusal: the exit a fresh process would make
        if exit_.code is None:
            code = 0
        elif isinstance(exit_.code, int):
            code = exit_.code
        else:  # a message: printed, and exit status 1
            print(exit_.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="fork server of the drafter checks' vLLM jobs (started by JobHost)")
    parser.add_argument("--answer-fd", type=int, required=True)
    parser.add_argument("--owner", type=int, required=True)
    parser.add_argument("--jobs-module", required=True)
    parser.add_argument("--preload", nargs="*", default=[])
    args = parser.parse_args()
    serve(args.answer_fd, args.owner, args.jobs_module, args.preload)
