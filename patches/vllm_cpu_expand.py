"""Sampling at temperature > 0 under a speculative method on vLLM's CPU build. Targets vLLM 0.32.0.

The rejection sampler expands each request's temperature, top_p and top_k to one value per verified token
(v1/sample/rejection_sampler.py `expand_batch_to_tokens`: `x.new_empty(num_tokens)`, then `expand_kernel`). The CPU
build's stand-in for that Triton kernel (utils/cpu_triton_utils.py `_expand_kernel_impl`) hands the C++ op
`_ensure_int64(output)`: for a float32 temperature or top_p, or an int32 top_k, a converted copy, written and dropped.
The expanded values stay uninitialised memory, the logits are divided by it, and every sampled token of a
speculating engine comes from a corrupted distribution (one pass answered "TimeTimeTime..." at temperature 0.6).
Greedy batches never reach the kernel.

`apply()` gives `_expand_kernel_impl` the Triton kernel's semantics in torch, for every dtype. The CPU worker binds
the stand-ins when it starts (platforms/cpu.py `register_triton_kernel_overrides`), so
`eagle_pipeline.engine.offline_engine` applies it before an in-process engine that speculates starts.
"""

from __future__ import annotations

import vllm

from patches.upstream import require_unchanged_sources, require_version

TARGET_VLLM_VERSION = "0.32.0"

require_version("patches/vllm_cpu_expand.py", "vLLM", vllm.__version__, TARGET_VLLM_VERSION,
                "check whether the CPU stand-in of expand_kernel writes its output now, and drop or update the patch")

from vllm.utils import cpu_triton_utils  # noqa: E402

UPSTREAM_SOURCE_SHA256: dict[str, str] = {
    "vllm.utils.cpu_triton_utils:_expand_kernel_impl":
        "b0d7df291932f1c3d0818bcba211d3c9b2a701de070dc888ff659948763e9559",
    "vllm.v1.sample.rejection_sampler:expand_batch_to_tokens":
        "ef896c2fe058ae7033bbb8916d1917c91e5f3724a66adf5a7e168e544449384d",
}


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """output[cu[i-1]:cu[i]] = input_val[i], replace_from read as replace_to (rejection_sampler.expand_kernel)."""
    import torch

    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    ends = cu_num_tokens.to(torch.long)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    output[: int(ends[-1]) if len(ends) else 0].copy_(torch.repeat_interleave(values, counts))


def apply() -> None:
    """Idempotent. Raises if the stand-in or its caller is not the one this was written for."""
    if cpu_triton_utils._expand_kernel_impl is expand_kernel_impl:
        return
    require_unchanged_sources(UPSTREAM_SOURCE_SHA256, "patches/vllm_cpu_expand.py", f"vLLM {TARGET_VLLM_VERSION}")
    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
