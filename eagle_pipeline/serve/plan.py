"""How to serve the drafter at the load it will meet: `num_speculative_tokens` per batch size, from the sweep of
`serve.concurrency` levels, the findings of acceptance across load, and the `vllm serve` command that serves it.

Whether a draft pays depends on the batch. At batch 1 a decode step is bound by memory and all-reduce, and
verifying k + 1 tokens costs about what verifying one does; at large batches the verifier is compute-bound and
every rejected draft token costs. The sweep serves each level without speculation and with the drafter at
k_max = `serve.num_speculative_tokens`; from it, per level:

- acceptance for every k <= k_max comes from the per-position acceptance measured at k_max: a chain drafter's
  k-token run accepts exactly the first k positions of the k_max run, so its mean acceptance length is
  L(k) = 1 + a_0 + ... + a_{k-1}, and no server is started per k;
- the step time is measured at k = 0 (time per output token without speculation: one token per step) and at
  k_max (time per output token with the drafter x L(k_max), the tokens one step yields); in between it is
  interpolated linearly in k (k drafter passes, k + 1 verified positions). The estimated speed-up of k is
  L(k) x t(0) / t(k), an estimate and said to be one;
- k is the fastest estimate, 0 where no k beats no speculation by `MIN_GAIN`.

The levels' choices become vLLM's `num_speculative_tokens_per_batch_size` (`batch_ranges`; how vLLM reads it:
docs/engines.md), served once to confirm it unless a run already served that setting (`served_by`); a level served
slower than no speculation goes back to k = 0 (`withdraw_slower`). report.json's `serving_plan`: docs/contracts.md.
"""

from __future__ import annotations

import math
import shlex
from typing import Any, Mapping, Sequence

from eagle_pipeline.drafter.layouts import drafter_mode
from eagle_pipeline.engine import server_kwargs
from eagle_pipeline.serve.server import VllmServer
from eagle_pipeline.serve.spec_metrics import PER_REQUEST_FLAGS, ratio

# The mode stage 06 serves the chosen schedule under (served/schedule.json, logs/server-schedule.log).
SCHEDULE_MODE = "schedule"
# A k > 0 is chosen only where its estimate beats no speculation by this much: below it, timing noise decides.
MIN_GAIN = 0.02
# Acceptance "far below the level before": fewer than half the accepted tokens per draft, and at least this many
# fewer in mean acceptance length (on a weak drafter, halving 0.04 accepted tokens is noise).
COLLAPSE_RATIO = 0.5
COLLAPSE_MIN_DROP = 0.1
# A request that accepted nothing is flagged when its drafts make that this improbable at the rate the level's
# other requests accept their first draft token.
NOTHING_ACCEPTED_P = 1e-3
# Each level sends at least this many requests per client, so that the batch stays near the level for most of
# the run rather than draining from the first wave's end.
REQUESTS_PER_CLIENT = 2


def requests_at(level: int, num_prompts: int) -> int:
    """How many requests a level sends: every prompt, cycled to `REQUESTS_PER_CLIENT` per client."""
    return max(num_prompts, REQUESTS_PER_CLIENT * level)


def greedy_mismatches(reference: Sequence[str], candidate: Sequence[str]) -> list[int]:
    """Indices of prompts whose texts differ."""
    return [i for i, (a, b) in enumerate(zip(reference, candidate)) if a != b]


def mode_levels(summary: Mapping[str, Any] | None, levels: Sequence[int]) -> dict[int, dict]:
    """A served mode's figures per concurrency level: its `levels` list, or (a record of one level written
    before the sweep) the summary itself for the single level configured."""
    if not summary:
        return {}
    listed = summary.get("levels")
    if isinstance(listed, list):
        return {row["concurrency"]: row for row in listed if isinstance(row, dict) and "concurrency" in row}
    return {levels[0]: dict(summary)} if len(levels) == 1 else {}


def acceptance_lengths(per_position: Sequence[float], k_max: int) -> list[float | None]:
    """L(k) for k = 0..k_max from the per-position acceptance of the k_max run (None past what was measured)."""
    lengths: list[float | None] = [1.0]
    total = 1.0
    for k in range(k_max):
        if k >= len(per_position) or per_position[k] is None:
            lengths.append(None)
            continue
        total += per_position[k]
        lengths.append(total)
    return lengths


def estimate_speedups(none: Mapping[str, Any] | None, drafter: Mapping[str, Any] | None,
                      k_max: int) -> list[float | None] | None:
    """Estimated speed-up over no speculation of each k = 0..k_max at one level (module docstring), or None where
    a figure it needs was not measured."""
    if not none or not drafter:
        return None
    t0, t_drafter = none.get("tpot_ms"), drafter.get("tpot_ms")
    lengths = acceptance_lengths(drafter.get("per_position_acceptance") or [], k_max)
    if not t0 or not t_drafter or lengths[k_max] is None:
        return None
    step_k_max = t_drafter * lengths[k_max]
    speedups: list[float | None] = []
    for k, length in enumerate(lengths):
        step = t0 + (step_k_max - t0) * k / k_max
        speedups.append(None if length is None or step <= 0 else length * t0 / step)
    return speedups


def choose_k(speedups: Sequence[float | None] | None) -> int | None:
    """The k with the fastest estimate; 0 where none beats no speculation by MIN_GAIN; None without an estimate.
    A tie goes to the smaller k (fewer draft tokens to waste)."""
    if not speedups:
        return None
    best, best_k = 1.0 + MIN_GAIN, 0
    for k, value in enumerate(speedups):
        if k and value is not None and value > best + 1e-12:
            best, best_k = value, k
    return best_k


def batch_ranges(chosen: Sequence[tuple[int, int]]) -> list[list[int]]:
    """vLLM's `num_speculative_tokens_per_batch_size` from (level, k) pairs in ascending order: each level's k
    holds from the geometric middle below it to the one above it, the first range from batch 1, the last ending
    at its level (vLLM carries it past); neighbouring ranges of the same k merged."""
    ranges: list[list[int]] = []
    start = 1
    for i, (level, k) in enumerate(chosen):
        end = level if i + 1 == len(chosen) else max(level, math.floor(math.sqrt(level * chosen[i + 1][0])))
        if ranges and ranges[-1][2] == k:
            ranges[-1][1] = end
        else:
            ranges.append([start, end, k])
        start = end + 1
    return ranges


def plan_serving(modes: Mapping[str, Mapping[str, Any]], levels: Sequence[int], k_max: int,
                 configured: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    """The estimate at every level and the schedule chosen from it (or `configured`, the one the config names), as
    `scheduled` returns it."""
    none, drafter = mode_levels(modes.get("none"), levels), mode_levels(modes.get(drafter_mode(modes)), levels)
    rows = []
    for level in levels:
        speedups = estimate_speedups(none.get(level), drafter.get(level), k_max)
        k = choose_k(speedups)
        rows.append({"concurrency": level, "estimated_speedup_by_k": speedups, "k": k,
                     "estimated_speedup": None if k is None or speedups is None else speedups[k]})
    return scheduled(rows, configured)


def scheduled(rows: Sequence[Mapping[str, Any]], configured: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    """The plan of the levels' rows (each with its chosen `k`): their schedule, or the configured one, and its kind:
    "none" (k = 0 everywhere), "static" (one k: `k`), "schedule" (k changes with batch size) or None (no rows)."""
    chosen = [(row["concurrency"], row["k"]) for row in rows if row["k"] is not None]
    chosen_schedule = batch_ranges(chosen) if chosen else None
    schedule = [list(entry) for entry in configured] if configured else chosen_schedule
    plan: dict[str, Any] = {"estimate": list(rows), "chosen_schedule": chosen_schedule, "schedule": schedule,
                            "source": "configured" if configured else "estimated", "kind": None, "k": None}
    if schedule:
        ks = {k for _, _, k in schedule}
        if ks == {0}:
            plan["kind"], plan["k"] = "none", 0
        elif len(ks) == 1:
            plan["kind"], plan["k"] = "static", ks.pop()
        else:
            plan["kind"], plan["k"] = "schedule", max(ks)
    return plan


def withdraw_slower(plan: Mapping[str, Any], confirmed: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The plan after its confirming run (`confirmed_levels`), each level served slower back at k = 0 (module
    docstring); the plan itself where none was, or where the schedule is the config's (served as configured)."""
    if plan.get("source") != "estimated":
        return plan
    measured = {row["concurrency"]: row.get("speedup") for row in confirmed}
    slower = {row["concurrency"] for row in plan["estimate"]
              if row.get("k") and measured.get(row["concurrency"]) is not None and measured[row["concurrency"]] < 1.0}
    if not slower:
        return plan
    rows = [{**row, "k": 0, "withdrawn_k": row["k"], "estimated_speedup": row["estimated_speedup_by_k"][0],
             "withdrawn_speedup": measured[row["concurrency"]]} if row["concurrency"] in slower else row
            for row in plan["estimate"]]
    return scheduled(rows)


def plan_speculative_config(plan: Mapping[str, Any], drafter_config: Mapping[str, Any]) -> dict[str, Any] | None:
    """vLLM's `speculative_config` serving the plan: the drafter's (`drafter_config`, as its k_max run had it) with
    the plan's k, and the schedule where k changes with batch size; None for no speculation; the drafter's as it
    was measured where there is no plan (no level with both runs' figures)."""
    if plan.get("kind") is None:
        return dict(drafter_config)
    if plan["kind"] == "none":
        return None
    config = {**drafter_config, "num_speculative_tokens": plan["k"]}
    if plan["kind"] == "schedule":
        config["num_speculative_tokens_per_batch_size"] = [list(entry) for entry in plan["schedule"]]
    else:
        config.pop("num_speculative_tokens_per_batch_size", None)
    return config


def served_by(plan: Mapping[str, Any], k_max: int, drafter: str = "eagle3") -> str | None:
    """The mode already served with the plan's setting ("none", the `drafter`'s; without a plan the drafter as
    measured), or None when it needs its own server."""
    if plan.get("kind") == "none":
        return "none"
    if plan.get("kind") is None or (plan["kind"] == "static" and plan.get("k") == k_max):
        return drafter
    return None


def confirmed_levels(none: Mapping[int, dict], served: Mapping[int, dict]) -> list[dict[str, Any]]:
    """The confirming run's figures per level beside the run without speculation at the same level."""
    rows = []
    for level, row in sorted(served.items()):
        base = none.get(level) or {}
        drafts = row.get("num_drafts")
        rows.append({"concurrency": level, "tokens_per_s": row.get("tokens_per_s"), "tpot_ms": row.get("tpot_ms"),
                     "speedup": ratio(row.get("tokens_per_s") or 0.0, base.get("tokens_per_s") or 0.0) or None,
                     "tpot_speedup": ratio(base.get("tpot_ms") or 0.0, row.get("tpot_ms") or 0.0) or None,
                     "mean_acceptance_length": row.get("mean_acceptance_length"),
                     "draft_tokens_per_draft": ratio(row.get("num_draft_tokens") or 0, drafts) if drafts else None})
    return rows


def speedup_by_concurrency(modes: Mapping[str, Mapping[str, Any]], levels: Sequence[int],
                           confirmed: Mapping[int, dict] | None = None) -> dict[str, list[float | None]]:
    """Output tokens/s over no speculation's at each level, per mode served (and the confirmed schedule)."""
    none = mode_levels(modes.get("none"), levels)
    out: dict[str, list[float | None]] = {}
    served = {name: mode_levels(summary, levels) for name, summary in modes.items()}
    if confirmed is not None:
        served[SCHEDULE_MODE] = dict(confirmed)
    for name, by_level in served.items():
        out[name] = [ratio((by_level.get(c) or {}).get("tokens_per_s") or 0.0,
                           (none.get(c) or {}).get("tokens_per_s") or 0.0) or None for c in levels]
    return out


def acceptance_by_concurrency(summary: Mapping[str, Any] | None, levels: Sequence[int]) -> list[dict[str, Any]]:
    """Per level: the mean acceptance length over all drafts and each request's own (vLLM's per-request metrics)."""
    rows = []
    for level, row in sorted(mode_levels(summary, levels).items()):
        per_request = row.get("per_request") or row.get("per_prompt") or []
        rows.append({"concurrency": level, "mean_acceptance_length": row.get("mean_acceptance_length"),
                     "per_request": [None if r is None else r.get("mean_acceptance_length") for r in per_request],
                     "per_request_drafts": [None if r is None else r.get("num_drafts") for r in per_request]})
    return rows


def collapse_findings(summary: Mapping[str, Any] | None, levels: Sequence[int], mode: str = "eagle3") -> list[dict]:
    """Acceptance that collapses with load, each a finding with its numbers: a level whose mean acceptance length
    is far below the level before's, a level that accepts nothing where another accepts, and requests at exactly
    1.00 while the level's others accept (too many drafts for chance at the others' first-position rate)."""
    findings: list[dict] = []
    rows = sorted(mode_levels(summary, levels).items())
    lengths = {level: row.get("mean_acceptance_length") for level, row in rows}
    accepting = [level for level, length in lengths.items() if length is not None and length > 1.0]
    for (before, prev), (level, row) in zip(rows, rows[1:]):
        old, new = prev.get("mean_acceptance_length"), row.get("mean_acceptance_length")
        if old is None or new is None or old <= 1.0:
            continue
        if new - 1.0 < COLLAPSE_RATIO * (old - 1.0) and old - new >= COLLAPSE_MIN_DROP:
            findings.append({"kind": "level_collapse", "mode": mode, "concurrency": level, "previous": before,
                             "mean_acceptance_length": new, "previous_mean_acceptance_length": old,
                             "text": f"{mode} acceptance collapses at concurrency {level}: mean acceptance length "
                                     f"{new:.2f} against {old:.2f} at concurrency {before}"})
    for level, row in rows:
        length = lengths[level]
        if length is not None and length == 1.0 and row.get("num_drafts") and any(a != level for a in accepting):
            other = max((a for a in accepting if a != level), key=lambda a: lengths[a])
            findings.append({"kind": "level_accepts_nothing", "mode": mode, "concurrency": level,
                             "num_drafts": row["num_drafts"], "other": other,
                             "other_mean_acceptance_length": lengths[other],
                             "text": f"{mode} accepts no draft at concurrency {level} ({row['num_drafts']} drafts, "
                                     f"mean acceptance length 1.00) while concurrency {other} accepts "
                                     f"({lengths[other]:.2f})"})
            continue
        stuck = stuck_requests(row.get("per_request") or row.get("per_prompt") or [])
        if stuck:
            findings.append({"kind": "requests_accept_nothing", "mode": mode, "concurrency": level, **stuck,
                             "text": f"{mode} at concurrency {level}: {len(stuck['requests'])} request(s) "
                                     f"{stuck['requests'][:8]} read exactly 1.00 over {min(stuck['num_drafts'])}-"
                                     f"{max(stuck['num_drafts'])} drafts while the others accept their first draft "
                                     f"token at {stuck['others_first_position']:.2f}"})
    return findings


def stuck_requests(per_request: Sequence[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    """Requests that accepted nothing over more drafts than chance allows at the other requests' first-position
    rate: {"requests": indices, "num_drafts": theirs, "others_first_position": rate}, or None."""
    measured = [(i, r) for i, r in enumerate(per_request) if r and r.get("num_drafts")]
    zero = [(i, r) for i, r in measured if r["mean_acceptance_length"] == 1.0]
    others = [r for _, r in measured if r["mean_acceptance_length"] > 1.0]
    if not zero or not others:
        return None
    drafts = sum(r["num_drafts"] for r in others)
    first = sum((r.get("per_position_acceptance") or [0.0])[0] * r["num_drafts"] for r in others) / drafts
    flagged = [(i, r["num_drafts"]) for i, r in zero
               if first < 1 and (1 - first) ** r["num_drafts"] < NOTHING_ACCEPTED_P]
    if not flagged:
        return None
    return {"requests": [i for i, _ in flagged], "num_drafts": [n for _, n in flagged], "others_first_position": first}


def winning_method(plan: Mapping[str, Any], speedups: Mapping[str, Sequence[float | None]], levels: Sequence[int],
                   confirmed: Sequence[Mapping[str, Any]] | None, drafter: str) -> tuple[str, list[dict]]:
    """The method the command serves and per level the fastest (docs/contracts.md, `method`); the drafter as planned
    is its confirming run's speed-up where one served, its estimate otherwise; an unmeasured speed-up counts 1.0."""
    served = {row["concurrency"]: row.get("speedup") for row in confirmed or []}
    estimate = {row["concurrency"]: row for row in plan.get("estimate") or []}
    methods = [drafter, *(["ngram"] if "ngram" in speedups else []), "none"]
    rows = []
    for i, level in enumerate(levels):
        row = estimate.get(level) or {}
        planned = (speedups.get(drafter, [None] * len(levels))[i] if plan.get("kind") is None
                   else 1.0 if row.get("k") == 0 else served.get(level) or row.get("estimated_speedup"))
        measured = {method: value for method, value in zip(methods, (planned, *(
            [speedups["ngram"][i]] if "ngram" in speedups else []), 1.0)) if value is not None}
        rows.append({"concurrency": level, "speedup": measured, "fastest": max(measured, key=measured.get)})
    return max(methods, key=lambda m: math.prod(row["speedup"].get(m, 1.0) for row in rows)), rows


def serving_plan(plan: Mapping[str, Any], report: Mapping[str, Any], cfg, spec: dict | None, confirmed_by: str | None,
                 confirmed: Mapping[str, Any] | None, target) -> dict[str, Any]:
    """report.json's `serving_plan` (docs/contracts.md, "Stage 06: report.json") of the plan (`plan_serving`) and
    what confirmed it (`confirmed_by`: "schedule" served now or earlier, or the mode that already served the same
    setting; None when not confirmed; `confirmed` {"failed": why} when its server did not start)."""
    s = cfg.serve
    levels, k_max = s.concurrency_levels, s.num_speculative_tokens
    modes = report["modes"]
    drafter = drafter_mode(modes)
    none = mode_levels(modes.get("none"), levels)
    confirmed_rows, mismatches, failed = None, None, (confirmed or {}).get("failed")
    confirmed = None if failed else confirmed
    if confirmed is not None and confirmed.get("summary"):
        confirmed_rows = confirmed_levels(none, mode_levels(confirmed["summary"], levels))
        revised = withdraw_slower(plan, confirmed_rows) if confirmed_by == SCHEDULE_MODE else plan
        if revised is not plan:
            plan, spec = revised, plan_speculative_config(revised, modes[drafter]["speculative_config"])
        reference = (report.get("texts") or {}).get("none")
        if s.temperature == 0 and reference is not None and confirmed.get("texts") is not None:
            mismatches = greedy_mismatches(reference, confirmed["texts"])
    schedule_levels = mode_levels(confirmed["summary"], levels) if confirmed_by == SCHEDULE_MODE and confirmed else None
    speedups = speedup_by_concurrency(modes, levels, schedule_levels)
    method, by_level = winning_method(plan, speedups, levels, confirmed_rows, drafter)
    faster = ""
    if method != drafter:  # n-gram, or no speculation, served faster over the levels than the drafter as planned
        spec = None if method == "none" else dict(modes[method]["speculative_config"])
        faster = (f" Over the levels {method} served faster than the drafter as planned ("
                  + ", ".join(f"{row['speedup'].get(method, 1.0):.2f}x at concurrency {row['concurrency']}"
                              for row in by_level)
                  + f"), so the command serves {'no speculation' if method == 'none' else method}.")
    kwargs = server_kwargs(cfg)
    env = kwargs.pop("env")
    argv = VllmServer(target, speculative_config=spec, log_path="server.log", **kwargs).serve_argv(None)
    command = serve_command(argv, env, cfg.env)
    withdrawn = [row for row in plan.get("estimate") or [] if row.get("withdrawn_k")]
    slower = "" if not withdrawn else (
        " The confirming run served " + "; ".join(f"k = {row['withdrawn_k']} at concurrency {row['concurrency']} at "
                                                  f"{row['withdrawn_speedup']:.2f}x" for row in withdrawn)
        + " of no speculation's tokens/s, slower, so the schedule serves k = 0 there.")
    return {
        **plan,
        "levels": list(levels),
        "num_speculative_tokens": k_max,
        "speculative_config": spec,
        "speculation_off_everywhere": plan.get("kind") == "none",
        "confirmed": None if confirmed_rows is None else {"by": confirmed_by, "levels": confirmed_rows,
                                                           "greedy_mismatches": mismatches},
        "speedup_by_concurrency": speedups,
        "method": method,
        "method_by_concurrency": by_level,
        "acceptance_by_concurrency": acceptance_by_concurrency(modes.get(drafter), levels),
        "findings": collapse_findings(modes.get(drafter), levels, drafter),
        "confirm_failed": failed,
        "note": plan_sentence(plan, confirmed_rows is not None,
                              failed or (None if s.confirm_schedule else "serve.confirm_schedule is off"))
        + slower + faster,
        **command,
    }


def plan_sentence(plan: Mapping[str, Any], confirmed: bool, unconfirmed: str | None) -> str:
    """What the schedule serves and what stands behind it (report.md's text above the command): the estimate, the
    config, a confirming run, or why it is `unconfirmed`."""
    kind = plan.get("kind")
    if kind is None:
        return ("No level had both runs' time per output token to estimate from; the command serves the drafter as "
                "it was measured (k_max at every batch size).")
    estimate = [row for row in plan["estimate"] if row.get("estimated_speedup_by_k")]
    if kind == "none":
        best = max(((max(v for v in row["estimated_speedup_by_k"][1:] if v is not None), row["concurrency"])
                    for row in estimate if any(v is not None for v in row["estimated_speedup_by_k"][1:])),
                   default=None)
        return ("k = 0 at every level measured: on this engine and at these loads the drafter does not pay for "
                "itself, so the drafter as planned is no speculation"
                + (f" (the drafter's best estimate: {best[0]:.2f}x at concurrency {best[1]})." if best else "."))
    where = ("chosen from the estimate" if plan.get("source") == "estimated" else "as configured "
             "(serve.num_speculative_tokens_per_batch_size)")
    state = ("confirmed by serving it (the figures above)" if confirmed
             else f"not confirmed ({unconfirmed}): the speed-ups are estimates" if unconfirmed else "not confirmed")
    return f"Speculation {where}, {state}; batches above the highest level keep its k (vLLM carries it forward)."


# The flags of a stage-06 server that belong to the measurement, not to serving the model.
_MEASUREMENT_FLAGS = {"--host": 1, "--port": 1, "--disable-uvicorn-access-log": 0, PER_REQUEST_FLAGS[0]: 1}
# The variables of the servers' environment that change how vLLM computes (the rest: logging, hub access).
_ENGINE_VARIABLES = ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_CPU_KVCACHE_SPACE")


def serve_command(argv: Sequence[str], env: Mapping[str, str], config_env: Mapping[str, str]) -> dict[str, Any]:
    """The `vllm serve` command of a stage-06 server's flags (`VllmServer.serve_argv`): the model first, the
    measurement's own flags (address, access log, per-request metrics) left out, and the environment that
    changes how vLLM computes (the model runner, the CPU KV cache, the config's `env`) before it."""
    args, model, i = [], None, 0
    argv = list(argv)
    while i < len(argv):
        flag = argv[i]
        if flag == "--model":
            model, i = argv[i + 1], i + 2
            continue
        if flag in _MEASUREMENT_FLAGS:
            i += 1 + _MEASUREMENT_FLAGS[flag]
            continue
        args.append(flag)
        i += 1
    kept = {key: env[key] for key in _ENGINE_VARIABLES if key in env}
    kept.update(config_env)
    words = ["vllm", "serve", *([model] if model else []), *args]
    command = " ".join([*(f"{key}={shlex.quote(value)}" for key, value in kept.items()), shlex.join(words)])
    return {"argv": words, "env": kept, "command": command}


def sweep_plan_line(levels: Sequence[int], modes: Sequence[str], num_prompts: int, max_tokens: int,
                    confirm: bool, device: str, configured: bool = False) -> str:
    """The dry run's line on the sweep: the server starts and a rough duration."""
    starts = len(modes) + int(confirm)
    # Rough figures, stated as such: a cold start (README: ~20 minutes for the ~600 GB target on the GPU host,
    # under a minute for the embedded target on 2 cores) and one decode step of ~30 ms at any batch, every
    # answer running to max_tokens.
    start_s = 1200.0 if device == "cuda" else 60.0
    step_s = 0.03
    per_server = sum(math.ceil(requests_at(c, num_prompts) / c) * max_tokens * step_s for c in levels)
    total = starts * (start_s + per_server)
    return (f"  sweep: concurrency {list(levels)} on each of {', '.join(modes)}"
            + (", then the configured schedule on one more server" if confirm and configured
               else ", then the chosen schedule on one more server unless it is a setting already served" if confirm
               else "")
            + f": {starts} server start{'s' if starts != 1 else ''}, roughly {_duration(total)} "
            f"(~{_duration(start_s)} per start, ~{_duration(per_server)} of requests per server at ~30 ms per "
            f"decode step, {max_tokens} tokens per answer)")


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
