"""Capture servers this host starts for an online run (docs/online.md, "How to run it", step 2): vLLM's server of
the target with the capture method and the run's connector, answering to the target's path and to a capture label
that eagle_pipeline/online/endpoints.py checks, and restarted by a supervisor thread when it dies."""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any, Callable

from eagle_pipeline.capture import capture_sizing, kv_transfer_config, speculative_config
from eagle_pipeline.config import RunConfig
from eagle_pipeline.engine import server_kwargs, target_engine_fingerprint
from eagle_pipeline.gpus import CUDA_CONTEXT_GIB, GIB, gpu_memory_bytes, visible_gpus
from eagle_pipeline.layer_ids import capture_layer_ids
from eagle_pipeline.online.memory import capture_share, run_plan
from eagle_pipeline.online.settings import requests_in_flight
from eagle_pipeline.serve.server import HOST, VllmServer, find_free_port
from eagle_pipeline.serve.spec_metrics import read_prometheus, sample_sums

log = logging.getLogger(__name__)

LABEL_PREFIX = "eagle-capture"
# How many times a server this host started is started again after it died; then training stops when its retries
# run out (eagle_pipeline/online/failure.py).
MAX_RESTARTS = 3


def share_free_now(planned: float, free_bytes: int | None, total_bytes: int | None) -> float:
    """The gpu_memory_utilization a restarted server asks for: the planned share, or less where the GPUs have
    less free now. vLLM refuses to start when a GPU's free memory, after its own CUDA context, is below the share
    it is asked for (vllm/v1/worker/utils.py, request_memory), so that context is left aside, and the share is
    rounded down to hundredths."""
    if not free_bytes or not total_bytes:
        return planned
    room = int(100 * (free_bytes - CUDA_CONTEXT_GIB * GIB) / total_bytes) / 100
    return max(0.01, min(planned, room))


def free_share_reader(cfg) -> Callable[[], float] | None:
    """What `CaptureServer` asks before a restart on GPUs (None elsewhere): `share_free_now` of the run's share
    over the GPUs this process may use, read with nvidia-smi (eagle_pipeline/online/memory.py)."""
    planned = capture_share(cfg)
    if planned is None:
        return None

    def read() -> float:
        gpus = visible_gpus()
        return share_free_now(planned, gpu_memory_bytes("memory.free", gpus), gpu_memory_bytes("memory.total", gpus))

    return read


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


# What a capture server's prefills took since it last started (vLLM's Prometheus counters, summed over engines).
CAPTURE_COUNTERS = {"prompt_tokens": "vllm:prompt_tokens_total",
                    "prefill_seconds": "vllm:request_prefill_time_seconds_sum",
                    "requests": "vllm:request_prefill_time_seconds_count"}


def capture_metrics(endpoint: str, timeout: float = 10.0) -> dict[str, float]:
    """CAPTURE_COUNTERS of the server at `endpoint` (its /v1 base URL)."""
    base = endpoint.removesuffix("/").removesuffix("/v1")
    sums = sample_sums(read_prometheus(f"{base}/metrics", timeout))
    return {key: sums.get(name, 0.0) for key, name in CAPTURE_COUNTERS.items()}


def served_model_name(verifier) -> str:
    """The name speculators' dataset asks a capture server for: the verifier's path as the trainer resolves it
    (eagle_pipeline/train/settings.py, TrainRun.verifier_dir)."""
    return str(Path(verifier.path).expanduser().resolve())


def run_label(cfg, verifier, layout) -> str:
    """The capture label of a server that captures what this run trains on."""
    return capture_label(target=verifier.fingerprints()["verifier"],
                         capture_ids=capture_layer_ids(layout.layer_ids, layout.num_layers),
                         transfer=cfg.hidden_states.transfer, hidden_size=layout.hidden_size,
                         engine=target_engine_fingerprint(cfg, cfg.verifier.dtype))  # stage 02's `engine` input


def capture_server_kwargs(cfg: RunConfig, *, speculative_config: dict[str, Any], kv_transfer_config: dict[str, Any],
                          served_model_names: list[str], max_model_len: int,
                          listen_host: str | None = None, max_num_seqs: int | None = None) -> dict[str, Any]:
    """`VllmServer` arguments for a hidden-state capture server of the target: the served target's settings
    (`server_kwargs`) with the capture method and connector, no prefix caching (each request is a one-off prefill
    whose states must be its own), a batch of one longest sequence, no CUDA graphs, and the names it answers to
    (speculators asks for the first)."""
    kwargs = server_kwargs(cfg)
    flags = ["--kv-transfer-config", json.dumps(kv_transfer_config), "--no-enable-prefix-caching",
             "--served-model-name", *served_model_names]
    if "max_num_batched_tokens" not in cfg.verifier.engine_args:  # verifier.engine_args may size the batch otherwise
        flags += ["--max-num-batched-tokens", str(max_model_len)]
    # vLLM's default (256 or more sequences) sizes its sampler's profiling and its CUDA graphs for batches the
    # ranks never send; a capture is one prefill per request, which CUDA graphs (decode batches) never serve, so
    # they would only hold memory the co-located trainer needs (eagle_pipeline/online/memory.py).
    if "max_num_seqs" not in cfg.verifier.engine_args:
        flags += ["--max-num-seqs", str(max_num_seqs or requests_in_flight(cfg))]
    if not cfg.verifier.enforce_eager:  # server_args already passes it when the config sets it
        flags.append("--enforce-eager")
    share = cfg.hidden_states.capture_gpu_memory_utilization
    # After server_args' verifier.gpu_memory_utilization: the last one counts.
    if cfg.device == "cuda" and share is not None:
        flags += ["--gpu-memory-utilization", str(share)]
    if listen_host is not None:
        flags += ["--host", listen_host]  # after serve_flags' own --host: the last one counts
    return {**kwargs, "max_model_len": max_model_len, "speculative_config": speculative_config,
            "extra_args": [*kwargs["extra_args"], *flags]}


def server_kwargs_for(cfg, verifier, layout, *, storage: Path | None, mooncake_client: dict[str, Any] | None,
                      longest_sequence: int, listen_host: str | None = None) -> dict[str, Any]:
    """`CaptureServer` arguments of a capture server for this run, sized for `longest_sequence` (and what its cache
    holds beside the trainer, `run_plan`), answering to the verifier's path and the run's label."""
    return {"target_dir": verifier.path, **capture_server_kwargs(
        cfg, speculative_config=speculative_config(layout.layer_ids, layout.num_layers),
        kv_transfer_config=kv_transfer_config(storage, cfg.device, cfg.hidden_states.transfer, mooncake_client),
        served_model_names=[served_model_name(verifier), run_label(cfg, verifier, layout)],
        max_model_len=capture_sizing(longest_sequence)["max_model_len"], listen_host=listen_host,
        max_num_seqs=getattr(run_plan(cfg, verifier, layout), "server_sequences", None))}  # None: no plan made


class CaptureServer:
    """`with CaptureServer(server_kwargs, log_path) as server:` starts a capture server on a free port (or
    `port`) and keeps it up until the block ends: a server that dies is started again on the same port, up to
    MAX_RESTARTS times, asking vLLM for `restart_share()` of each GPU when that is given (`free_share_reader`).
    `server.endpoint` is the base URL speculators asks; starting and stopping the server is VllmServer's."""

    def __init__(self, server_kwargs: dict[str, Any], log_path: Path, *, port: int | None = None,
                 startup_timeout_s: float = 1200.0, poll_s: float = 1.0,
                 restart_share: Callable[[], float] | None = None):
        self.server_kwargs = server_kwargs
        self.restart_share = restart_share
        self.log_path = Path(log_path)
        self.port = port or find_free_port()
        self.startup_timeout_s = startup_timeout_s
        self.poll_s = poll_s
        self.restarts = 0
        self.gave_up = False
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, name=f"capture-server-{self.port}", daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}/v1"

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
        server = self._new_server()
        try:
            server.start()
        except BaseException as error:  # noqa: BLE001 - handed to the thread that waits for the start
            self.error = error
            return
        finally:
            self._ready.set()
        try:
            while not self._stop.wait(self.poll_s):
                code = server.returncode()
                if code is None:
                    continue
                log.warning("capture server %s exited with %s; see %s", self.endpoint, code, self.log_path)
                server.stop()
                if self.restarts >= MAX_RESTARTS:
                    self.gave_up = True
                    log.error("capture server %s died %d times; not starting it again", self.endpoint,
                              self.restarts + 1)
                    break
                self.restarts += 1
                try:
                    if self.restart_share is not None:
                        share = self.restart_share()
                        server.extra_args += ["--gpu-memory-utilization", str(share)]  # the last one counts
                        log.warning("capture server %s asks for %.2f of each GPU on restart (what is free now)",
                                    self.endpoint, share)
                    server.start()
                    log.warning("capture server %s started again (restart %d of %d)", self.endpoint, self.restarts,
                                MAX_RESTARTS)
                except Exception as error:  # noqa: BLE001 - the trainer's retries then run out and name the server
                    log.error("capture server %s did not start again: %s", self.endpoint, error)
                    self.gave_up = True
                    break
        finally:
            server.stop()
