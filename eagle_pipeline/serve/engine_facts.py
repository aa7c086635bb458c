"""How vLLM computed a served run, read from the server's own log: what an engine verdict names as suspects. Which
lines vLLM 0.32 logs and where: docs/engines.md, "The SM120 trap". What the log does not say is reported as not
logged, beside what the config asked for.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from eagle_pipeline.config import RunConfig
from eagle_pipeline.config.serving import ENGINE_VARIANT_KEYS
from eagle_pipeline.engine import MODEL_RUNNER_VARIABLE

_INIT = re.compile(r"Initializing a V1 LLM engine \((?P<version>[^)]*)\) with config: (?P<config>.*)$")
_BACKEND = re.compile(r"Using (?:AttentionBackendEnum\.)?(?P<name>[A-Z][A-Z0-9_]*) "
                      r"(?:attention )?backend(?: out of|\.)")
_V1_FALLBACK = re.compile(r"(?P<why>Model Runner V2 (?:requires|does not yet support)[^;]*); using the V1 model runner")
_FIELDS = {
    "quantization": re.compile(r"\bquantization=([^,]+),"),
    "kv_cache_dtype": re.compile(r"\bkv_cache_dtype=([^,]+),"),
    "enforce_eager": re.compile(r"\benforce_eager=(True|False)\b"),
    "dtype": re.compile(r"\bdtype=([^,]+),"),
    "device": re.compile(r"\bdevice_config=([^,]+),"),
    "compilation_mode": re.compile(r"'mode': <CompilationMode\.(\w+)"),
    "cudagraph_mode": re.compile(r"'cudagraph_mode': <CUDAGraphMode\.(\w+)"),
}


LOG_LEVEL_VARIABLE = "VLLM_LOGGING_LEVEL"


def server_env(cfg: RunConfig, env: Mapping[str, str]) -> dict[str, str]:
    """A stage-06 server's environment: INFO logging into its log file (where the facts come from), unless the
    config sets the level itself (verifier.log_level, or the variable in its env)."""
    if cfg.verifier.log_level or LOG_LEVEL_VARIABLE in cfg.env:
        return dict(env)
    return {**env, LOG_LEVEL_VARIABLE: "INFO"}


def declared_settings(cfg: RunConfig) -> dict[str, Any]:
    """The engine keys (config.serving.ENGINE_VARIANT_KEYS) as the config sets them (None: vLLM's own choice)."""
    declared: dict[str, Any] = {}
    for key in ENGINE_VARIANT_KEYS:
        if key == "env":
            declared[key] = dict(cfg.env)
        else:
            section, field = key.split(".")
            declared[key] = getattr(getattr(cfg, section), field)
    return declared


def read_engine_facts(log_path: str | Path, declared: Mapping[str, Any]) -> dict[str, Any]:
    """The settings the server at `log_path` ran with, as vLLM logged them, and a one-line `summary`."""
    try:
        lines = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        lines = []
    # A log folder outlives --force: the file holds every start, each headed by its command (VllmServer.start).
    starts = [i for i, line in enumerate(lines) if line.startswith("$ ")]
    lines = lines[starts[-1]:] if starts else lines
    facts: dict[str, Any] = {"log": str(log_path), "declared": dict(declared)}
    backends: list[str] = []
    for line in lines:
        init = _INIT.search(line)
        if init and "vllm_version" not in facts:
            facts["vllm_version"] = init["version"]
            for key, pattern in _FIELDS.items():
                found = pattern.search(init["config"])
                if found:
                    facts[key] = found.group(1).strip("'")
        backend = _BACKEND.search(line)
        if backend:
            backends.append(backend["name"])
        fallback = _V1_FALLBACK.search(line)
        if fallback and "model_runner" not in facts:
            facts["model_runner"] = "V1"
            facts["model_runner_reason"] = fallback["why"]
    facts["attention_backends_logged"] = backends
    if backends:
        facts["target_attention_backend"] = backends[0]
        facts["drafter_attention_backend"] = backends[1] if len(backends) > 1 else None
    if "model_runner" not in facts:
        runner = (declared.get("env") or {}).get(MODEL_RUNNER_VARIABLE)
        asked = declared.get("verifier.model_runner")
        if runner is not None or asked in ("v1", "v2"):
            facts["model_runner"] = "V1" if runner == "0" or asked == "v1" else "V2"
            facts["model_runner_reason"] = "as the config asks"
        elif facts.get("device") not in (None, "cpu"):
            facts["model_runner"] = "V2"
            facts["model_runner_reason"] = "vLLM's default with Triton; no fall-back logged"
    facts["summary"] = summarize(facts)
    return facts


def summarize(facts: Mapping[str, Any]) -> str:
    """The facts as a verdict names them: each setting as logged, else as declared."""
    declared = facts.get("declared") or {}

    def pick(logged_key: str, declared_key: str | None, default: str = "vLLM's choice, not logged") -> str:
        if facts.get(logged_key) is not None:
            return str(facts[logged_key])
        asked = declared.get(declared_key) if declared_key else None
        return f"{asked} (declared; not logged)" if asked is not None else default

    target = pick("target_attention_backend", "verifier.attention_backend")
    drafter = pick("drafter_attention_backend", "serve.drafter_attention_backend",
                   "not logged apart from the target's" if facts.get("target_attention_backend") else
                   "vLLM's choice, not logged")
    kv = pick("kv_cache_dtype", "verifier.kv_cache_dtype")
    drafter_kv = declared.get("serve.drafter_kv_cache_dtype") or "the target's"
    runner = facts.get("model_runner") or "not logged"
    if facts.get("enforce_eager") == "True":
        graphs = "CUDA graphs and torch.compile off (enforce_eager)"
    elif facts.get("enforce_eager") == "False":
        graphs = (f"torch.compile {facts.get('compilation_mode', '?')}, CUDA graphs "
                  f"{facts.get('cudagraph_mode', '?')}")
    else:
        graphs = f"enforce_eager {declared.get('verifier.enforce_eager')} (declared; not logged)"
    quantization = facts.get("quantization", "not logged")
    env = declared.get("env") or {}
    return (f"target attention backend {target}, drafter attention backend {drafter}, KV-cache dtype {kv} "
            f"(drafter: {drafter_kv}), model runner {runner}, {graphs}, quantization {quantization}"
            + (f", env {', '.join(f'{k}={v}' for k, v in env.items())}" if env else ""))
