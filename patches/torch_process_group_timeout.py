"""A longer default timeout for the training ranks' process group. Targets torch 2.13.0.

speculators 0.9.0 starts its process group with `dist.init_process_group(backend, device_id=local_rank)`
(`train/distributed.py` `maybe_setup_distributed`), which takes torch's default timeout: 10 minutes for
NCCL (`_get_default_timeout`, from `distributed_c10d`'s module-level `default_pg_nccl_timeout`). After
each epoch rank 0 alone replays the checkpoint on held-out conversations (eagle_pipeline/train/
predicted_acceptance.py) while the other ranks wait at their next collective; for a Kimi-sized drafter on
the CPU that can take longer than 10 minutes, and the waiting ranks would be killed by the watchdog.

`apply(seconds)` sets both module-level defaults that `_get_default_timeout` reads (NCCL and the others) to
at least `seconds`, in this process, before speculators starts the group; a collective that hangs for real
still ends, later. Importing this module on any torch other than 2.13.0 raises, and `UPSTREAM_SOURCE_SHA256`
fingerprints the reader of those defaults (speculators' call is fingerprinted by patches/speculators_cpu.py);
tests/test_patches.py fails when it changes.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from patches.upstream import require_unchanged_sources, require_version

TARGET_TORCH_VERSION = "2.13.0"

require_version("patches/torch_process_group_timeout.py", "torch", torch.__version__.split("+")[0],
                TARGET_TORCH_VERSION,
                "re-check torch.distributed.distributed_c10d._get_default_timeout and update the patch")

# speculators' call that takes the default is fingerprinted by patches/speculators_cpu.py, which wraps it.
UPSTREAM_SOURCE_SHA256: dict[str, str] = {
    "torch.distributed.distributed_c10d:_get_default_timeout":
        "8859a9fb085a121262cb486487d00c39b856ad531401375ce0196874af14a9e9",
}


def apply(seconds: float) -> None:
    """Idempotent; never shortens a default. Raises if the reader is not the one this was written for."""
    require_unchanged_sources(UPSTREAM_SOURCE_SHA256, "patches/torch_process_group_timeout.py",
                              f"torch {TARGET_TORCH_VERSION}")
    from torch.distributed import distributed_c10d

    wanted = timedelta(seconds=seconds)
    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        current = getattr(distributed_c10d, name, None)
        if isinstance(current, timedelta) and current < wanted:
            setattr(distributed_c10d, name, wanted)
