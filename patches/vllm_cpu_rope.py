"""An MLA query's rotary embedding on vLLM's CPU build, every head at its token's position. Targets vLLM 0.32.0.

vLLM's MLA layer (layers/mla.py) hands the rotary embedding the query's rope part as [tokens, heads, rope_dim].
The CPU kernel behind `RotaryEmbedding.forward_cpu` (csrc/cpu/pos_encoding.cpp) reads a query as [tokens,
heads * head_size]: from a 3-D one it takes tokens * heads rows of one head, `stride(-2)` apart, and rotates row
r at `positions[r]`, so only a token's first head gets its own position and the rest get another token's or
whatever lies past the positions. Every attention layer of a DeepSeek-family target is then off (1-4% of the
first layer's output of a tiny random DeepSeek-V3 against HF transformers, both float32), and differently in a
prefill (the capture) and a decode step (the answers). Keys (one head under MLA) and 2-D queries are right.

`apply()` hands the kernel [tokens, heads * head_size] rows (a copy of a non-contiguous slice, written back).
`eagle_pipeline.engine.offline_engine` applies it before an in-process engine builds its rotary layers.
"""

from __future__ import annotations

import vllm

from patches.upstream import object_source_sha256, require_unchanged_sources, require_version

TARGET_VLLM_VERSION = "0.32.0"

require_version("patches/vllm_cpu_rope.py", "vLLM", vllm.__version__, TARGET_VLLM_VERSION,
                "re-check csrc/cpu/pos_encoding.cpp's reading of a 3-D query and update the patch")

from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding  # noqa: E402

UPSTREAM_SOURCE_SHA256: dict[str, str] = {
    "vllm.model_executor.layers.rotary_embedding.base:RotaryEmbedding.forward_cpu":
        "b749c83b4c38da1e30b3a8694018fcbc089e3e7ff64f4c7c30cc526214398067",
}
_upstream = RotaryEmbedding.forward_cpu


def upstream_sha256(qualified: str) -> str:
    """Fingerprint of the shipped method (the only one fingerprinted), also once `apply` has replaced it."""
    return object_source_sha256(_upstream)


def forward_cpu(self, positions, query, key=None):
    """Upstream's kernel call on [tokens, heads * head_size] rows of query and key, in place like upstream's."""
    rows = [None if x is None else x.reshape(x.shape[0], -1) for x in (query, key)]
    _upstream(self, positions, *rows)
    for x, flat in zip((query, key), rows):
        if x is not None and flat.data_ptr() != x.data_ptr():  # reshape copied a non-contiguous slice
            x.copy_(flat.view(x.shape))
    return query, key


def apply() -> None:
    """Idempotent. Raises if `forward_cpu` is not the one this was written for."""
    require_unchanged_sources(UPSTREAM_SOURCE_SHA256, "patches/vllm_cpu_rope.py", f"vLLM {TARGET_VLLM_VERSION}",
                              upstream_sha256)
    RotaryEmbedding.forward_cpu = forward_cpu
