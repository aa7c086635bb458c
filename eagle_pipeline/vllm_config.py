"""One engine configured by vLLM's own code, without loading a model: its `VllmConfig`, the model runner, and the
attention backend vLLM's selector returns for each kind of layer in it (the target's, the drafter's), with the
KV-cache block size they must share. On a machine without CUDA a config for CUDA is checked by CUDA's own selector
at the GPU host's capability (`CUDA_CAPABILITY`; how, and why: docs/engines.md, "The engine rehearsal"). vLLM is
imported inside the functions; eagle_pipeline.plan.rehearsal calls them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import sys
import types
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
from typing import Any, Iterator

from eagle_pipeline.drafter.layouts import MLA_ARCHITECTURE_ALIASES
from patches.upstream import require_unchanged_sources, require_version

# The compute capability of the pipeline's GPU host (RTX PRO 6000 Blackwell, SM120), used where CUDA's selection
# is checked on a machine without a GPU.
CUDA_CAPABILITY = (12, 0)
# Speculative methods whose drafter has attention layers of its own (n-gram and the hidden-state capture have none).
DRAFTER_METHODS = ("eagle", "eagle3", "mtp", "draft_model", "dflash")
_KERNELS_MODULE = "vllm._C_stable_libtorch"
# vLLM's private names this module (and drafter_checks/vllm_logits.py, which builds the model runner's attention
# metadata by hand) relies on, kept as patches/ keeps its patches (patches/README.md): the release they were written
# against, and the fingerprints of the upstream code they call, swap or imitate; tests/test_patches.py compares them.
TARGET_VLLM_VERSION = "0.32.0"
UPSTREAM_SOURCE_SHA256 = {
    # selection_platform swaps platforms._current_platform, which this resolves, and clears the selector's cache
    "vllm.platforms:__getattr__":
        "a34790aa76d58aad7000dd5131a8ad03d13915b7f58c980192ff6dbd442a150d",
    "vllm.v1.attention.selector:_cached_get_attn_backend":
        "61943e24c20e1a993a1340307f53ba465818f7dd067566c16e56ef78ecf204c5",
    "vllm.v1.spec_decode.llm_base_proposer:SpecDecodeBaseProposer._create_draft_vllm_config":
        "36a4d60a8f28e51a915be974e550583544e6cadea03c52ee1e1e670585bfef07",
    "vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features":
        "cb1a79994bd3ad5141367028b2024cd899d7ed5db3f9d09e0bc2bd73c59a0fd3",
    "vllm.platforms.interface:Platform._preferred_block_size_for_backends":
        "a01a5fa60d01b8f404fb7e038c51fb126a2c3593a91dd9cd827b762a3fce1dde",
    # what vllm_logits' attention cache builds as the model runner does
    "vllm.v1.worker.gpu_model_runner:GPUModelRunner._build_attention_metadata":
        "6015ffa2b3ec7cd3d6128492301635103cd9328ccab16cff126d987af1f4212c",
    "vllm.v1.attention.backend:CommonAttentionMetadata":
        "b83b991c7a22298b1ad9783fb92fbfb4aa43f0540690b0af7c5dbb7b546190f7",
}


@functools.cache
def require_written_for() -> None:
    """Refuse (one RuntimeError line naming this module's target release and the installed one, or the upstream
    functions that changed) to use vLLM's private names on a vLLM they were not written for."""
    import vllm

    recheck = "re-check the engine rehearsal and stage 05's vllm_logits check against it (docs/engines.md)"
    require_version("eagle_pipeline/vllm_config.py", "vLLM", vllm.__version__, TARGET_VLLM_VERSION, recheck)
    require_unchanged_sources(UPSTREAM_SOURCE_SHA256, "eagle_pipeline/vllm_config.py", f"vLLM {TARGET_VLLM_VERSION}")


@dataclass
class LayerBackend:
    """The backend vLLM selects for one kind of layer."""

    kind: str                 # "target" or "drafter"
    attention: str            # "MLA", "full attention", ...
    backend: str | None       # the backend's name; None when the selector refused
    requested: str | None     # the backend the config names for this kind (None: vLLM's own choice)
    kv_cache_dtype: str
    error: str | None = None  # the selector's refusal
    notes: list[str] = field(default_factory=list)


@dataclass
class EngineCheck:
    """What vLLM made of one engine's settings."""

    platform: str
    runner: str | None = None
    block_size: int | None = None
    layers: list[LayerBackend] = field(default_factory=list)
    error: str | None = None  # vLLM refused the settings themselves (create_engine_config or the block size)

    @property
    def ok(self) -> bool:
        return self.error is None and all(layer.error is None for layer in self.layers)


@contextlib.contextmanager
def quiet_vllm() -> Iterator[None]:
    """vLLM's own log lines held back (a dry run prints one line per engine), and the environment variables that
    configuring an engine sets in this process (vLLM's platforms set some) put back afterwards."""
    saved_env = dict(os.environ)
    logger = logging.getLogger("vllm")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
        os.environ.clear()
        os.environ.update(saved_env)


def short_error(error: BaseException) -> str:
    """vLLM's refusal in one line: pydantic's wrapping (model name, input dump, help link) taken off."""
    text = " ".join(str(error).split())
    match = re.search(r"Value error, (.*?)(?: \[type=|$)", text)
    text = match.group(1) if match else f"{type(error).__name__}: {text}"
    return text if len(text) <= 400 else text[:397] + "..."


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


@contextlib.contextmanager
def selection_platform(device: str) -> Iterator[tuple[Any, str]]:
    """(platform, description) whose attention selector answers for `device`: the running platform when it is
    that device's, else CUDA's selector at `CUDA_CAPABILITY`; vLLM's current platform is put back afterwards."""
    import vllm.platforms as platforms

    require_written_for()
    current = platforms.current_platform
    if device != "cuda" or cuda_available():
        capability = current.get_device_capability() if device == "cuda" else None
        where = f"{current.device_name}" + (f" sm_{capability.major}{capability.minor}" if capability else "")
        yield current, where
        return
    added_stand_in = _KERNELS_MODULE not in sys.modules
    if added_stand_in:
        sys.modules[_KERNELS_MODULE] = types.ModuleType(_KERNELS_MODULE)
    try:
        from vllm.platforms import cuda
        from vllm.platforms.interface import DeviceCapability
    finally:
        if added_stand_in:
            sys.modules.pop(_KERNELS_MODULE, None)

    class HostCuda(cuda.NonNvmlCudaPlatform):
        @classmethod
        def get_device_capability(cls, device_id: int = 0):
            return DeviceCapability(*CUDA_CAPABILITY)

    simulated = HostCuda()
    platforms._current_platform = simulated
    _clear_selector_cache()
    try:
        yield simulated, f"cuda sm_{CUDA_CAPABILITY[0]}{CUDA_CAPABILITY[1]} (CUDA's selector, checked without a GPU)"
    finally:
        platforms._current_platform = current
        _clear_selector_cache()


def _clear_selector_cache() -> None:
    from vllm.v1.attention.selector import _cached_get_attn_backend

    _cached_get_attn_backend.cache_clear()


def create_config(engine_args: dict[str, Any] | None = None, server_argv: list[str] | None = None):
    """vLLM's `VllmConfig` for an offline engine's keyword arguments, or for a `vllm serve` command line parsed by
    vLLM's own server parser."""
    if server_argv is None:
        from vllm.engine.arg_utils import EngineArgs

        return EngineArgs(**(engine_args or {})).create_engine_config()
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(exit_on_error=False))
    try:
        args = parser.parse_args(server_argv)
    except SystemExit as error:  # argparse reports a bad flag by exiting
        raise ValueError(f"vllm serve refuses the command line (argparse exit {error.code})") from None
    validate_parsed_serve_args(args)
    return AsyncEngineArgs.from_cli_args(args).create_engine_config()


def requested_schedule(engine_args: dict[str, Any] | None, server_argv: list[str] | None) -> Any:
    """The `num_speculative_tokens_per_batch_size` an engine's settings ask for (None where they ask for none)."""
    spec = (engine_args or {}).get("speculative_config")
    if server_argv is not None and "--speculative-config" in server_argv:
        spec = json.loads(server_argv[server_argv.index("--speculative-config") + 1])
    return (spec or {}).get("num_speculative_tokens_per_batch_size") if isinstance(spec, dict) else None


def schedule_problem(vllm_config, requested: Any) -> str | None:
    """Why vLLM would not run the speculation schedule `requested` (None when it would, or none is asked for): the
    scheduler's own expansion of it, and vLLM dropping it under data parallelism (docs/engines.md, "Speculation
    per batch size")."""
    if requested is None:
        return None
    spec = vllm_config.speculative_config
    if spec is None or spec.num_speculative_tokens_per_batch_size is None:
        return (f"vLLM drops num_speculative_tokens_per_batch_size {requested} with data parallelism "
                f"{vllm_config.parallel_config.data_parallel_size} and speculates with num_speculative_tokens at "
                f"every batch size; serve without data parallelism or without the schedule")
    from vllm.v1.spec_decode.dynamic.utils import build_dynamic_sd_schedule_lookup

    try:
        build_dynamic_sd_schedule_lookup(spec.num_speculative_tokens_per_batch_size,
                                         vllm_max_batch_size=vllm_config.scheduler_config.max_num_seqs,
                                         vllm_num_speculative_tokens=spec.num_speculative_tokens)
    except ValueError as error:
        return f"num_speculative_tokens_per_batch_size {requested}: {short_error(error)}"
    return None


def model_runner(vllm_config, simulated: bool) -> str:
    """"V2" or "V1": vLLM's own decision; where CUDA is simulated, the one the GPU host makes (Triton present)."""
    if not simulated:
        return "V2" if vllm_config.use_v2_model_runner else "V1"
    import vllm.envs as envs

    if envs.VLLM_USE_V2_MODEL_RUNNER is not None:
        return "V2" if envs.VLLM_USE_V2_MODEL_RUNNER else "V1"
    return "V1" if vllm_config._get_v2_model_runner_unsupported_features() else "V2"


def draft_vllm_config(vllm_config, runner: str):
    """The config vLLM builds the drafter under: V2 overlays only the drafter settings that are set (an unset
    drafter backend inherits the target's); V1 chooses the drafter's backend afresh unless one is set."""
    require_written_for()
    spec = vllm_config.speculative_config
    if runner == "V2":
        config = spec.apply_draft_overrides(vllm_config)
    else:
        from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

        config = SpecDecodeBaseProposer._create_draft_vllm_config(SimpleNamespace(speculative_config=spec,
                                                                                   vllm_config=vllm_config))
    if spec.method == "dflash":  # a backend with non-causal attention for a bidirectional block (DFlashProposer's)
        from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal

        non_causal = dflash_has_any_non_causal(spec.draft_model_config.hf_config)
        config = replace(config, attention_config=replace(config.attention_config, use_non_causal=non_causal))
    return config


def builds_mla_drafter(model_config) -> bool:
    """vLLM's EAGLE-3 MLA drafter (deepseek_eagle3.py) builds MLA attention layers, though its ModelConfig (the
    EAGLE wrapper, model_type eagle) reports no MLA; its layers select their backend as MLA layers."""
    architectures = getattr(model_config, "architectures", None) or []
    return (any(name in MLA_ARCHITECTURE_ALIASES for name in architectures)
            and getattr(model_config.hf_text_config, "kv_lora_rank", None) is not None)


def _layer_args(model_config, parallel_config) -> tuple[str, dict[str, Any]]:
    """The selector arguments vLLM's attention layers pass for this model's decoder layers."""
    num_heads = model_config.get_num_attention_heads(parallel_config)
    if model_config.use_mla or builds_mla_drafter(model_config):
        text = model_config.hf_text_config
        return "MLA", {"head_size": int(text.kv_lora_rank) + int(text.qk_rope_head_dim), "use_mla": True,
                       "num_heads": num_heads}
    sliding = model_config.get_sliding_window() is not None
    return ("sliding-window attention" if sliding else "full attention"), {
        "head_size": model_config.get_head_size(), "num_heads": num_heads, "has_sliding_window": sliding}


def _select(kind: str, vllm_config, model_config, parallel_config) -> tuple[LayerBackend, Any]:
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    attention, args = _layer_args(model_config, parallel_config)
    kv_cache_dtype = vllm_config.cache_config.cache_dtype
    requested = vllm_config.attention_config.backend
    layer = LayerBackend(kind=kind, attention=attention, backend=None,
                         requested=requested.name if requested is not None else None,
                         kv_cache_dtype=str(kv_cache_dtype))
    try:
        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(dtype=model_config.dtype, kv_cache_dtype=kv_cache_dtype, **args)
    except (ValueError, ImportError, OSError) as error:
        layer.error = short_error(error)
        if "ModuleNotFoundError" in layer.error or "ImportError" in layer.error:
            layer.notes.append("the backend's package is not installed on this machine, so it cannot be checked here")
        return layer, None
    layer.backend = backend.get_name()
    return layer, backend


def check_engine(device: str, engine_args: dict[str, Any] | None = None, server_argv: list[str] | None = None,
                 env: dict[str, str] | None = None, kv_cache: bool = True) -> EngineCheck:
    """vLLM's configuration of one engine and the backends it selects, for a run on `device`; `kv_cache`: whether
    the engine allocates a KV cache, whose block size every backend must share (the load check builds the drafter
    alone and allocates none)."""
    from vllm.config.cache import CacheConfig
    from vllm.v1.worker.utils import select_common_block_size

    with quiet_vllm():  # which puts the environment back: the engine's own (model runner, logging) is set for vLLM
        os.environ.update(env or {})
        try:
            vllm_config = create_config(engine_args, server_argv)
        except Exception as error:  # noqa: BLE001 - vLLM's refusal of the settings is the finding
            return EngineCheck(platform=device, error=short_error(error))
        problem = schedule_problem(vllm_config, requested_schedule(engine_args, server_argv))
        if problem is not None:
            return EngineCheck(platform=device, error=problem)
        with selection_platform(device) as (platform, where):
            simulated = platform.__class__.__name__ == "HostCuda"
            check = EngineCheck(platform=where, runner=model_runner(vllm_config, simulated))
            target, target_backend = _select("target", vllm_config, vllm_config.model_config,
                                             vllm_config.parallel_config)
            check.layers.append(target)
            backends = [target_backend]
            spec = vllm_config.speculative_config
            if spec is not None and spec.method in DRAFTER_METHODS and spec.draft_model_config is not None:
                draft_config = draft_vllm_config(vllm_config, check.runner)
                drafter, drafter_backend = _select("drafter", draft_config, spec.draft_model_config,
                                                   spec.draft_parallel_config or vllm_config.parallel_config)
                check.layers.append(drafter)
                backends.append(drafter_backend)
            if kv_cache and all(b is not None for b in backends):
                cache = vllm_config.cache_config
                try:
                    if device == "cuda" and not cache.user_specified_block_size:
                        manager = platform._preferred_block_size_for_backends(backends, CacheConfig.DEFAULT_BLOCK_SIZE,
                                                                              vllm_config)
                    else:  # the CPU platform settled the size while it configured the engine
                        manager = cache.block_size
                    check.block_size = select_common_block_size(manager, backends)
                except ValueError as error:
                    check.error = short_error(error)
    return check
