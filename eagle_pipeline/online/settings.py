"""What every training rank of an online run needs, carried in launch.json with the rest of the run, and the
`speculators train` flags that turn it into speculators' online dataset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# speculators' client retries a failed request after 2, 4, 8, ... seconds
# (speculators.data_generation.vllm_client: RETRY_BACKOFF_BASE ** attempt).
RETRY_BACKOFF_BASE = 2
# Complete generate/load/check round trips after the first fails (speculators' --generation-validation-retries):
# one more, so that a payload lost in a restart is asked for again.
ROUND_TRIP_RETRIES = 1


@dataclass
class OnlineTraining:
    """How a rank gets hidden states live (hidden_states.mode: online)."""

    endpoints: list[str]  # capture servers' OpenAI base URLs (http://host:port/v1); rank r asks endpoints[r % n]
    transfer: str  # file | fp8 | mooncake (hidden_states.transfer): speculators' backend of the same name
    window: int  # samples whose states exist at once per rank (hidden_states.online_window)
    retry_s: float  # how long one sample's capture is retried before training stops (hidden_states.capture_retry_s)
    # MooncakeStoreConfig fields of the trainer's store client (transfer mooncake only).
    mooncake: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, hidden_states) -> "OnlineTraining":
        """What the config says; stage 04 adds the servers it starts and the Mooncake store's address (session.py)."""
        return cls(endpoints=list(hidden_states.capture_endpoints), transfer=hidden_states.transfer,
                   window=hidden_states.online_window, retry_s=hidden_states.capture_retry_s)

    def endpoint_for(self, rank: int) -> str:
        return self.endpoints[rank % len(self.endpoints)]


def training_ranks(cfg) -> int:
    return max(1, cfg.train.num_gpus)


def requests_in_flight(cfg) -> int:
    """Capture requests the training ranks have open at once: the window of each rank."""
    return cfg.hidden_states.online_window * training_ranks(cfg)


def loader_workers(window: int) -> int:
    """speculators' --num-workers for a window: each loader process has one sample in flight at a time; with none
    the training process itself asks for each sample, which is a window of one."""
    return 0 if window == 1 else window


def request_retries(retry_s: float) -> int:
    """speculators' --max-retries: the fewest retries whose back-off waits, within each of the 1 +
    ROUND_TRIP_RETRIES round trips, add up to that round trip's share of `retry_s`."""
    share = retry_s / (1 + ROUND_TRIP_RETRIES)
    retries = 1
    while sum(RETRY_BACKOFF_BASE ** attempt for attempt in range(1, retries + 1)) < share:
        retries += 1
    return retries


def speculators_flags(online: OnlineTraining, rank: int) -> dict[str, str]:
    """The `speculators train` flags of an online run's rank (they replace the offline run's values)."""
    flags = {
        "--hidden-states-backend": online.transfer,
        # A sample with no stored states (every one but the kept validation rows) is asked of the capture server.
        "--on-missing": "generate",
        "--vllm-endpoint": online.endpoint_for(rank),
        "--num-workers": str(loader_workers(online.window)),
        "--max-retries": str(request_retries(online.retry_s)),
        "--generation-validation-retries": str(ROUND_TRIP_RETRIES),
        # The first sample whose retries are all spent stops training: speculators would otherwise train on without
        # it (up to 20 in a row), and a drafter trained on fewer samples than it was given is not the same drafter.
        "--max-consecutive-generation-failures": "1",
    }
    if online.transfer == "mooncake":
        if online.mooncake is None:
            raise ValueError("a Mooncake transfer needs the store's settings")
        m = online.mooncake
        flags.update({
            "--mooncake-master": m["master_server_address"],
            "--mooncake-metadata-server": m["metadata_server"],
            "--mooncake-protocol": m["protocol"],
            "--mooncake-device": m["device_name"],
            "--mooncake-global-segment-gib": repr(m["global_segment_size"] / 2**30),
            "--mooncake-local-buffer-gib": repr(m["local_buffer_size"] / 2**30),
        })
    return flags


def with_flags(argv: list[str], flags: dict[str, str]) -> list[str]:
    """`argv` with each flag's value replaced where it is given and the flag appended where it is not."""
    out = list(argv)
    for flag, value in flags.items():
        if flag in out:
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out
