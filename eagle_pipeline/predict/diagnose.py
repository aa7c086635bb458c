"""A verdict with a cause: served acceptance against the replay, and which known serving mistake explains a gap.

The replay (eagle_pipeline.predict) is run once as the engine should feed the drafter (the reference) and
once per alternative reading of the drafter: its aux ids one layer lower or higher (the two numbering
conventions, docs/layer_ids.md), the target's default ids (what vLLM captures when it reads no ids), each
norm flag flipped, no `d2t` (vLLM's identity map), the final-layer slot after the final norm instead of
before, and for an MLA drafter its RoPE over halves against interleaved pairs (vLLM's DeepSeek layers always
rotate interleaved pairs) and its softmax scale with against without YaRN's mscale**2. Then:

- served short of the reference beyond the tolerance at some position, and an alternative reproduces the
  served figures within the tolerance at every position: the engine reads the folder's config otherwise
  than the replay (status "config"); the cause is that alternative;
- served short, no alternative reproduces it (or served accepts next to nothing, which any reading that
  breaks the drafter predicts as well, and so proves none), and the config holds no fault of its own: the engine
  computes the drafter (or the target's states) differently from the replay (status "engine"): an
  attention backend, a KV-cache dtype, the model runner, CUDA graphs, quantization. The verdict names the
  settings vLLM logged for this run (eagle_pipeline/serve/engine_facts.py) and the engine variants to try
  (`serve.engine_variants`, eagle_pipeline/serve/engine_probe.py); a config reading is never named for
  figures it does not reproduce. A drafter that accepts nothing on an engine that computes it wrongly
  would otherwise be blamed on whichever reading accepts least (a missing `d2t`);
- served within the tolerance, and a config that the engine cannot serve as intended whatever the figures
  (a pruned vocabulary without `d2t`; ids only where vLLM's model runner V2 does not look): the fault is
  named from the config alone (without its map the replay's figures mean nothing either);
- served within the tolerance but an alternative reading fits the target clearly better than the reference:
  the folder's config misstates how the drafter was trained (the engine reads what the folder says, and the
  folder is wrong); the cause is that alternative. This is how a drafter from elsewhere (`serve.drafter`)
  is judged, and how its layer convention is told (`layer_convention`).

"Fits better" is judged by `first_draft_kl` (eagle_pipeline.predict.acceptance), else by acceptance with
MISDECLARED_MARGIN where a reading has no KL (no `d2t`); why, and the tolerance per position
(TOLERANCE_FLOOR, TOLERANCE_SIGMAS): docs/measurements.md, "Which reading the drafter was trained under" and
"Served vs predicted".
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from eagle_pipeline.drafter.layouts import dflash_served_causal, dflash_trained_causal, is_dflash_config
from eagle_pipeline.layer_ids import default_layer_ids, vllm_read_aux_ids
from eagle_pipeline.predict.variants import Variant

# Measured, with the figures behind each (docs/measurements.md, "Served vs predicted" and "Which reading the
# drafter was trained under"): the tolerance's floor, the fit margins that name a declaration wrong, and the
# first-draft acceptance below which a drafter is weak rather than misdeclared.
TOLERANCE_FLOOR = 0.05
TOLERANCE_SIGMAS = 2.0
FIT_MARGIN = 0.02
FIT_MARGIN_ABS = 0.002
MIN_FIRST_ACCEPTANCE = 0.10
# For a reading without the KL: beating the declared mean acceptance length by this much.
MISDECLARED_MARGIN = 0.1


@dataclass(frozen=True)
class Reading:
    """One way the engine may read the drafter: which layers feed it, with which flags, with or without d2t."""

    name: str
    text: str
    layer_ids: tuple[int, ...]
    norm_flags: Mapping[str, bool] = field(default_factory=dict)
    drop_d2t: bool = False
    final_post_norm: bool = False
    # An MLA drafter's attention (predict.speculators_drafter.mla_attention); empty for a Llama-shaped one.
    attention: Mapping[str, bool] = field(default_factory=dict)


# The MLA attention readings: how each one misreads the drafter, by the value it was trained with.
ATTENTION_TEXTS = {
    ("rope_interleave", False): "RoPE rotated over interleaved pairs (vLLM's DeepSeek layers always do, is_neox_style "
                                "False) while the drafter was trained rotating halves (rope_interleave false)",
    ("rope_interleave", True): "RoPE rotated over halves (rope_interleave false, neox style) while the drafter is "
                               "declared with interleaved pairs, which vLLM's DeepSeek layers rotate",
    ("softmax_mscale", True): "softmax scale without YaRN's mscale**2 factor while the drafter was trained with it",
    ("softmax_mscale", False): "softmax scale with YaRN's mscale**2 factor (vLLM's deepseek_v2.py applies it for "
                               "a YaRN rope) while the drafter was trained without it",
    ("causal", False): "causal attention inside the DFlash block (vLLM 0.32 reads a speculators folder's "
                       "sliding_window_non_causal false so for every layer, vLLM PR #56692) while the drafter was "
                       "trained attending both ways; write sliding_window_non_causal true",
    ("causal", True): "attention both ways inside the DFlash block (vLLM reads a speculators folder's missing or true "
                      "sliding_window_non_causal so) while the drafter was trained causal; write "
                      "sliding_window_non_causal false",
    ("causal", None): "one attention for every layer of the DFlash block (vLLM reads sliding_window_non_causal so) "
                      "while the drafter was trained causal in its sliding-window layers only: no folder serves it as "
                      "trained; train it with sliding_window_non_causal true",
}


def readings(layer_ids: Sequence[int], num_layers: int, flags: Mapping[str, bool], *, has_d2t: bool,
             reference: str = "as_trained", attention: Mapping[str, bool] | None = None) -> list[Reading]:
    """The reference reading first, then every alternative this target's depth allows; `attention` (an MLA
    drafter's, as trained or declared) adds one reading per attention setting read the other way."""
    ids = tuple(int(k) for k in layer_ids)
    flags = dict(flags)
    attention = dict(attention or {})
    shown = ", ".join(map(str, ids))
    result = [Reading(reference, f"aux ids ({shown}) as declared", ids, flags, attention=attention)]
    for shift, name, why in ((-1, "ids_minus_one", "one layer lower"), (1, "ids_plus_one", "one layer higher")):
        moved = tuple(k + shift for k in ids)
        if all(0 < k <= num_layers for k in moved):
            result.append(Reading(name, "aux layer ids off by one: the drafter matches ids "
                                        f"({', '.join(map(str, moved))}), {why} than ({shown}) "
                                        "(the other numbering convention, docs/layer_ids.md)",
                                  moved, flags, attention=attention))
    defaults = tuple(default_layer_ids(num_layers))
    if defaults != ids:
        result.append(Reading("ids_default", f"aux ids not read by the engine: it captured the target's default layers "
                                             f"({', '.join(map(str, defaults))}) instead of ({shown})", defaults,
                              flags, attention=attention))
    for flag, value in flags.items():
        result.append(Reading(f"{flag}_flipped", f"norm flag {flag} read as {str(not value).lower()} instead of "
                                                 f"{str(value).lower()}", ids, {**flags, flag: not value},
                              attention=attention))
    for key, value in attention.items():
        result.append(Reading(f"{key}_flipped", ATTENTION_TEXTS[key, value], ids, flags,
                              attention={**attention, key: not value}))
    if has_d2t:
        result.append(Reading("d2t_dropped", "no d2t applied: draft ids read as target ids (vLLM's identity map)",
                              ids, flags, drop_d2t=True, attention=attention))
    for reading in list(result):
        if num_layers in reading.layer_ids:
            result.append(replace(reading, name=reading.name + "_final_post_norm", final_post_norm=True,
                                  text=reading.text + ", with the final-layer slot after the target's final norm "
                                  "instead of before"))
    return result


def capture_ids(all_readings: Sequence[Reading], num_layers: int) -> list[int]:
    """The aux ids to capture once so that every reading can be replayed, and no others (the final layer
    comes last anyway): the declared ids, one layer off either way, the target's defaults."""
    return sorted({k for r in all_readings for k in r.layer_ids if 0 < k < num_layers})


def as_variant(reading: Reading, captured_ids: Sequence[int], num_layers: int) -> Variant:
    """The reading as a Variant over samples captured at `captured_ids` + [num_layers]."""
    slot = {k: i for i, k in enumerate(captured_ids)} | {num_layers: len(captured_ids)}
    return Variant(reading.name, aux_slots=tuple(slot[k] for k in reading.layer_ids),
                   final_slot_post_norm=reading.final_post_norm, norm_flags=dict(reading.norm_flags),
                   drop_d2t=reading.drop_d2t, attention=dict(reading.attention))


def config_findings(config: Mapping[str, Any], *, num_layers: int, target_vocab_size: int, has_d2t: bool) -> list[dict]:
    """What a flat drafter config makes vLLM do wrong, read from the config alone: [{name, fault, text}]."""
    if is_dflash_config(dict(config)):  # ids and vocabulary as speculators writes them; its one trap is attention
        trained = dflash_trained_causal(dict(config))
        if trained == dflash_served_causal(dict(config)):
            return []
        return [{"name": "causal_flipped", "fault": True, "text": ATTENTION_TEXTS["causal", trained]}]
    findings = []
    read = vllm_read_aux_ids(dict(config))
    defaults = default_layer_ids(num_layers)
    if read["v1"] is None:
        findings.append({"name": "ids_missing", "fault": True,
                         "text": f"the config declares no aux ids: vLLM captures the target's defaults {defaults}"})
    elif read["v2"] is None:
        same = list(read["v1"]) == defaults
        findings.append({"name": "ids_only_in_eagle_config", "fault": not same,
                         "text": f"aux ids {read['v1']} only inside eagle_config: vLLM's model runner V2 (the "
                                 f"GPU default) does not read them and captures the target's defaults {defaults}"
                                 + (" (the same layers for this target)" if same else "")
                                 + "; write them at the top level as well"})
    draft_vocab = int(config.get("draft_vocab_size") or config.get("vocab_size") or target_vocab_size)
    if draft_vocab != target_vocab_size and not has_d2t:
        findings.append({"name": "d2t_missing", "fault": True,
                         "text": f"no d2t for a {draft_vocab}-token draft vocabulary (target "
                                 f"{target_vocab_size}): vLLM maps draft id k to target id k instead "
                                 "of the drafter's own map; write d2t and t2d into the folder"})
    return findings


def tolerance(predicted: Sequence[float | None], num_drafts: int | None) -> list[float]:
    n = max(int(num_drafts or 0), 1)
    return [TOLERANCE_FLOOR + TOLERANCE_SIGMAS * math.sqrt(max(p or 0.0, 0.0) * (1 - min(p or 0.0, 1.0)) / n)
            for p in predicted]


def _values(seq: Sequence[float | None] | None, width: int) -> list[float]:
    seq = list(seq or [])
    return [float(seq[i]) if i < len(seq) and seq[i] is not None else 0.0 for i in range(width)]


def _fmt(values: Sequence[float]) -> str:
    return "/".join(f"{v:.2f}" for v in values)


def short_positions(served: Sequence[float], predicted: Sequence[float], tol: Sequence[float]) -> list[int]:
    """Draft positions where served falls below predicted by more than the tolerance."""
    return [i for i, (a, b, t) in enumerate(zip(served, predicted, tol)) if a < b - t]


def served_agrees(served: Sequence[float | None], served_drafts: int | None, predicted: Sequence[float | None],
                  predicted_drafts: int | None) -> bool:
    """Served acceptance per position is nowhere short of predicted beyond the tolerance."""
    width = len(served)
    s, p = _values(served, width), _values(predicted, width)
    return not short_positions(s, p, tolerance(p, _drafts(served_drafts, predicted_drafts)))


def _drafts(served_drafts: int | None, predicted_drafts: int | None) -> int | None:
    counted = [x for x in (served_drafts, predicted_drafts) if x]
    return min(counted) if counted else None


def diagnose(served: Sequence[float | None], served_drafts: int | None, predictions: Mapping[str, Mapping[str, Any]],
             texts: Mapping[str, str], reference: str, findings: Sequence[Mapping[str, Any]] = (),
             engine: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The verdict: {status, passed, cause, cause_text, line, served, predicted, tolerance, candidates, ...}.

    `predictions`: replay summaries by reading name (reference included); `texts`: each reading's cause text;
    `engine`: the engine facts of the served run (eagle_pipeline.serve.engine_facts), named by an engine verdict.
    status: the module docstring's cases (docs/contracts.md, `diagnosis.status`).
    """
    ref = predictions[reference]
    width = len(served)
    s = _values(served, width)
    p = _values(ref.get("predicted_per_position_acceptance"), width)
    tol = tolerance(p, _drafts(served_drafts, ref.get("num_drafts")))
    candidates = {name: _values(r.get("predicted_per_position_acceptance"), width)
                  for name, r in predictions.items() if name != reference}
    out: dict[str, Any] = {"reference": reference, "served": s, "predicted": p, "tolerance": [round(t, 4) for t in tol],
                           "candidates": candidates, "findings": list(findings), "cause": None, "cause_text": None,
                           "engine": dict(engine or {})}
    faults = [f for f in findings if f["fault"]]
    gap = (f"served acceptance per position {_fmt(s)} is short of predicted {_fmt(p)} (tolerance {_fmt(tol)})")
    if short_positions(s, p, tol):
        def distance(name: str) -> float:
            return sum(abs(a - b) for a, b in zip(s, candidates[name]))

        reproducing = [name for name, c in candidates.items() if all(abs(a - b) <= t for a, b, t in zip(s, c, tol))]
        out["closest"] = min(candidates, key=distance, default=None)
        # Served acceptance indistinguishable from none is what every fault that breaks the drafter gives, the
        # engine's own among them: a reading that also accepts nothing is no evidence for itself.
        accepts_nothing = all(a <= t for a, t in zip(s, tol))
        if accepts_nothing:
            out["also_accepting_nothing"], reproducing = reproducing, []
        if reproducing:
            cause = min(reproducing, key=distance)
            out.update(status="config", cause=cause, cause_text=texts[cause], reproduced=True)
            line = f"{gap}; cause: {texts[cause]} (re-simulated {_fmt(candidates[cause])})"
        elif faults:
            out.update(status="config", cause=faults[0]["name"], cause_text=faults[0]["text"], reproduced=False)
            line = f"{gap}; no reading of the config reproduces it, and the config itself is at fault"
        else:
            out.update(status="engine", cause="engine", cause_text=engine_text(engine), reproduced=False)
            line = (f"{gap}, and no reading of the drafter's config reproduces it (ids off by one, default ids, norm "
                    "flags, d2t, final-layer norm" + (", RoPE interleave, softmax scale" if any(
                        name.startswith(("rope_interleave", "softmax_mscale")) for name in candidates) else "")
                    + " all replayed"
                    + ("; served accepts next to nothing, which tells no reading from an engine that computes the "
                       "drafter wrongly" if accepts_nothing else "") + f"): {out['cause_text']}")
    else:
        # A config fault comes first: without its map or its ids the replays' figures mean nothing either.
        cause, fit = (None, "") if faults else better_reading(predictions, reference)
        if cause:
            out.update(status="misdeclared", cause=cause, cause_text=texts[cause])
            line = (f"served {_fmt(s)} agrees with the drafter as its config declares it ({_fmt(p)}), but read "
                    f"otherwise it fits the target better{fit} and predicts {_fmt(candidates[cause])}; most likely "
                    f"cause: {texts[cause]}")
        else:
            if faults:
                out.update(status="config", cause=faults[0]["name"], cause_text=faults[0]["text"])
            else:
                out.update(status="agrees")
            line = f"served acceptance per position {_fmt(s)} agrees with predicted {_fmt(p)} (tolerance {_fmt(tol)})"
    if faults:
        line += "; config: " + "; ".join(f["text"] for f in faults)
    notes = [f["text"] for f in findings if not f["fault"]]
    if notes:
        line += "; note: " + "; ".join(notes)
    out["passed"] = out["status"] == "agrees"
    out["line"] = ("DIAGNOSIS OK: " if out["passed"] else "DIAGNOSIS FAIL: ") + line
    return out


# What an engine verdict suggests when no probe has run.
ENGINE_PROBE_HINT = ("list engine settings to try under serve.engine_variants (e.g. [{verifier.attention_backend: "
                     "TRITON_MLA, serve.drafter_attention_backend: TRITON_ATTN}, {verifier.model_runner: v1}, "
                     "{verifier.enforce_eager: true}]; docs/engines.md, \"Engine settings\") and rerun with --force: "
                     "each is served with the drafter until one serves as predicted")


def engine_text(engine: Mapping[str, Any] | None) -> str:
    """The engine verdict's cause: the engine computes the drafter otherwise, its suspects, and what to try."""
    suspects = (engine or {}).get("summary") or "the engine's settings were not found in its log"
    return ("the engine computes the drafter (or the target's states) differently from the replay; suspects for "
            f"this run: {suspects}; try: {ENGINE_PROBE_HINT}")


def with_probe(result: dict[str, Any], probe: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The verdict with the engine probe's outcome (eagle_pipeline.serve.engine_probe rows) added to its line."""
    if not probe:
        return result
    found = next((row for row in probe if row.get("agrees")), None)
    result = {**result, "engine_probe": [dict(row) for row in probe]}
    if found is not None:
        result["engine_variant"] = found["variant"]
        text = (f"engine variant {found['index']} ({found['text']}) serves as predicted "
                f"({_fmt(found['served'])}): set those keys in the config")
    else:
        tried = "; ".join(f"{row['index']} ({row['text']}): "
                          + (f"failed to start ({row['error']})" if row.get("error") else _fmt(row["served"]))
                          for row in probe)
        text = f"none of the {len(probe)} engine variants serves as predicted: {tried}"
    hint = "try: " + ENGINE_PROBE_HINT
    if result["status"] == "engine":
        result["cause_text"] = result["cause_text"].replace(hint, text)
        result["line"] = result["line"].replace(hint, text)
    else:
        result["line"] += f"; engine probe: {text}"
    return result


def _kl(summary: Mapping[str, Any]) -> float | None:
    value = summary.get("first_draft_kl")
    return None if value is None or not math.isfinite(value) else float(value)


def better_reading(predictions: Mapping[str, Mapping[str, Any]], reference: str) -> tuple[str | None, str]:
    """The alternative reading that fits clearly better than the reference, and how it compares, or (None, "").

    By first-draft KL where both readings have it (lower beyond FIT_MARGIN), else by mean acceptance length
    (higher beyond MISDECLARED_MARGIN); either way only a reading under which the drafter drafts
    (MIN_FIRST_ACCEPTANCE). Of several, the largest improvement; ties go to the earlier reading.
    """
    ref = predictions[reference]
    ref_kl, ref_length = _kl(ref), ref.get("predicted_mean_acceptance_length") or 0.0
    by_fit, by_length = {}, {}
    for name, summary in predictions.items():
        if name == reference or _values(summary.get("predicted_per_position_acceptance"), 1)[0] < MIN_FIRST_ACCEPTANCE:
            continue
        kl = _kl(summary)
        if ref_kl is not None and kl is not None:
            if ref_kl - kl > max(FIT_MARGIN * ref_kl, FIT_MARGIN_ABS):
                by_fit[name] = ref_kl - kl
        elif (summary.get("predicted_mean_acceptance_length") or 0.0) - ref_length > MISDECLARED_MARGIN:
            by_length[name] = summary["predicted_mean_acceptance_length"] - ref_length
    if by_fit:
        name = max(by_fit, key=by_fit.get)
        return name, f" (first-draft KL {_kl(predictions[name]):.4f} against {ref_kl:.4f} as declared)"
    if by_length:
        return max(by_length, key=by_length.get), ""
    return None, ""


def layer_convention(predictions: Mapping[str, Mapping[str, Any]], reference: str) -> dict[str, Any]:
    """Which numbering the drafter's declared ids were written in, from the replay at ids, ids - 1 and ids + 1.

    Best at the declared ids: vLLM/HF numbering; at ids + 1: SGLang/SpecForge numbering (id k there is
    layer k's output, HF index k + 1); at ids - 1: ids written one too high.
    """
    names = [name for name in (reference, "ids_minus_one", "ids_plus_one") if name in predictions]
    lengths = {name: predictions[name].get("predicted_mean_acceptance_length") for name in names}
    fits = {name: _kl(predictions[name]) for name in names}
    if names and all(v is not None for v in fits.values()):
        best = min(fits, key=fits.get)  # the best fit, as in better_reading
    elif any(v is not None for v in lengths.values()):
        best = max((k for k, v in lengths.items() if v is not None), key=lambda k: lengths[k])
    else:
        return {"convention": None, "mean_acceptance_length": lengths, "first_draft_kl": fits}
    convention = {reference: "vllm", "ids_plus_one": "sglang", "ids_minus_one": "one_too_high"}[best]
    return {"convention": convention, "mean_acceptance_length": lengths, "first_draft_kl": fits}
