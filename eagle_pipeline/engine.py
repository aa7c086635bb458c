"""Arguments for vLLM's offline engine and server, from the run config (CPU or GPU alike)."""

from __future__ import annotations

import json
import os
from typing import Any

from eagle_pipeline.config import RunConfig


def engine_env(cfg: RunConfig) -> dict[str, str]:
    """Environment for a vLLM process: no hub access, CPU KV cache size on the CPU backend, and on a
    single CPU worker the engine in-process (see `single_process_engine`)."""
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    if cfg.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.verifier.cpu_kvcache_gib)
    if single_process_engine(cfg):
        env[MULTIPROCESSING_VARIABLE] = "0"
    return env


# vLLM's switch between an engine in the calling process ("0") and engine-core/worker processes ("1").
MULTIPROCESSING_VARIABLE = "VLLM_ENABLE_V1_MULTIPROCESSING"


def single_process_engine(cfg: RunConfig) -> bool:
    """Whether vLLM runs its engine core (offline engine) and its one worker in the calling process.

    By default vLLM's CPU build spawns an engine-core process and, since its platform forces the
    multiprocessing executor while V1 multiprocessing is on, a worker process below it, each importing
    vLLM and torch again. With `VLLM_ENABLE_V1_MULTIPROCESSING=0` and one worker the offline engine runs in
    the stage's own process and a server's engine core runs its worker itself: measured on 2 cores, an
    offline engine ready in ~6 s instead of ~23 s and a server healthy in ~24 s instead of ~36 s, the same
    greedy text (the tiny Kimi-K2.5 verifier of tests/test_kimi_vllm.py: ~8 s instead of ~20 s). Tensor
    parallelism needs the worker processes, so it stays off there. An in-process engine is started through
    `offline_engine`, which patches the CPU worker's kernel scan (patches/vllm_kernel_rebind.py). Hidden-state
    capture follows the same rule (`capture.HiddenStateCapture` steps an in-process engine until its
    connector has written). In a stage's own process a variable its caller has set wins (`apply_engine_env`).
    """
    return cfg.device == "cpu" and cfg.verifier.tensor_parallel_size == 1


def offline_engine(**kwargs: Any):
    """`vllm.LLM(**kwargs)`, in this process or with engine processes as the environment says. In this process
    the CPU worker's start scans every loaded module, which fails on llvmlite's (loaded with vLLM's Kimi-K2.5
    model class) unless patched first (patches/vllm_kernel_rebind.py)."""
    from vllm import LLM

    if os.environ.get(MULTIPROCESSING_VARIABLE) == "0":
        from patches import vllm_kernel_rebind

        vllm_kernel_rebind.apply()
    return LLM(**kwargs)


def apply_engine_env(cfg: RunConfig) -> None:
    for key, value in engine_env(cfg).items():
        os.environ.setdefault(key, value)


def llm_kwargs(cfg: RunConfig, model: str, max_model_len: int | None = None, dtype: str | None = None) -> dict[str, Any]:
    """vLLM's offline-engine arguments for the target: the verifier section, with `dtype` (stage 01's
    generation.dtype) in place of verifier.dtype when given."""
    v = cfg.verifier
    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": dtype or v.dtype,
        "max_model_len": max_model_len or v.max_model_len,
        "tensor_parallel_size": v.tensor_parallel_size,
        "trust_remote_code": v.trust_remote_code,
        "seed": cfg.seed,
    }
    if cfg.device == "cuda":
        kwargs["gpu_memory_utilization"] = v.gpu_memory_utilization
        kwargs["enable_expert_parallel"] = v.enable_expert_parallel
    kwargs.update(v.engine_args)
    return kwargs


def server_args(cfg: RunConfig) -> list[str]:
    """The same engine settings as `llm_kwargs`, as `vllm serve` flags (dtype and max_model_len aside)."""
    v = cfg.verifier
    args = ["--tensor-parallel-size", str(v.tensor_parallel_size), "--seed", str(cfg.seed)]
    if v.trust_remote_code:
        args.append("--trust-remote-code")
    if cfg.device == "cuda":
        args += ["--gpu-memory-utilization", str(v.gpu_memory_utilization)]
        if v.enable_expert_parallel:
            args.append("--enable-expert-parallel")
    for key, value in v.engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            args.append(flag)
        elif value is not False and value is not None:
            args += [flag, value if isinstance(value, str) else json.dumps(value)]
    return args


def server_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """The engine settings of a served target, as keyword arguments of `VllmServer`, `measure_modes` and
    `serve_interleaved`: `server_args` plus the dtype, context length and environment it leaves aside."""
    return {"max_model_len": cfg.verifier.max_model_len, "dtype": cfg.verifier.dtype,
            "extra_args": server_args(cfg), "env": engine_env(cfg)}


def serve_flags(model: str, *, host: str, port: int, max_model_len: int, dtype: str,
                speculative_config: dict | None = None) -> list[str]:
    """`vllm serve` flags for one OpenAI server: what it serves, where it listens, how it speculates."""
    flags = [
        "--model", model,
        "--host", host,
        "--port", str(port),
        "--max-model-len", str(max_model_len),
        "--dtype", dtype,
        "--disable-uvicorn-access-log",
    ]
    if speculative_config is not None:
        flags += ["--speculative-config", json.dumps(speculative_config)]
    return flags


def eagle3_speculative_config(drafter_dir: str | os.PathLike, num_speculative_tokens: int) -> dict[str, Any]:
    """vLLM's `speculative_config` for speculating with the EAGLE-3 drafter folder `drafter_dir`, the same
    dict for the offline engine (`LLM`, `EngineArgs`) and for `vllm serve --speculative-config`."""
    return {"method": "eagle3", "model": str(drafter_dir), "num_speculative_tokens": num_speculative_tokens}


def eagle3_engine_kwargs(target: str, drafter: str, *, num_speculative_tokens: int,
                         engine_kwargs: dict[str, Any] | None = None, defaults: dict[str, Any] | None = None,
                         overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments of vLLM's `LLM` or `EngineArgs` for `target` speculating with the EAGLE-3 drafter
    folder `drafter`: `defaults`, then `engine_kwargs` (the run's `llm_kwargs` less the model), then
    `overrides` (settings a caller cannot do without)."""
    return {
        **(defaults or {}),
        **(engine_kwargs or {}),
        **(overrides or {}),
        "model": target,
        "speculative_config": eagle3_speculative_config(drafter, num_speculative_tokens),
    }


def capture_engine_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """`HiddenStateCapture` arguments (beyond model, layers and length) for the verifier in this config."""
    v = cfg.verifier
    extra = {"enable_expert_parallel": True} if v.enable_expert_parallel else {}
    if cfg.device == "cuda":
        extra["gpu_memory_utilization"] = v.gpu_memory_utilization
    return {"tensor_parallel_size": v.tensor_parallel_size, "dtype": v.dtype, "trust_remote_code": v.trust_remote_code,
            "extra_engine_args": {**extra, **v.engine_args}}
