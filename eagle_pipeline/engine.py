"""Arguments for vLLM's offline engine and server, from the run config (CPU or GPU alike)."""

from __future__ import annotations

import json
import os
from typing import Any

from eagle_pipeline.config import RunConfig


def engine_env(cfg: RunConfig) -> dict[str, str]:
    """Environment for a vLLM process: no hub access, and the CPU KV cache size on the CPU backend."""
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING")}
    if cfg.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.verifier.cpu_kvcache_gib)
    return env


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
