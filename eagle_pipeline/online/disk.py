"""What the states in flight hold while an online run trains: the bound the window sets (`window_bound`, which the
disk plan counts), and the peak stage 04's manifest records beside it, sampled on a thread of the stage process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from eagle_pipeline.capture import ENGINE_DTYPE_BYTES
from eagle_pipeline.online.settings import requests_in_flight

# Often enough to see a sample that lives for one training step (a fraction of a second on the CPU).
SAMPLE_INTERVAL_S = 0.05
# An online sample file's safetensors header and its lock file, with room to spare.
FILE_OVERHEAD_BYTES = 4096


def sample_bytes(cfg, num_states: int, hidden_size: int, tokens: int) -> int:
    """Bytes of one online sample in flight: its states in the engine's dtype (fp8 and a 4-byte scale per token for
    the fp8 transfer) and its int64 token ids, and the file's overhead."""
    if cfg.hidden_states.transfer == "fp8":
        per_token = num_states * hidden_size + 4
    else:
        per_token = num_states * hidden_size * ENGINE_DTYPE_BYTES.get(cfg.verifier.dtype, 2)
    return tokens * (per_token + 8) + FILE_OVERHEAD_BYTES


def window_bound(cfg, num_states: int, hidden_size: int, longest: int) -> int:
    """At most this many bytes of online states in flight: the window's samples on every rank, each the longest."""
    return requests_in_flight(cfg) * sample_bytes(cfg, num_states, hidden_size, longest)


class PeakWatch:
    """`with PeakWatch(measure) as watch:` calls `measure()` every SAMPLE_INTERVAL_S until the block ends;
    `watch.peak` is the largest value it returned. A failing measurement counts as nothing held."""

    def __init__(self, measure: Callable[[], int], interval_s: float = SAMPLE_INTERVAL_S):
        self.measure = measure
        self.interval_s = interval_s
        self.peak = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="online-peak-watch", daemon=True)

    def __enter__(self) -> "PeakWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        try:
            value = int(self.measure())
        except Exception:  # noqa: BLE001 - a server or store going away while it is watched holds nothing
            value = 0
        self.peak = max(self.peak, value)
        self.samples += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            self._sample()
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))
