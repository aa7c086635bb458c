"""Runs the five drafter checks in order and gathers their results into stage 05's verify.json."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from eagle_pipeline.drafter.folder import describe, is_dflash_drafter
from eagle_pipeline.drafter.layouts import MLA, is_dflash_config
from eagle_pipeline.drafter_checks import dflash, vllm_logits
from eagle_pipeline.drafter_checks.config_checks import check_config
from eagle_pipeline.drafter_checks.parity import acceptance_parity, replay_parity
from eagle_pipeline.drafter_checks.shapes import check_shapes
from eagle_pipeline.drafter_checks.subprocess_json import SUBPROCESS_TIMEOUT_S
from eagle_pipeline.drafter_checks.vllm_load import check_vllm
from eagle_pipeline.errors import BadInput

CHECK_NAMES = ("shapes", "config", "vllm_load", "vllm_logits", "parity")


def verify_drafter(drafter_dir: str | Path, *, target_dir: str | Path, reference_dir: str | Path | None = None,
                   expected: dict[str, Any] | None = None, parity_source_dir: str | Path | None = None,
                   parity_prompts: list | None = None, num_speculative_tokens: int = 3, max_tokens: int = 32,
                   tolerance: float = 0.05, engine_kwargs: dict[str, Any] | None = None,
                   env: dict[str, str] | None = None, engine: str = "vllm",
                   timeout_s: float = SUBPROCESS_TIMEOUT_S, log_dir: str | Path | None = None,
                   drafter_settings: dict[str, Any] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
                   parity_conversations: list | None = None) -> dict[str, Any]:
    """Run all five checks on a drafter folder; `expected` maps (dotted) config keys to required values.
    The vLLM jobs' whole output is kept in `log_dir` when given (vllm-load.log, parity-a.log, parity-b.log).

    `engine` is the engine the folder was written for ("vllm" or "sglang"); an SGLang folder still goes through
    vLLM's loader (the same weight names) but its layer ids are SGLang's. `parity_source_dir` is the speculators
    checkpoint; parity replays `parity_conversations` offline (no engine) or serves `parity_prompts` (vLLM, one engine
    per folder). A check that cannot run (`logits_skip_reason`, the branches below) is reported as skipped (ok
    false, skipped true) and left out of the overall `ok`.
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
    blocks = is_dflash_drafter(drafter_dir)
    try:
        checks["shapes"] = (dflash.check_shapes if blocks else check_shapes)(drafter_dir, reference_dir)
    except BadInput as problem:
        checks["shapes"] = {"ok": False, "detail": {"problems": [str(problem)]}}
    with tempfile.TemporaryDirectory(prefix="eagle-logits-") as tmp:
        why_not = logits_skip_reason(drafter_dir, engine, parity_source_dir, parity_conversations)
        # The speculators checkpoint, loaded once for this check and the replay parity.
        checkpoint, checkpoint_logits, logits_files = None, None, None
        if why_not is None:
            from eagle_pipeline.predict.blocks import load_block_drafter
            from eagle_pipeline.predict.speculators_drafter import load_drafter

            checkpoint = (load_block_drafter if blocks else load_drafter)(parity_source_dir)
            logits_files = (Path(tmp) / "inputs.safetensors", Path(tmp) / "vllm.safetensors")
            checkpoint_logits = (dflash.speculators_side(checkpoint, parity_conversations[0], num_speculative_tokens,
                                                         logits_files[0]) if blocks else
                                 vllm_logits.speculators_side(checkpoint, parity_conversations[0], logits_files[0]))
        vllm = check_vllm(drafter_dir, target_dir, engine_kwargs=engine_kwargs, drafter_settings=drafter_settings,
                          env=env, timeout_s=timeout_s, log_dir=log_dir, logits_files=logits_files)
        checks["config"] = check_config(drafter_dir, target_dir, expected, vllm["config"], engine)
        load = vllm["load"]
        checks["vllm_load"] = {"ok": bool(load.get("ok")), "detail": load}
        side = vllm.get("logits") or {}
        if why_not is not None or "skipped" in side:
            checks["vllm_logits"] = {"ok": False, "skipped": True, "detail": f"not run: {why_not or side['skipped']}"}
        elif "error" in side:
            checks["vllm_logits"] = {"ok": False, "detail": {"problems": [f"vLLM's side: {side['error']}"]}}
        elif blocks:
            trained = checkpoint.config.to_dict()
            checks["vllm_logits"] = dflash.compare(checkpoint_logits, side, logits_files[1], trained)
        else:
            checks["vllm_logits"] = vllm_logits.compare(checkpoint_logits, side, logits_files[1])
    if engine == "sglang":
        checks["parity"] = {"ok": False, "skipped": True,
                            "detail": "not run: vLLM would read an SGLang folder's layer ids one layer off"}
    elif parity_source_dir is not None and parity_conversations is not None:
        checks["parity"] = replay_parity(parity_source_dir, drafter_dir, target_dir, parity_conversations,
                                         num_speculative_tokens, tolerance, checkpoint)
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


def logits_skip_reason(drafter_dir: Path, engine: str, parity_source_dir, parity_conversations) -> str | None:
    """Why the vllm_logits check does not run for this folder (None: it runs)."""
    if engine != "vllm":
        return "an SGLang folder"
    if parity_source_dir is None or not parity_conversations:
        return "no speculators checkpoint and held-out conversation given (convert.parity: replay gives them)"
    folder = describe(drafter_dir)
    if folder is None or (folder.layer_shape != MLA and not is_dflash_config(folder.config)):
        return ("a Llama-shaped drafter: vLLM's Eagle3LlamaForCausalLM is held to the checkpoint by stage 06's "
                "served-against-predicted acceptance")
    return None
