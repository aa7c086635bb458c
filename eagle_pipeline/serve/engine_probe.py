"""The engine probe: the drafter served again under other engine settings, in turn, until one serves as predicted
(docs/engines.md, "The SM120 trap"). Each entry of `serve.engine_variants` overrides some of the engine keys
(config.serving.ENGINE_VARIANT_KEYS; `env` adds to the run's environment); each costs one server start and one
pass over the evaluation prompts (docs/measurements.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from eagle_pipeline.config import RunConfig
from eagle_pipeline.predict.diagnose import served_agrees
from eagle_pipeline.serve.server import ServerFailed


def variant_config(cfg: RunConfig, variant: Mapping[str, Any]) -> RunConfig:
    """The run's config with the variant's engine keys in place and its `env` added to the run's."""
    sections: dict[str, dict[str, Any]] = {"verifier": {}, "serve": {}}
    for key, value in variant.items():
        if key != "env":
            section, field = key.split(".", 1)
            sections[section][field] = value
    return cfg.model_copy(update={"verifier": cfg.verifier.model_copy(update=sections["verifier"]),
                                  "serve": cfg.serve.model_copy(update=sections["serve"]),
                                  "env": {**cfg.env, **(variant.get("env") or {})}})


def describe(variant: Mapping[str, Any]) -> str:
    """A variant as one short phrase: `verifier.attention_backend=TRITON_MLA, env FAULT=off`."""
    parts = [f"{key}={value if isinstance(value, str) else json.dumps(value)}" for key,
             value in variant.items() if key != "env"]
    parts += [f"env {name}={value}" for name, value in (variant.get("env") or {}).items()]
    return ", ".join(parts)


def failure_reason(error: BaseException) -> str:
    """The line of a failed server start that says why (the last that names an error), shortened."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line or "error" in line]
    reason = (named or lines or ["no reason logged"])[-1]
    return reason if len(reason) <= 240 else reason[:237] + "..."


def probe_engine(variants: Sequence[Mapping[str, Any]], serve: Callable[[int, Mapping[str, Any]], dict[str, Any]],
                 predicted: Sequence[float | None], predicted_drafts: int | None, log=print) -> list[dict[str, Any]]:
    """Serve each variant in turn (`serve(index, variant)` -> the eagle3 mode's summary, with `engine` facts and
    `log`) until one agrees with the prediction; one row per variant tried.

    A variant whose server does not start is recorded with the reason and the next one is tried.
    """
    rows: list[dict[str, Any]] = []
    for index, variant in enumerate(variants, 1):
        text = describe(variant)
        log(f"[engine probe] variant {index} of {len(variants)}: {text}")
        row: dict[str, Any] = {"index": index, "variant": dict(variant), "text": text, "predicted": list(predicted),
                               "served": None, "mean_acceptance_length": None, "num_drafts": None, "agrees": False,
                               "error": None}
        try:
            served = serve(index, variant)
        except ServerFailed as error:
            row["error"] = failure_reason(error)
            log(f"[engine probe] variant {index} did not start: {row['error']}")
            rows.append(row)
            continue
        row.update(served=served.get("per_position_acceptance") or [], num_drafts=served.get("num_drafts"),
                   mean_acceptance_length=served.get("mean_acceptance_length"),
                   server_start_s=served.get("server_start_s"), wall_s=served.get("wall_s"),
                   engine=served.get("engine"), log=served.get("log"))
        row["agrees"] = bool(row["served"]) and served_agrees(row["served"], row["num_drafts"], predicted,
                                                              predicted_drafts)
        log(f"[engine probe] variant {index}: served {row['served']}, predicted {list(predicted)}: "
            + ("serves as predicted" if row["agrees"] else "short of predicted"))
        rows.append(row)
        if row["agrees"]:
            break
    return rows
