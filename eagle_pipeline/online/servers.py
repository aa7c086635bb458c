"""Capture servers this host starts for an online run: vLLM's OpenAI server of the target with the
`extract_hidden_states` method and the run's connector (eagle_pipeline/capture.py owns both configs,
eagle_pipeline/engine.py the server's arguments, eagle_pipeline/serve/server.py its lifecycle).

Each server answers to two names: the target's path, which speculators' dataset asks for, and a capture label
that says what it captures (target, layer ids, transfer, engine settings), which eagle_pipeline/online/endpoints.py
checks before training. A supervisor thread restarts a server that dies while training runs, on the same port,
so the trainer's retries find it again.
"""

from __future__ import annotations

import logging
import threading
import urllib.request
from pathlib import Path
from typing import Any

from eagle_pipeline.fingerprint import value_fingerprint
from eagle_pipeline.serve.server import HOST, VllmServer, find_free_port

log = logging.getLogger(__name__)

LABEL_PREFIX = "eagle-capture"
# How many times a server this host started is started again after it died; then training stops when its retries
# run out (eagle_pipeline/online/failure.py).
MAX_RESTARTS = 3


def capture_label(*, target: str, capture_ids: list[int], transfer: str, hidden_size: int, engine: str) -> str:
    """The served name that says what a capture server captures: `eagle-capture;target=...;layers=...;...`."""
    fields = {"target": target[:16], "layers": ",".join(str(i) for i in capture_ids), "transfer": transfer,
              "hidden": str(hidden_size), "engine": engine[:16]}
    return ";".join([LABEL_PREFIX, *(f"{key}={value}" for key, value in fields.items())])


def parse_label(name: str) -> dict[str, str] | None:
    """The fields of a capture label, or None for any other served name."""
    parts = name.split(";")
    if parts[0] != LABEL_PREFIX:
        return None
    return dict(part.split("=", 1) for part in parts[1:] if "=" in part)


def engine_fingerprint(cfg) -> str:
    """How the server computes the target (dtype and engine settings): stage 02's `engine` input, the same way."""
    from eagle_pipeline.engine import target_engine_settings

    return value_fingerprint([cfg.verifier.dtype, target_engine_settings(cfg), cfg.verifier.engine_args])


def capture_metrics(endpoint: str, timeout: float = 10.0) -> dict[str, float]:
    """Prompt tokens a server has captured and the seconds its prefills took, from its Prometheus metrics (since
    it last started)."""
    base = endpoint.removesuffix("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/metrics", timeout=timeout) as response:
        text = response.read().decode()
    totals = {"prompt_tokens": 0.0, "prefill_seconds": 0.0, "requests": 0.0}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if line.startswith("vllm:prompt_tokens_total"):
            totals["prompt_tokens"] += float(value)
        elif line.startswith("vllm:request_prefill_time_seconds_sum"):
            totals["prefill_seconds"] += float(value)
        elif line.startswith("vllm:request_prefill_time_seconds_count"):
            totals["requests"] += float(value)
    return totals


def served_model_name(verifier) -> str:
    """The name speculators' dataset asks a capture server for: the verifier's path as the trainer resolves it
    (eagle_pipeline/train/settings.py, TrainRun.verifier_dir)."""
    return str(Path(verifier.path).expanduser().resolve())


def run_label(cfg, verifier, layout) -> str:
    """The capture label of a server that captures what this run trains on."""
    from eagle_pipeline.layer_ids import capture_layer_ids

    return capture_label(target=verifier.fingerprints()["verifier"],
                         capture_ids=capture_layer_ids(layout.layer_ids, layout.num_layers),
                         transfer=cfg.hidden_states.transfer, hidden_size=layout.hidden_size,
                         engine=engine_fingerprint(cfg))


def server_kwargs_for(cfg, verifier, layout, *, storage: Path | None, mooncake_client: dict[str, Any] | None,
                      longest_sequence: int, listen_host: str | None = None) -> dict[str, Any]:
    """`CaptureServer` arguments of a capture server for this run: the capture method and connector
    (eagle_pipeline/capture.py) in the target's server (eagle_pipeline/engine.py), sized for `longest_sequence`,
    answering to the verifier's path and the run's capture label."""
    from eagle_pipeline.capture import capture_sizing, kv_transfer_config, speculative_config
    from eagle_pipeline.engine import capture_server_kwargs

    return {"target_dir": verifier.path, **capture_server_kwargs(
        cfg, speculative_config=speculative_config(layout.layer_ids, layout.num_layers),
        kv_transfer_config=kv_transfer_config(storage, cfg.device, cfg.hidden_states.transfer, mooncake_client),
        served_model_names=[served_model_name(verifier), run_label(cfg, verifier, layout)],
        max_model_len=capture_sizing(longest_sequence)["max_model_len"], listen_host=listen_host)}


class CaptureServer:
    """`with CaptureServer(server_kwargs, log_path) as server:` starts a capture server on a free port (or
    `port`) and keeps it up until the block ends: a server that dies is started again on the same port, up to
    MAX_RESTARTS times. `server.endpoint` is the base URL speculators asks."""

    def __init__(self, server_kwargs: dict[str, Any], log_path: Path, *, port: int | None = None,
                 startup_timeout_s: float = 1200.0, max_restarts: int = MAX_RESTARTS, poll_s: float = 1.0):
        self.server_kwargs = server_kwargs
        self.log_path = Path(log_path)
        self.port = port or find_free_port()
        self.startup_timeout_s = startup_timeout_s
        self.max_restarts = max_restarts
        self.poll_s = poll_s
        self.restarts = 0
        self.gave_up = False
        self.error: BaseException | None = None
        self._server: VllmServer | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name=f"capture-server-{self.port}", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

    @property
    def pid(self) -> int | None:
        """The API server's process id (its process group holds the engine), None while it is down."""
        server = self._server
        process = server.process if server is not None else None
        return process.pid if process is not None else None

    def __enter__(self) -> "CaptureServer":
        # The supervisor thread starts the server and lives as long as it does: the server's parent-death signal
        # fires when the thread that started it exits (eagle_pipeline/serve/server.py).
        self._thread.start()
        self._ready.wait()
        if self.error is not None:
            self._thread.join()
            raise self.error
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()

    def _new_server(self) -> VllmServer:
        return VllmServer(**self.server_kwargs, port=self.port, log_path=self.log_path,
                          startup_timeout_s=self.startup_timeout_s)

    def _supervise(self) -> None:
        server = self._server = self._new_server()
        try:
            server.start()
        except BaseException as error:  # noqa: BLE001 - handed to the thread that waits for the start
            self.error = error
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.wait(self.poll_s):
                process = server.process
                if process is None or process.poll() is None:
                    continue
                log.warning("capture server %s exited with %s; see %s", self.endpoint, process.returncode, self.log_path)
                server.stop()
                if self.restarts >= self.max_restarts:
                    self.gave_up = True
                    log.error("capture server %s died %d times; not starting it again", self.endpoint, self.restarts + 1)
                    break
                self.restarts += 1
                try:
                    server.start()
                    log.warning("capture server %s started again (restart %d of %d)", self.endpoint, self.restarts,
                                self.max_restarts)
                except Exception as error:  # noqa: BLE001 - the trainer's retries then run out and name the server
                    log.error("capture server %s did not start again: %s", self.endpoint, error)
                    self.gave_up = True
                    break
        finally:
            server.stop()
