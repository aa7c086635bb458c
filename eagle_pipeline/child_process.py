"""The pipeline's child processes (vLLM servers, Mooncake's master and store, the drafter checks' vLLM jobs):
started with their output in a log file, waited for until ready, watched, and stopped with everything they
started. The one place that starts, watches and stops them; how a stop goes, and why: docs/engines.md, "Engine
processes".

- A child leads a process group of its own (a session): Ctrl-C in the terminal reaches only this process, and
  a stop signals the child's whole group (vLLM's API server, engine core and workers).
- It gets SIGTERM from the kernel when the *thread* that started it exits (parent_death.py): start it from a
  thread that lives as long as the child should.
- A guard process stops the group if this process dies without doing so (SIGKILL, the OOM killer). See `Guard`.
"""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
from collections.abc import Callable, Sequence
from pathlib import Path

from eagle_pipeline.parent_death import signal_on_parent_death
from eagle_pipeline.process_tree import kill_pid_tree, live_group_members

log = logging.getLogger(__name__)


class ChildFailed(RuntimeError):
    """A child exited, or did not become ready in time, while it was waited for; the message carries the tail of
    its log."""


# What a readiness probe may raise while the child is not listening yet.
NOT_LISTENING = (urllib.error.URLError, ConnectionError, TimeoutError, OSError)


def log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def die_with_parent() -> None:
    """Runs in the child before exec: if the thread that started it ends (this process killed outright), the child
    gets SIGTERM at once. Linux only; elsewhere a no-op. Not enough on its own: see Guard."""
    signal_on_parent_death(signal.SIGTERM)


class ChildProcess:
    """One child: `start()`, `wait_ready(...)`, `returncode()`, `wait(...)`, `stop()` (idempotent).

    `name` names it in errors and warnings; `log_path` receives its output, headed by the command (appended to
    with `append`, else written anew); `stop_grace_s` is how long a ready child gets between SIGTERM and SIGKILL.
    """

    def __init__(self, command: Sequence[str], log_path: str | os.PathLike, *, name: str,
                 env: dict[str, str] | None = None, stop_grace_s: float = 30.0, append: bool = True):
        self.command = [str(part) for part in command]
        self.log_path = Path(log_path)
        self.name = name
        self.env = env
        self.stop_grace_s = stop_grace_s
        self.append = append
        self.process: subprocess.Popen | None = None
        self.ready = False
        self._guard: Guard | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.ready = False
        with open(self.log_path, "ab" if self.append else "wb") as log_file:
            log_file.write(f"$ {shlex.join(self.command)}\n".encode())
            log_file.flush()
            self.process = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=log_file,
                                            stderr=subprocess.STDOUT, env=self.env, start_new_session=True,
                                            preexec_fn=die_with_parent)
        try:
            self._guard = Guard(self.process.pid, self.stop_grace_s, self.log_path)
        except BaseException:
            self.stop()
            raise

    def returncode(self) -> int | None:
        """The child's exit code once it has exited (None while it runs, or before it started)."""
        return self.process.poll() if self.process is not None else None

    def wait(self, timeout: float | None = None) -> int | None:
        """Wait for the child to exit: its exit code, None when `timeout` passed first."""
        assert self.process is not None
        try:
            return self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def wait_ready(self, ready: Callable[[], bool], timeout_s: float, what: str, *,
                   watch: Sequence["ChildProcess"] = (), error: type[ChildFailed] = ChildFailed,
                   poll_s: float = 0.2) -> None:
        """Poll `ready()` (a probe that raises NOT_LISTENING counts as not ready) until it holds, then mark the child
        ready (a stop is graceful from then on). `error` when this child or one of `watch` exits first ("NAME
        exited with code N while waiting for WHAT") or `timeout_s` passes ("NAME: gave up waiting for WHAT after
        S s"), with the log's tail."""
        started = time.monotonic()
        while True:
            for child in (self, *watch):
                code = child.returncode()
                if code is not None:
                    raise error(f"{child.name} exited with code {code} while waiting for {what}; "
                                f"log {child.log_path}:\n{log_tail(child.log_path)}")
            try:
                if ready():
                    break
            except NOT_LISTENING:
                pass
            if time.monotonic() - started > timeout_s:
                raise error(f"{self.name}: gave up waiting for {what} after {timeout_s:.0f} s; log {self.log_path}:\n"
                            f"{log_tail(self.log_path)}")
            # A refused connection costs microseconds; a coarser poll only adds to every start.
            time.sleep(poll_s)
        self.ready = True
        if self._guard is not None:
            self._guard.ready()

    def stop(self) -> None:
        """Stop the child's process group; idempotent. SIGTERM to the leader alone (vLLM's API server stops its engine
        core and workers in order; a signal to the whole group would kill the engine under it), SIGKILL to the group
        after the grace period, or at once for a child never ready; a second Ctrl-C in the grace period kills now."""
        process, self.process = self.process, None
        guard, self._guard = self._guard, None
        if process is None:
            return
        group = process.pid  # start_new_session made the child its group's leader
        try:
            if self.ready:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=self.stop_grace_s)
                    wait_group_gone(group, timeout=self.stop_grace_s)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            # Whatever happened above (a time-out, a second Ctrl-C), nothing of the group survives this: the tree
            # below the leader first (a process that left the group too), then the group (members orphaned by an
            # exited leader).
            try:
                if process.poll() is None:
                    kill_pid_tree(process.pid, reap=process.wait)
                signal_group(group, signal.SIGKILL)
                process.wait()
                try:
                    wait_group_gone(group, timeout=10.0)
                except subprocess.TimeoutExpired:
                    # SIGKILLed and still there (a process in uninterruptible sleep): nothing more to send, and
                    # failing here would throw away what the child did. Said, not raised.
                    log.warning("%s (%s): processes %s of its group still run 10 s after SIGKILL", self.name,
                                self.log_path, live_group_members(group))
            finally:
                self.ready = False
                if guard is not None:
                    guard.release()


def run_logged(command: Sequence[str], log_path: Path, env: dict[str, str], timeout: float) -> int | None:
    """Run `command` to its end with its output in `log_path` (written anew, headed by the command); its exit
    code, or None when it ran past `timeout` and was killed with everything it started. Ctrl-C (or SIGTERM) while
    it runs stops it too: nothing of it may outlive the caller."""
    child = ChildProcess(command, log_path, name=Path(command[0]).name, env=env, append=False)
    child.start()
    try:
        return child.wait(timeout)
    finally:
        child.stop()


def signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def wait_group_gone(group: int, timeout: float) -> None:
    """Wait for the group's members to exit (zombies count as gone); raise TimeoutExpired if they do not within
    `timeout`."""
    deadline = time.monotonic() + timeout
    while live_group_members(group):
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(f"process group {group}", timeout)
        time.sleep(0.05)


# The guard's program (python -c). Its stdin is a pipe whose write end only this process holds: it writes
# "ready" once the child is ready and "stopped" once it has stopped the child itself, so EOF without "stopped"
# means this process died (SIGKILL, the OOM killer), and the guard does what ChildProcess.stop() would have.
_GUARD_PROGRAM = """
import os, signal, sys, time

child, grace_s = int(sys.argv[1]), float(sys.argv[2])
said = sys.stdin.buffer.read()
if said.endswith(b"stopped"):
    sys.exit(0)


def group_alive():
    try:
        os.killpg(child, 0)
    except ProcessLookupError:
        return False
    return True


if b"ready" in said:
    try:
        os.kill(child, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while group_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
try:
    os.killpg(child, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


class Guard:
    """A small process that stops a child's process group if this process dies without doing so. It runs in a
    session of its own, so a signal to this process's group does not take it along."""

    def __init__(self, child_pid: int, grace_s: float, log_path: Path):
        read_end, self._write_end = os.pipe()  # neither end is inherited by later children
        try:
            with open(log_path, "ab") as log_file:
                self.process = subprocess.Popen(
                    [sys.executable, "-c", _GUARD_PROGRAM, str(child_pid), str(grace_s)],
                    stdin=read_end, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True,
                )
        except BaseException:
            os.close(self._write_end)
            raise
        finally:
            os.close(read_end)

    def ready(self) -> None:
        """The child is ready: from now on a stop is graceful (SIGTERM first)."""
        os.write(self._write_end, b"ready")

    def release(self) -> None:
        """The child is stopped: the guard exits without signalling anything."""
        try:
            os.write(self._write_end, b"stopped")
        finally:
            os.close(self._write_end)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
