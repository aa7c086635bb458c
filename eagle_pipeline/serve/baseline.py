"""The no-speculation baseline of a stage-06 run, kept for reuse: answers, their token ids, captured states. A
finished stage 06 keeps them in `<run>/06_serve_test/baseline/` (docs/formats.md, "The no-speculation baseline");
`serve.baseline: <that 06_serve_test folder>` reuses them when every setting that shapes the answers matches,
otherwise the stage refuses and names the setting.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from safetensors import safe_open

from eagle_pipeline import atomic
from eagle_pipeline.errors import BadInput
from eagle_pipeline.json_files import read_json_object

if TYPE_CHECKING:
    import torch

BASELINE_DIR = "baseline"
ANSWERS = "answers.json"


def save_baseline_answers(stage_dir: Path, shaped_by: dict[str, Any], record: dict[str, Any]) -> None:
    """The no-speculation answers (the "none" mode's record, `measure.mode_record`), written as soon as they are
    served (before a later mode or the prediction can fail)."""
    atomic.write_json(stage_dir / BASELINE_DIR / ANSWERS, {"shaped_by": shaped_by, "texts": record["texts"],
                                                           "token_ids": record["token_ids"],
                                                           "summary": record["summary"], "captured_layer_ids": None})


def save_baseline_states(stage_dir: Path, captured: tuple[list[torch.Tensor], list[int]]) -> None:
    """The answers' captured hidden states beside them, and the ids they hold in answers.json."""
    from safetensors.torch import save_file

    folder = stage_dir / BASELINE_DIR
    states, layer_ids = captured
    for i, hidden in enumerate(states):
        atomic.write_with(folder / f"hs_{i}.safetensors",
                          lambda tmp, h=hidden: save_file({"hidden_states": h.contiguous()}, str(tmp)))
    answers = json.loads((folder / ANSWERS).read_text())
    atomic.write_json(folder / ANSWERS, {**answers, "captured_layer_ids": list(layer_ids)})


# What stage 06 reads of answers.json, and the type each must have.
ANSWER_FIELDS = {"shaped_by": dict, "texts": list, "token_ids": list, "summary": dict,
                 "captured_layer_ids": (list, type(None))}


def load_baseline(stage_dir: Path, shaped_by: dict[str, Any]) -> dict[str, Any]:
    """The kept baseline of a 06_serve_test folder; BadInput names the first of its files that stage 06 could not
    read (torn, missing, another layout) or the setting it was served with that differs from `shaped_by`."""
    path = Path(stage_dir) / BASELINE_DIR / ANSWERS
    fix = ("point serve.baseline at a finished 06_serve_test folder that served without speculation, or leave it out "
           "to serve without speculation again")
    baseline = read_json_object(path, fix)
    if (any(not isinstance(baseline.get(key), kind) for key, kind in ANSWER_FIELDS.items())
            or len(baseline["texts"]) != len(baseline["token_ids"]) or "tokens_per_s" not in baseline["summary"]):
        raise BadInput(f"serve.baseline: {path}: does not hold what stage 06 keeps ({', '.join(ANSWER_FIELDS)}, a "
                       f"text and its token ids per answer, the summary's tokens_per_s); {fix}")
    for i in range(len(baseline["token_ids"]) if baseline["captured_layer_ids"] is not None else 0):
        try:  # the header says how long the file is: a torn one is refused without reading its states
            with safe_open(str(path.parent / f"hs_{i}.safetensors"), framework="pt") as f:
                f.get_slice("hidden_states")
        except Exception as e:  # noqa: BLE001 - whatever safetensors raises for a missing or torn file
            raise BadInput(f"serve.baseline: {path.parent / f'hs_{i}.safetensors'}: cannot be read "
                           f"({type(e).__name__}: {e}); {fix}") from None
    for key, value in shaped_by.items():
        if baseline["shaped_by"].get(key) != value:
            raise BadInput(f"serve.baseline: {path} was served with another {key}; serve without speculation again "
                           f"(leave serve.baseline out) or point at a baseline of the same settings")
    baseline["dir"] = str(path.parent)
    return baseline


def kept_baseline(stage_dir: Path, shaped_by: dict[str, Any]) -> dict[str, Any] | None:
    """This stage folder's own baseline when an earlier run of the same settings left one whole, else None."""
    try:
        return load_baseline(stage_dir, shaped_by)
    except BadInput:
        return None


def baseline_states(baseline: dict[str, Any], layer_ids: Sequence[int]) -> tuple[list[torch.Tensor], list[int]] | None:
    """The stored states when they hold every id in `layer_ids` (then in the stored layout), else None."""
    from safetensors.torch import load_file

    stored = baseline.get("captured_layer_ids")
    if stored is None or not set(layer_ids) <= set(stored):
        return None
    folder = Path(baseline["dir"])
    return [load_file(str(folder / f"hs_{i}.safetensors"))["hidden_states"]
            for i in range(len(baseline["token_ids"]))], list(stored)
