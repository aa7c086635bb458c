"""The `vllm_load` check, and vLLM's view of a drafter's config for the `config` check.

vLLM's own config path (`EngineArgs.create_engine_config`, which builds the draft ModelConfig and wraps
it in EAGLEConfig) resolves the drafter; then vLLM's `Eagle3LlamaForCausalLM` is built on the CPU and its
real `load_weights` is given every tensor of the checkpoint: parameters left at a sentinel value
afterwards were not loaded. `vllm_inspect` does this in the calling process; `check_vllm` runs it in a
fresh subprocess (see `cli`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from eagle_pipeline.drafter.layouts import NORM_FLAGS, weight_files
from eagle_pipeline.drafter_checks.subprocess_json import SUBPROCESS_TIMEOUT_S, run_json_subprocess
from eagle_pipeline.engine import eagle3_engine_kwargs
from eagle_pipeline.serve.server import find_free_port
from eagle_pipeline.vllm_config import draft_vllm_config, model_runner

# Parameters vLLM's EAGLE proposer replaces with the target's after loading, so a drafter may omit them.
SHARED_FROM_TARGET = ("model.embed_tokens.weight",)


def load_check_engine_kwargs(target_dir: str, drafter_dir: str, engine_kwargs: dict[str, Any] | None = None,
                             drafter_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """`EngineArgs` of the load check: the run's engine with the drafter, computed as stage 06 serves it."""
    return eagle3_engine_kwargs(target_dir, drafter_dir, num_speculative_tokens=1, engine_kwargs=engine_kwargs,
                                defaults={"max_model_len": 512, "enforce_eager": True},
                                # the load check builds the drafter in this one process
                                overrides={"tensor_parallel_size": 1}, drafter_settings=drafter_settings)


def build_vllm_config(target_dir: str, drafter_dir: str, engine_kwargs: dict[str, Any] | None = None,
                      drafter_settings: dict[str, Any] | None = None):
    """The VllmConfig `LLM(target, speculative_config={"method": "eagle3", "model": drafter, ...})` would use."""
    from vllm.engine.arg_utils import EngineArgs

    return EngineArgs(**load_check_engine_kwargs(target_dir, drafter_dir, engine_kwargs,
                                                 drafter_settings)).create_engine_config()


def vllm_aux_layer_ids(spec) -> dict[str, list[int] | None]:
    """The aux layer ids each of vLLM's model runners takes from the draft config (None: its defaults).

    The two runners read the config differently (V1: top level, then eagle_config; V2, the default
    where Triton is present: top level, then eagle_config["layer_ids"]), so both are asked.
    """
    from types import SimpleNamespace

    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec))
    v2 = get_eagle3_aux_layers_from_config(spec)
    return {"model_runner_v1": list(v1) if v1 else None, "model_runner_v2": list(v2) if v2 else None}


def vllm_config_view(vllm_config) -> dict[str, Any]:
    from vllm.model_executor.model_loader.utils import get_model_architecture

    spec = vllm_config.speculative_config
    hf = spec.draft_model_config.hf_config
    model_class, _ = get_model_architecture(spec.draft_model_config)
    return {
        "hf_config_class": type(hf).__name__,
        "architectures": list(getattr(hf, "architectures", []) or []),
        "model_class": model_class.__name__,
        "vocab_size": getattr(hf, "vocab_size", None),
        "draft_vocab_size": getattr(hf, "draft_vocab_size", None),
        "aux_layer_ids": vllm_aux_layer_ids(spec),
        "norm_flags": {name: bool(getattr(hf, name, False)) for name in NORM_FLAGS},
        "head_dim": getattr(hf, "head_dim", None),
    }


def build_drafter(vllm_config, *, sentinel: bool = False):
    """vLLM's drafter class built on the CPU under the settings vLLM builds it with (its own attention backend and
    KV-cache dtype, not the target's: on CUDA an MLA target's backend refuses a Llama drafter's layers), from
    `drafter_build_config`'s config and under `set_current_vllm_config` of it. With `sentinel`, every parameter
    starts at NaN (-1 for the integer d2t buffer, whose offsets are never negative)."""
    import torch
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.parallel_state import model_parallel_is_initialized
    from vllm.model_executor.model_loader.utils import get_model_architecture

    if not model_parallel_is_initialized():
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{find_free_port()}")
        ensure_model_parallel_initialized(1, 1)
    model_class, _ = get_model_architecture(vllm_config.speculative_config.draft_model_config)
    with torch.device("cpu"):
        model = model_class(vllm_config=vllm_config)
    if sentinel:
        with torch.no_grad():
            for param in model.parameters():
                param.fill_(float("nan") if param.is_floating_point() else -1)
    return model


def drafter_tensors(drafter_dir: str | Path):
    """(name, tensor) for every tensor of a drafter folder, in name order: what vLLM's loader is fed."""
    from safetensors import safe_open

    for name, path in sorted(weight_files(Path(drafter_dir)).items()):
        with safe_open(path, framework="pt") as f:
            yield name, f.get_tensor(name)


def drafter_build_config(vllm_config):
    """The config vLLM builds the drafter under (`vllm_config_check.draft_vllm_config`)."""
    return draft_vllm_config(vllm_config, model_runner(vllm_config, simulated=False))


def vllm_load_weights(vllm_config, drafter_dir: str) -> dict[str, Any]:
    """Build vLLM's drafter class and feed its real load_weights every tensor of the checkpoint.

    Every parameter starts at a sentinel; a parameter that still holds it, wholly or in part (one shard of a
    fused q/k/v), was not loaded.
    """
    import torch
    from vllm.config import set_current_vllm_config

    spec = vllm_config.speculative_config
    draft_config = drafter_build_config(vllm_config)
    with set_current_vllm_config(draft_config):
        model = build_drafter(draft_config, sentinel=True)
        try:
            model.load_weights(drafter_tensors(drafter_dir))
        except Exception as error:  # vLLM's refusal is the finding
            return {"ok": False, "model_class": type(model).__name__,
                    "error": f"{type(error).__name__}: {error}"}

    shared = set(SHARED_FROM_TARGET)
    if spec.draft_model_config.hf_config.draft_vocab_size == vllm_config.model_config.get_vocab_size():
        shared.add("lm_head.weight")  # a full-vocabulary drafter may use the target's lm_head
    unloaded = []
    for name, param in model.named_parameters():
        if name in shared or unused_in_forward(name):
            continue
        untouched = torch.isnan(param) if param.is_floating_point() else param == -1
        if bool(untouched.any()):
            part = "" if bool(untouched.all()) else f" ({int(untouched.sum())} of {param.numel()} values)"
            unloaded.append(name + part)
    return {"ok": not unloaded, "model_class": type(model).__name__, "unloaded_parameters": unloaded,
            "has_own_lm_head": bool(getattr(model, "has_own_lm_head", False)),
            "has_own_embed_tokens": bool(getattr(model, "has_own_embed_tokens", False))}


def unused_in_forward(name: str) -> bool:
    """vLLM creates a hidden_norm in every draft layer but only the first one applies it; its DFlash drafter a
    mask_embedding that only a separate mask-embedding file fills (the target's embedding row serves otherwise)."""
    match = re.fullmatch(r"model\.layers\.(\d+)\.hidden_norm\.weight", name)
    return bool(match) and int(match.group(1)) > 0 or name == "model.mask_embedding"


def vllm_inspect(target_dir: str, drafter_dir: str, engine_kwargs: dict[str, Any] | None = None,
                 drafter_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """vLLM's config view and load result for a drafter, in this process (call through a subprocess)."""
    try:
        vllm_config = build_vllm_config(target_dir, drafter_dir, engine_kwargs, drafter_settings)
        view = vllm_config_view(vllm_config)
    except Exception as error:
        message = f"{type(error).__name__}: {error}"
        return {"config": {"error": message},
                "load": {"ok": False, "error": f"not attempted, vLLM's config loader failed: {message}"}}
    return {"config": view, "load": vllm_load_weights(vllm_config, drafter_dir)}


def check_vllm(drafter_dir: str | Path, target_dir: str | Path, *, engine_kwargs: dict[str, Any] | None = None,
               drafter_settings: dict[str, Any] | None = None, env: dict[str, str] | None = None,
               timeout_s: float = SUBPROCESS_TIMEOUT_S, log_dir: str | Path | None = None,
               logits_files: tuple[Path, Path] | None = None) -> dict[str, Any]:
    """vLLM's view of the config and its load_weights result, from a fresh subprocess (its output in
    `log_dir`/vllm-load.log when given); with `logits_files`, vLLM's side of the vllm_logits check too."""
    args = ["inspect", "--target", str(target_dir), "--drafter", str(drafter_dir),
            "--engine-kwargs", json.dumps(engine_kwargs or {}),
            "--drafter-settings", json.dumps(drafter_settings or {})]
    if logits_files is not None:
        args += ["--logits-inputs", str(logits_files[0]), "--logits-out", str(logits_files[1])]
    log_path = Path(log_dir) / "vllm-load.log" if log_dir is not None else None
    try:
        return run_json_subprocess(args, env, timeout=timeout_s, log_path=log_path)
    except RuntimeError as error:
        message = str(error)
        return {"config": {"error": message}, "load": {"ok": False, "error": message},
                "logits": {"error": message}}
