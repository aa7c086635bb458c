"""The one place that turns the run config into vLLM's arguments and environment (offline engine, server,
EAGLE-3 drafter, hidden-state capture), the same on CPU and GPU hosts."""

from __future__ import annotations

import json
import os
from typing import Any

from eagle_pipeline.config import RunConfig
from eagle_pipeline.drafter.folder import is_dflash_drafter
from eagle_pipeline.fingerprint import value_fingerprint

# vLLM's switch between its model runners; unset leaves vLLM's own choice (V2 on GPUs with Triton).
MODEL_RUNNER_VARIABLE = "VLLM_USE_V2_MODEL_RUNNER"
# vLLM's switch between an offline engine in the calling process ("0") and engine-core/worker processes ("1").
MULTIPROCESSING_VARIABLE = "VLLM_ENABLE_V1_MULTIPROCESSING"


def log_level(cfg: RunConfig) -> str:
    """vLLM's log level: the config's, else INFO on a GPU host, where a cold start of tens of minutes should
    say what it does (load time, KV-cache memory, the model runner and attention backends it chose)."""
    return cfg.verifier.log_level or ("INFO" if cfg.device == "cuda" else "WARNING")


def engine_env(cfg: RunConfig) -> dict[str, str]:
    """Environment for every vLLM process of the run: no hub access, the CPU KV cache size on the CPU backend,
    the model runner and log level the config asks for, and the config's own `env` last (it wins)."""
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "VLLM_LOGGING_LEVEL": log_level(cfg)}
    if cfg.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.verifier.cpu_kvcache_gib)
    if cfg.verifier.model_runner != "auto":
        env[MODEL_RUNNER_VARIABLE] = "1" if cfg.verifier.model_runner == "v2" else "0"
    return {**env, **cfg.env}


def in_process_engine(cfg: RunConfig) -> bool:
    """Whether an offline engine (stage 01's answers, stage 02's and the replay's capture) runs in the stage's own
    process: on a CPU host without tensor parallelism (why: docs/engines.md, "Engine processes")."""
    return cfg.device == "cpu" and cfg.verifier.tensor_parallel_size == 1


def offline_engine_env(cfg: RunConfig) -> dict[str, str]:
    """`engine_env` for an offline engine this process starts (`in_process_engine` added)."""
    env = engine_env(cfg)
    if in_process_engine(cfg):
        env = {MULTIPROCESSING_VARIABLE: "0", **env}  # the config's own env still wins
    return env


def apply_engine_env(cfg: RunConfig) -> None:
    """`offline_engine_env` in this process, for an offline engine it starts; a variable the caller set wins,
    except the config's own `env`, which is the run's."""
    for key, value in offline_engine_env(cfg).items():
        if key in cfg.env:
            os.environ[key] = value
        else:
            os.environ.setdefault(key, value)


def offline_engine(**kwargs: Any):
    """`vllm.LLM(**kwargs)`, in this process or with engine processes as the environment says; in this process the
    CPU worker's kernel scan is patched first to pass the modules vLLM's Kimi-K2.5 model class loads
    (patches/vllm_kernel_rebind.py), its rotary embedding to rotate an MLA query's every head at its position
    (patches/vllm_cpu_rope.py), and, for an engine that speculates, its rejection sampler to sample at temperature
    > 0 from the target's own distribution (patches/vllm_cpu_expand.py; greedy batches never reach it)."""
    from vllm import LLM

    if os.environ.get(MULTIPROCESSING_VARIABLE) == "0":
        from patches import vllm_cpu_rope, vllm_kernel_rebind

        vllm_kernel_rebind.apply()
        vllm_cpu_rope.apply()
        if kwargs.get("speculative_config"):
            from patches import vllm_cpu_expand

            vllm_cpu_expand.apply()
    return LLM(**kwargs)


def target_engine_settings(cfg: RunConfig) -> dict[str, Any]:
    """How vLLM computes the target: the config's engine keys as engine arguments (unset ones left out)."""
    v = cfg.verifier
    settings: dict[str, Any] = {"kv_cache_dtype": v.kv_cache_dtype, "enforce_eager": v.enforce_eager}
    if v.attention_backend is not None:
        settings["attention_backend"] = v.attention_backend
    return settings


def target_engine_fingerprint(cfg: RunConfig, dtype: str | None) -> str:
    """How the target's numbers are computed, as one stage input (`engine`): the dtype (stage 01's generation
    dtype; verifier.dtype for stage 02 and the online capture servers), the engine settings and the extra engine
    arguments. A change to any of them recomputes what the target wrote."""
    return value_fingerprint([dtype, target_engine_settings(cfg), cfg.verifier.engine_args])


def drafter_engine_settings(cfg: RunConfig) -> dict[str, Any]:
    """How vLLM computes the drafter: `speculative_config` fields from serve.drafter_* (unset ones left out,
    so vLLM applies its own defaults, the target's KV-cache dtype among them)."""
    s = cfg.serve
    settings: dict[str, Any] = {}
    if s.drafter_attention_backend is not None:
        settings["attention_backend"] = s.drafter_attention_backend
    if s.drafter_kv_cache_dtype is not None:
        settings["kv_cache_dtype"] = s.drafter_kv_cache_dtype
    return settings


def llm_kwargs(cfg: RunConfig, model: str, max_model_len: int | None = None,
               dtype: str | None = None) -> dict[str, Any]:
    """vLLM's offline-engine arguments for the target: the verifier section, with `dtype` (stage 01's
    generation.dtype) in place of verifier.dtype when given."""
    v = cfg.verifier
    kwargs: dict[str, Any] = {
        "model": model,
        "dtype": dtype or v.dtype,
        "max_model_len": max_model_len or v.max_model_len,
        "tensor_parallel_size": v.tensor_parallel_size,
        "seed": cfg.seed,
        "trust_remote_code": v.trust_remote_code,
        **target_engine_settings(cfg),
    }
    if cfg.device == "cuda":
        kwargs["gpu_memory_utilization"] = v.gpu_memory_utilization
        kwargs["enable_expert_parallel"] = v.enable_expert_parallel
    kwargs.update(v.engine_args)
    return kwargs


def server_args(cfg: RunConfig) -> list[str]:
    """The same engine settings as `llm_kwargs`, as `vllm serve` flags (model, dtype and max_model_len aside):
    `key_name: value` -> `--key-name value`, a true flag alone."""
    args: list[str] = []
    for key, value in llm_kwargs(cfg, "").items():
        flag = "--" + key.replace("_", "-")
        if key in ("model", "dtype", "max_model_len"):  # config keys own them: engine_args never holds one
            continue
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


def drafter_speculative_config(drafter_dir: str | os.PathLike, num_speculative_tokens: int,
                               drafter_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's `speculative_config` for speculating with the drafter folder `drafter_dir` (method eagle3, or dflash
    for a DFlash drafter), the same dict for the offline engine (`LLM`, `EngineArgs`) and for `vllm serve
    --speculative-config`; `drafter_settings` (`drafter_engine_settings`) say how vLLM computes the drafter."""
    return {"method": speculative_method(drafter_dir), "model": str(drafter_dir),
            "num_speculative_tokens": num_speculative_tokens, **(drafter_settings or {})}


def speculative_method(drafter_dir: str | os.PathLike) -> str:
    """vLLM's method for a drafter folder, which also names its stage-06 mode: dflash for a DFlash drafter, eagle3
    for any other."""
    return "dflash" if is_dflash_drafter(drafter_dir) else "eagle3"


def eagle3_engine_kwargs(target: str, drafter: str, *, num_speculative_tokens: int,
                         engine_kwargs: dict[str, Any] | None = None, defaults: dict[str, Any] | None = None,
                         overrides: dict[str, Any] | None = None,
                         drafter_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """Keyword arguments of vLLM's `LLM` or `EngineArgs` for `target` speculating with the EAGLE-3 drafter
    folder `drafter`: `defaults`, then `engine_kwargs` (the run's `llm_kwargs` less the model), then
    `overrides` (settings a caller cannot do without)."""
    return {
        **(defaults or {}),
        **(engine_kwargs or {}),
        **(overrides or {}),
        "model": target,
        "speculative_config": drafter_speculative_config(drafter, num_speculative_tokens, drafter_settings),
    }


def capture_engine_kwargs(cfg: RunConfig) -> dict[str, Any]:
    """`HiddenStateCapture` arguments (beyond model, layers and length) for the verifier in this config; eager on CUDA,
    whose graphs a capture's prefills hardly meet (docs/engines.md, "Hidden-state capture through vLLM")."""
    v = cfg.verifier
    extra: dict[str, Any] = {"enable_expert_parallel": True} if v.enable_expert_parallel else {}
    if cfg.device == "cuda":
        extra.update(gpu_memory_utilization=v.gpu_memory_utilization, enforce_eager=True)
    return {"tensor_parallel_size": v.tensor_parallel_size, "dtype": v.dtype, "trust_remote_code": v.trust_remote_code,
            "extra_engine_args": {**target_engine_settings(cfg), **extra, **v.engine_args}}
