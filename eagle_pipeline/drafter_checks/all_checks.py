"""Runs the four drafter checks in order and gathers their results into stage 05's verify.json."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from eagle_pipeline.drafter_checks.config_checks import check_config
from eagle_pipeline.drafter_checks.parity import acceptance_parity, replay_parity
from eagle_pipeline.drafter_checks.shapes import check_shapes
from eagle_pipeline.drafter_checks.subprocess_json import SUBPROCESS_TIMEOUT_S
from eagle_pipeline.drafter_checks.vllm_load import check_vllm
from eagle_pipeline.errors import BadInput

CHECK_NAMES = ("shapes", "config", "vllm_load", "parity")


def verify_drafter(drafter_dir: str | Path, *, target_dir: str | Path, reference_dir: str | Path | None = None,
                   expected: dict[str, Any] | None = None, parity_source_dir: str | Path | None = None,
                   parity_prompts: list | None = None, num_speculative_tokens: int = 3, max_tokens: int = 32,
                   tolerance: float = 0.05, engine_kwargs: dict[str, Any] | None = None,
                   env: dict[str, str] | None = None, engine: str = "vllm",
                   timeout_s: float = SUBPROCESS_TIMEOUT_S, log_dir: str | Path | None = None,
                   drafter_settings: dict[str, Any] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                   parity_conversations: list | None = None) -> dict[str, Any]:
    """Run all four checks on a drafter folder; `expected` maps (dotted) config keys to required values.
    The vLLM jobs' whole output is kept in `log_dir` when given (vllm-load.log, parity-a.log, parity-b.log).

    `engine` is the engine the folder was written for ("vllm" or "sglang"). Parity runs only for a
    vLLM folder with `parity_source_dir` (the speculators checkpoint), and either `parity_conversations`
    (replayed offline, no engine) or `parity_prompts` (vLLM, one engine per folder); otherwise it is reported
    as skipped (ok false, skipped true) and left out of the overall `ok`. An SGLang
    folder still goes through vLLM's loader (the same weight names) but its layer ids are SGLang's.
    """
    if engine not in ("vllm", "sglang"):
        raise BadInput(f"engine {engine!r}: expected 'vllm' or 'sglang'")
    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    folders = [(drafter_dir, "drafter"), (target_dir, "target")]
    if reference_dir is not None:
        folders.append((Path(reference_dir), "reference"))
    for path, what in folders:
        if not (path / "config.json").exists():
            raise BadInput(f"{path / 'config.json'} is missing; the {what} folder is not a model folder")
    checks: dict[str, dict[str, Any]] = {}
    try:
        checks["shapes"] = check_shapes(drafter_dir, reference_dir)
    except BadInput as problem:
        checks["shapes"] = {"ok": False, "detail": {"problems": [str(problem)]}}
    vllm = check_vllm(drafter_dir, target_dir, engine_kwargs=engine_kwargs, drafter_settings=drafter_settings, env=env,
                      timeout_s=timeout_s, log_dir=log_dir)
    checks["config"] = check_config(drafter_dir, target_dir, expected, vllm["config"], engine)
    load = vllm["load"]
    checks["vllm_load"] = {"ok": bool(load.get("ok")), "detail": load}
    if engine == "sglang":
        checks["parity"] = {"ok": False, "skipped": True,
                            "detail": "not run: vLLM would read an SGLang folder's layer ids one layer off"}
    elif parity_source_dir is not None and parity_conversations is not None:
        checks["parity"] = replay_parity(parity_source_dir, drafter_dir, target_dir, parity_conversations,
                                         num_speculative_tokens, tolerance)
    elif parity_source_dir is not None and parity_prompts:
        checks["parity"] = acceptance_parity(target_dir, parity_source_dir, drafter_dir, parity_prompts,
                                             num_speculative_tokens, max_tokens, tolerance,
                                             engine_kwargs=engine_kwargs, env=env, timeout_s=timeout_s,
                                             log_dir=log_dir, drafter_settings=drafter_settings,
                                             chat_template_kwargs=chat_template_kwargs)
    else:
        checks["parity"] = {"ok": False, "skipped": True,
                            "detail": "not run: no parity_source_dir and parity_prompts given"}
    ran = [c for c in checks.values() if not c.get("skipped")]
    return {"ok": all(c["ok"] for c in ran), "checks": checks}
