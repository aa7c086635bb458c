"""The vLLM engines each stage starts: one list. Stage 06 serves its modes in its order, the engine rehearsal
configures every engine in it (plan/rehearsal.py), and the dry run counts the target's cold starts from it.

On the GPU host a cold start of the ~600 GB target costs tens of minutes, so the count matters as much as any
throughput: a full pass starts the target in stage 01 (answers), stage 02 (capture) and stage 06 (a server per
mode, one confirming the chosen schedule, and the prediction's capture unless a kept baseline has it); with
hidden_states.one_pass stage 01's engine captures too and stage 02 starts none.
"""

from __future__ import annotations

from dataclasses import dataclass

from eagle_pipeline.config import STAGES, RunConfig
from eagle_pipeline.engine import speculative_method
from eagle_pipeline.serve.plan import SCHEDULE_MODE


@dataclass(frozen=True)
class Engine:
    stage: int
    name: str
    loads_target: bool = True  # the drafter load check reads the target's config only
    starts: int = 1  # convert.parity vllm starts its engine once for each of the two drafters it compares
    mode: str | None = None  # what a stage-06 server serves: none, ngram, the drafter's (eagle3, dflash), schedule
    variant: int = 0  # a serve.engine_variants entry (from 1) served by the engine probe
    # In a full pass's count: the probe's servers start only on an engine verdict unless probe_engine is always.
    counted: bool = True


def drafter_method(cfg: RunConfig) -> str:
    """vLLM's method for the run's drafter, which names its stage-06 mode: train.family, or for a drafter from
    elsewhere (serve.drafter) its folder's (dflash for a DFlash config)."""
    if cfg.serve.drafter is None:
        return cfg.train.family
    return speculative_method(cfg.resolve_path(cfg.serve.drafter))


def served_modes(cfg: RunConfig) -> list[str]:
    """Stage 06's servers in the order it starts them: none (unless a kept baseline answers), n-gram, the drafter."""
    s = cfg.serve
    return ["none"] * (s.baseline is None) + ["ngram"] * s.ngram_baseline + [drafter_method(cfg)]


def stage_engines(cfg: RunConfig, stage: int) -> list[Engine]:
    """The engines stage `stage` of `cfg` may start, in order."""
    hs, s = cfg.hidden_states, cfg.serve
    online = hs.mode == "online"
    if stage == 1:
        return [Engine(1, "answering engine")]
    if stage == 2:  # online, stage 04 captures; in one pass, stage 01 did
        return [] if online or hs.one_pass else [Engine(2, "hidden-state capture")]
    if stage == 4:  # online training captures through a server of its own, unless given some
        return [Engine(4, "online capture server")] if online and not hs.capture_endpoints else []
    if stage == 5:
        return [Engine(5, "drafter load check", loads_target=False)] + (
            [Engine(5, "parity engine", starts=2)] if cfg.convert.parity == "vllm" else [])
    if stage != 6:
        return []
    engines = [Engine(6, f"server {mode}", mode=mode) for mode in served_modes(cfg)]
    # Counted where it may start: not where the choice is a setting already served, known once levels are measured.
    if s.confirm_schedule:
        engines.append(Engine(6, f"server {SCHEDULE_MODE}", mode=SCHEDULE_MODE))
    if s.predict and s.probe_engine != "never":
        engines += [Engine(6, f"engine variant {i}", mode=drafter_method(cfg), variant=i,
                           counted=s.probe_engine == "always")
                    for i in range(1, len(s.engine_variants) + 1)]
    if s.predict and s.baseline is None:  # a kept baseline holds the captured states too
        engines.append(Engine(6, "replay capture"))
    return engines


def target_starts(cfg: RunConfig, counted: bool = True) -> dict[str, int]:
    """How many times each stage of a full pass starts the target; `counted=False`: the probe's servers only."""
    return {name: sum(e.starts for e in stage_engines(cfg, n) if e.loads_target and e.counted == counted)
            for n, name in STAGES.items()}


def engine_stages(cfg: RunConfig) -> tuple[int, ...]:
    """The stages that start an engine."""
    return tuple(n for n in STAGES if stage_engines(cfg, n))
