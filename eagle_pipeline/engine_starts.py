"""The vLLM engines a stage started, and how long each took to become ready: recorded in the stage's manifest
(`engine_starts`) and totalled by scripts/status.py. `loads_target` tells the target's starts (the plan counts
them: plan/engines.py) apart from jobs that read only the target's config (stage 05's load check).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# This process's starts, in order; a stage runs in one process, so these are the stage's.
STARTS: list[dict[str, Any]] = []


def record(what: str, seconds: float | None, loads_target: bool = True) -> None:
    STARTS.append({"what": what, "loads_target": loads_target,
                   "seconds": None if seconds is None else round(seconds, 1)})


@contextmanager
def timed(what: str, loads_target: bool = True) -> Iterator[None]:
    """Record the start of an engine made inside the block (the block ends once it is ready)."""
    started = time.monotonic()
    yield
    record(what, time.monotonic() - started, loads_target)


def summary() -> dict[str, Any]:
    """What the manifest records: every start, and how many loaded the target and for how long."""
    target = [s for s in STARTS if s["loads_target"]]
    return {"target_starts": len(target), "target_start_s": round(sum(s["seconds"] or 0 for s in target), 1),
            "starts": list(STARTS)}

