"""The vLLM engines a stage started, and how long each took to become ready: recorded in the stage's manifest
(`engine_starts`) and totalled by scripts/pipeline_report.py.

On the GPU host a cold start of the ~600 GB target costs tens of minutes, so the count matters as much as
any throughput: a full pass of the pipeline starts the target in stage 01 (answers), stage 02 (capture) and
stage 06 (a server per mode, one confirming the chosen schedule, and the prediction's capture unless a kept
baseline has it). `loads_target`
tells those apart from jobs that read only the target's config (stage 05's load check).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from eagle_pipeline.config import STAGES

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


def planned_target_starts(cfg) -> dict[str, int]:
    """How many times each stage of a full pass of `cfg` starts the target (before any of it has run). Stage
    06's engine probe counts only where it always runs (`serve.probe_engine: always`): otherwise it serves
    its `serve.engine_variants` only when served and predicted acceptance disagree with no config mistake to
    blame (`probe_starts`)."""
    s = cfg.serve
    served = (s.baseline is None) + s.ngram_baseline + 1  # none (unless a kept baseline answers), n-gram, EAGLE-3
    # The chosen schedule's server, counted where it may start: it does not where the choice is a setting already
    # served (k_max or no speculation at every level), known only once the levels are measured.
    served += int(s.confirm_schedule)
    prediction = int(s.predict and s.baseline is None)  # a kept baseline holds the captured states too
    probe = probe_starts(cfg) if s.probe_engine == "always" else 0
    hs = cfg.hidden_states
    online = hs.mode == "online"  # stage 04 captures instead of stage 02, starting a server unless given some
    return {STAGES[1]: 1, STAGES[2]: int(not online), STAGES[3]: 0, STAGES[4]: int(online and not hs.capture_endpoints),
            STAGES[5]: 2 if cfg.convert.parity == "vllm" else 0, STAGES[6]: served + prediction + probe}


def probe_starts(cfg) -> int:
    """The most target starts stage 06's engine probe makes: one server per `serve.engine_variants` entry."""
    return len(cfg.serve.engine_variants) if cfg.serve.predict and cfg.serve.probe_engine != "never" else 0
