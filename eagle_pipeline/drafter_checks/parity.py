"""The `parity` check: the speculators checkpoint and its conversion accept the same drafts, position by position.

Two ways (`convert.parity`):
- replay (the default): both drafters replayed on the same held-out conversations and the target's hidden
  states that stage 02 captured for them (eagle_pipeline/predict, the replay stage 06 holds vLLM's counters
  against), the flat folder read back the way the replay of stage 06 reads it. No engine starts: on the GPU
  host a target cold start costs tens of minutes, and this compares the two formats exactly. How vLLM
  reads the flat folder is checked by its own loader (the vllm_load check) and by stage 06, where served
  acceptance must match the replay's prediction.
- vllm: vLLM runs the same prompts greedily with each drafter folder, one engine each, and the accepted
  tokens per draft position are compared within the tolerance.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any

from eagle_pipeline.drafter.folder import is_dflash_drafter
from eagle_pipeline.drafter_checks.subprocess_json import SUBPROCESS_TIMEOUT_S, run_json_subprocess
from eagle_pipeline.engine import eagle3_engine_kwargs


def acceptance_engine_kwargs(target_dir: str, drafter_dir: str, num_speculative_tokens: int,
                             engine_kwargs: dict[str, Any] | None = None,
                             drafter_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    """`LLM` arguments of one parity engine: the run's engine speculating with `drafter_dir`."""
    return eagle3_engine_kwargs(target_dir, drafter_dir, num_speculative_tokens=num_speculative_tokens,
                                engine_kwargs=engine_kwargs, drafter_settings=drafter_settings,
                                defaults={"max_model_len": 1024, "enforce_eager": True, "seed": 0})


def acceptance_run(target_dir: str, drafter_dir: str, prompts: list, num_speculative_tokens: int,
                   max_tokens: int, engine_kwargs: dict[str, Any] | None = None,
                   drafter_settings: dict[str, Any] | None = None,
                   chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Greedy generation with a drafter in vLLM; spec-decode counters from llm.get_metrics()."""
    from vllm import LLM, SamplingParams

    kwargs = acceptance_engine_kwargs(target_dir, drafter_dir, num_speculative_tokens, engine_kwargs, drafter_settings)
    llm = LLM(disable_log_stats=False, **kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    if all(isinstance(p, str) for p in prompts):
        outputs = llm.generate(prompts, params, use_tqdm=False)
    else:
        outputs = llm.chat(prompts, params, use_tqdm=False, chat_template_kwargs=chat_template_kwargs or None)
    counters: dict[str, int] = {}
    per_position: list[int] = [0] * num_speculative_tokens
    for metric in llm.get_metrics():
        if metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            for pos, value in enumerate(metric.values):
                per_position[pos] += int(value)
        elif metric.name.startswith("vllm:spec_decode_num_"):
            key = metric.name.removeprefix("vllm:spec_decode_")
            counters[key] = counters.get(key, 0) + int(metric.value)
    return {
        "drafter": drafter_dir,
        "num_drafts": counters.get("num_drafts", 0),
        "num_draft_tokens": counters.get("num_draft_tokens", 0),
        "num_accepted_tokens": counters.get("num_accepted_tokens", 0),
        "accepted_per_position": per_position,
        "output_token_ids": [list(o.outputs[0].token_ids) for o in outputs],
    }


def acceptance_summary(run: dict[str, Any]) -> dict[str, Any]:
    drafts = run["num_drafts"]
    rates = [a / drafts if drafts else 0.0 for a in run["accepted_per_position"]]
    return {
        "drafter": run["drafter"],
        "num_drafts": drafts,
        "accepted_per_position": run["accepted_per_position"],
        "acceptance_rate_per_position": [round(r, 4) for r in rates],
        "mean_acceptance_length": round(1 + run["num_accepted_tokens"] / drafts, 4) if drafts else None,
    }


def compare_acceptance(run_a: dict[str, Any], run_b: dict[str, Any], tolerance: float) -> dict[str, Any]:
    """Per-position acceptance rates (accepted / drafts) must agree within `tolerance`. Two engines need not
    decode the same greedy text (vLLM promises no bit-identical results across engines), so differing text is
    reported, not failed."""
    a, b = acceptance_summary(run_a), acceptance_summary(run_b)
    diffs = [abs(x - y) for x, y in zip(a["acceptance_rate_per_position"], b["acceptance_rate_per_position"])]
    problems = []
    if not a["num_drafts"] or not b["num_drafts"]:
        problems.append("a run made no drafts; spec decoding did not run")
    worst = max(diffs) if diffs else math.inf
    if worst > tolerance:
        pos = diffs.index(worst)
        problems.append(f"position {pos}: acceptance {a['acceptance_rate_per_position'][pos]} vs "
                        f"{b['acceptance_rate_per_position'][pos]} differs by {worst:.4f} > tolerance {tolerance}")
    same_outputs = run_a.get("output_token_ids") == run_b.get("output_token_ids")
    return {"ok": not problems,
            "detail": {"method": run_a.get("method", "vllm"), "a": a, "b": b, "tolerance": tolerance,
                       "max_rate_difference": round(worst, 6) if diffs else None,
                       "same_greedy_outputs": same_outputs, "problems": problems}}


def replay_run(drafter_dir: str | Path, conversations: list, num_speculative_tokens: int,
               model: Any = None) -> dict[str, Any]:
    """`acceptance_run`'s counters from the offline replay of a speculators drafter folder (`model`: that folder
    already loaded by `predict.speculators_drafter.load_drafter`, or a DFlash one's by `predict.blocks`)."""
    from eagle_pipeline.predict.acceptance import predict_acceptance
    from eagle_pipeline.predict.blocks import predict_block_acceptance

    replay = predict_block_acceptance if is_dflash_drafter(drafter_dir) else predict_acceptance
    result = replay(drafter_dir if model is None else model, conversations, num_speculative_tokens)
    drafts = int(result["num_drafts"])
    per_position = [round(float(rate) * drafts) for rate in result["predicted_per_position_acceptance"]]
    return {"method": "replay", "drafter": str(drafter_dir), "num_drafts": drafts,
            "num_draft_tokens": drafts * num_speculative_tokens, "num_accepted_tokens": sum(per_position),
            "accepted_per_position": per_position}


def replay_parity(speculators_dir: str | Path, flat_dir: str | Path, verifier_dir: str | Path, conversations: list,
                  num_speculative_tokens: int, tolerance: float, checkpoint: Any = None) -> dict[str, Any]:
    """The speculators checkpoint and the flat folder (read back into speculators' layout, as stage 06's replay
    reads it) replayed on the same conversations: (token ids, hidden states, prompt length) tuples.
    `checkpoint`: the checkpoint already loaded, when the caller has it."""
    from eagle_pipeline.predict.flat_drafter import write_speculators_checkpoint

    if not conversations:
        return {"ok": False, "detail": {"method": "replay", "tolerance": tolerance,
                                        "problems": ["no held-out conversation with an answer to replay"]}}
    with tempfile.TemporaryDirectory(prefix="eagle-parity-") as tmp:
        # A DFlash folder is a speculators folder already (convert.write_dflash_folder).
        read_back = flat_dir if is_dflash_drafter(flat_dir) else write_speculators_checkpoint(
            flat_dir, verifier_dir, Path(tmp) / "from-flat", speculative_tokens=num_speculative_tokens)
        runs = [replay_run(speculators_dir, conversations, num_speculative_tokens, checkpoint),
                replay_run(read_back, conversations, num_speculative_tokens)]
    runs[1]["drafter"] = str(flat_dir)
    return compare_acceptance(runs[0], runs[1], tolerance)


def acceptance_parity(target_dir: str | Path, dir_a: str | Path, dir_b: str | Path, prompts: list,
                      num_speculative_tokens: int, max_tokens: int, tolerance: float, *,
                      engine_kwargs: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                      timeout_s: float = SUBPROCESS_TIMEOUT_S, log_dir: str | Path | None = None,
                      drafter_settings: dict[str, Any] | None = None,
                      chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run vLLM greedily with drafter A (e.g. the speculators checkpoint) and B (its conversion) and
    compare accepted tokens per draft position; `prompts` are strings or chat message lists. With `log_dir`,
    each run's output is kept there as parity-a.log and parity-b.log, with the prompts (parity-prompts.json)."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="eagle-parity-") as tmp:
        # Beside the logs when kept, so that the command heading each log can be run again by hand.
        prompts_file = (Path(log_dir) if log_dir is not None else Path(tmp)) / "parity-prompts.json"
        prompts_file.parent.mkdir(parents=True, exist_ok=True)
        prompts_file.write_text(json.dumps(prompts))
        for drafter, log_name in ((dir_a, "parity-a.log"), (dir_b, "parity-b.log")):
            args = ["acceptance", "--target", str(target_dir), "--drafter", str(drafter),
                    "--prompts", str(prompts_file), "--num-speculative-tokens", str(num_speculative_tokens),
                    "--max-tokens", str(max_tokens), "--engine-kwargs", json.dumps(engine_kwargs or {}),
                    "--drafter-settings", json.dumps(drafter_settings or {}),
                    "--chat-template-kwargs", json.dumps(chat_template_kwargs or {})]
            try:
                log_path = Path(log_dir) / log_name if log_dir is not None else None
                runs.append(run_json_subprocess(args, env, timeout=timeout_s, log_path=log_path))
            except RuntimeError as error:
                return {"ok": False, "detail": {"tolerance": tolerance, "problems": [f"{drafter}: {error}"]}}
    return compare_acceptance(runs[0], runs[1], tolerance)
