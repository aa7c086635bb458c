"""The stage-06 report on disk: report.json (full precision), responses.jsonl, report.md and report.png."""

from __future__ import annotations

import io
import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Sequence

from eagle_pipeline import atomic
from eagle_pipeline.drafter.layouts import DRAFTER_MODES, drafter_mode
from eagle_pipeline.errors import BadInput
from eagle_pipeline.json_files import read_json_object
from eagle_pipeline.serve.baseline import kept_baseline
from eagle_pipeline.serve.spec_metrics import acceptance_problem

# The fields docs/contracts.md promises in report.json, with the types a reader may rely on.
REQUIRED_FIELDS = {"num_prompts": int, "num_speculative_tokens": int, "per_position_acceptance": list,
                   "tokens_per_s": dict}
# Each served mode's measurements in full (`measure.mode_record`; docs/contracts.md, "Stage 06: report.json").
SERVED_DIR = "served"
WORST_PROMPTS = 5
log = logging.getLogger(__name__)


def served_path(stage_dir: str | os.PathLike, mode: str) -> Path:
    return Path(stage_dir) / SERVED_DIR / f"{mode}.json"


def write_served(stage_dir: str | os.PathLike, inputs: dict, mode: str, record: dict) -> Path:
    path = served_path(stage_dir, mode)
    atomic.write_json(path, {"inputs": inputs, "mode": mode, "record": record})
    return path


def read_served(stage, inputs: dict, modes: Sequence[str], num_speculative_tokens: int,
                shaped_by: dict | None = None) -> dict[str, dict]:
    """The records of those `modes` that an earlier run of exactly these inputs served, by mode, in `stage`'s folder
    (docs/contracts.md, "Stage 06: report.json"; "none" from baseline/answers.json served with `shaped_by`)."""
    stage_dir = stage.dir
    found: dict[str, dict] = {}
    for mode in modes:
        path = served_path(stage_dir, mode)
        problem = "missing"
        if path.exists():
            try:
                kept = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                kept, problem = None, f"unreadable or torn ({e})"
            if isinstance(kept, dict) and kept.get("inputs") != inputs:
                problem = "recorded for other inputs"
            elif isinstance(kept, dict) and not stage.kept_whole(path):
                log.warning("%s: not as this stage wrote it (manifest.json's digest); serving %s again", path, mode)
                continue
            elif isinstance(kept, dict) or problem == "missing":
                problem = record_problem(kept.get("record") if isinstance(kept, dict) else None, num_speculative_tokens)
                if problem is None:
                    found[mode] = kept["record"]
                    continue
        record, source = _recorded_elsewhere(stage_dir, mode, shaped_by)
        if record is not None and record_problem(record, num_speculative_tokens) is None:
            log.warning("%s: %s; the %s measurements are taken from %s instead", path, problem, mode, source)
            stage.keep_file(write_served(stage_dir, inputs, mode, record))
            found[mode] = record
        elif path.exists():
            log.warning("%s: %s; serving %s again", path, problem, mode)
    return found


def record_problem(record: Any, num_speculative_tokens: int) -> str | None:
    """What is wrong with a served mode's record (None when nothing is): its shape, or an impossible acceptance."""
    if not isinstance(record, dict) or not isinstance(record.get("summary"), dict):
        return "holds no served measurements"
    texts, token_ids = record.get("texts"), record.get("token_ids")
    if not isinstance(texts, list) or not isinstance(token_ids, list) or len(texts) != len(token_ids):
        return "holds no texts and token ids per prompt"
    return acceptance_problem(record["summary"], num_speculative_tokens)


def _recorded_elsewhere(stage_dir: Path, mode: str, shaped_by: dict | None) -> tuple[dict | None, str]:
    """A mode's record rebuilt from the stage's other files, and where from; (None, "") when they lack it."""
    if mode == "none" and shaped_by is not None:
        kept = kept_baseline(stage_dir, shaped_by)
        if kept is not None:
            return ({"summary": kept.get("summary"), "texts": kept.get("texts"), "token_ids": kept.get("token_ids")},
                    str(Path(kept["dir"]) / "answers.json"))
    try:
        report = json.loads((stage_dir / "report.json").read_text())
        rows = [json.loads(line) for line in (stage_dir / "responses.jsonl").read_text().splitlines() if line.strip()]
        summary = report["modes"][mode]
        texts = [row["responses"][mode] for row in rows]
    except (OSError, ValueError, KeyError, TypeError):
        return None, ""
    if len(texts) != report.get("num_prompts"):
        return None, ""
    # The answers' ids are kept only for "none" (the replay reads them); the other modes' are not needed again.
    record = {"summary": summary, "texts": texts, "token_ids": [[None, None]] * len(texts)}
    if mode in DRAFTER_MODES and isinstance(report.get("engine"), dict):
        record["engine"] = report["engine"]
    return record, "report.json and responses.jsonl"


def per_prompt_acceptance(report: dict) -> list[dict]:
    """Served (vLLM's per-request metrics) and predicted (the replay) mean acceptance length per eval prompt."""
    modes = report.get("modes", {})
    served = (modes.get(drafter_mode(modes)) or {}).get("per_prompt") or []
    predicted = report.get("predicted_per_prompt_mean_acceptance_length") or []
    predicted_drafts = report.get("predicted_per_prompt_num_drafts") or []
    ids = report.get("prompt_ids") or []
    rows = []
    for i in range(max(len(served), len(predicted))):
        got = served[i] if i < len(served) else None
        rows.append({"index": i, "id": ids[i] if i < len(ids) else None,
                     "served_mean_acceptance_length": got and got["mean_acceptance_length"],
                     "served_num_drafts": got and got["num_drafts"],
                     "predicted_mean_acceptance_length": predicted[i] if i < len(predicted) else None,
                     "predicted_num_drafts": predicted_drafts[i] if i < len(predicted_drafts) else None})
    return rows


def read_report(path: str | os.PathLike) -> dict:
    """report.json as stage 06 wrote it; every way the file can be wrong is a BadInput naming it and the fix."""
    path = Path(path)
    fix = "rerun 06_serve_test.py with --force to measure again"
    if not path.is_file():
        raise BadInput(f"{path}: report is missing; {fix}")
    report = read_json_object(path, fix, what="report")
    for key, kind in REQUIRED_FIELDS.items():
        if not isinstance(report.get(key), kind) or isinstance(report.get(key), bool):
            raise BadInput(f"{path}: report lacks {key!r} (a {kind.__name__}); {fix}")
    length = report.get("mean_acceptance_length")
    if length is not None and (isinstance(length, bool) or not isinstance(length, (int, float))):
        raise BadInput(f"{path}: report's 'mean_acceptance_length' is not a number; {fix}")
    problem = acceptance_problem(report, report["num_speculative_tokens"])
    if problem:
        raise BadInput(f"{path}: {problem}; {fix}")
    return report


def format_number(value: Any, digits: int = 2) -> str:
    """A figure as the report prints it: rounded to `digits`, "-" when missing or NaN."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return "-" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value)


def format_speedup(value: float | None) -> str:
    """A speed-up as people read it: "1.33x", or "-" when there is nothing to compare with."""
    return "-" if value is None or math.isnan(value) else f"{value:.2f}x"


def render_report_md(report: dict) -> str:
    modes = report.get("modes", {})
    drafter = drafter_mode(modes)
    lines = [
        "# Stage 06: speculative decoding with vLLM",
        "",
        f"{report['num_prompts']} prompts, {report['num_speculative_tokens']} speculative tokens, "
        f"temperature {format_number(report.get('temperature'))}, max_tokens "
        f"{format_number(report.get('max_tokens'))}, concurrency {format_number(report.get('concurrency'))}.",
        "",
        f"## Headline ({drafter})",
        "",
        "| metric | value |",
        "|---|---|",
        f"| mean acceptance length | {format_number(report['mean_acceptance_length'])} |",
        f"| acceptance rate | {format_number(report['acceptance_rate'], 3)} |",
        f"| speedup vs no speculation | {format_speedup(report['speedup'])} |",
        f"| greedy output identical to no speculation | {format_number(report['greedy_match'])} |",
        "",
        "## Per mode",
        "",
        "| mode | output tokens | wall s | tokens/s | speedup | TPOT ms | TTFT ms | acceptance rate "
        "| mean acceptance length | server start s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in modes.items():
        speedup = 1.0 if name == "none" else report.get("speedup_by_mode", {}).get(name)
        lines.append(
            f"| {name} | {s['output_tokens']} | {format_number(s['wall_s'])} | "
            f"{format_number(s['tokens_per_s'])} | {format_speedup(speedup)} | {format_number(s['tpot_ms'])} "
            f"| {format_number(s['ttft_ms'])} | {format_number(s.get('acceptance_rate'), 3)} | "
            f"{format_number(s.get('mean_acceptance_length'))} | {format_number(s['server_start_s'], 1)} |"
        )
    predicted = report.get("predicted_per_position_acceptance")
    served = (modes.get(drafter) or {}).get("per_position_acceptance")
    if predicted and served:
        lines += ["", f"## Predicted offline vs served ({drafter})", "",
                  "The trained checkpoint replayed on the answers served without speculation, fed as vLLM feeds it "
                  "(eagle_pipeline/predict). Served far below predicted would mean that the engine serves the drafter "
                  "differently from how it was trained; the diagnosis below says whether it does.", "",
                  "| | mean acceptance length | " + " | ".join(f"position {i}" for i in range(len(served))) + " |",
                  "|---|---|" + "---|" * len(served),
                  f"| predicted | {format_number(report.get('predicted_mean_acceptance_length'))} | "
                  + " | ".join(format_number(v, 3) for v in predicted) + " |",
                  f"| served | {format_number(report.get('mean_acceptance_length'))} | "
                  + " | ".join(format_number(v, 3) for v in served) + " |"]
    engine = report.get("engine") or {}
    if engine.get("summary"):
        lines += ["", f"## Engine ({drafter}, as vLLM logged it)", "",
                  engine["summary"] + f" (log: {engine.get('log')})."]
    diagnosis = report.get("diagnosis")
    if diagnosis:
        lines += ["", "## Diagnosis", "", diagnosis["line"]]
        probe = diagnosis.get("engine_probe") or []
        if probe:
            lines += ["", "Engine variants served with the drafter (serve.engine_variants), until one serves as "
                      "predicted:", "", "| variant | settings | served per position | mean acceptance length | "
                      "predicted per position | serves as predicted |", "|---|---|---|---|---|---|"]
            for row in probe:
                served_cells = (f"did not start: {row['error']}" if row.get("error")
                                else "/".join(format_number(v, 2) for v in row.get("served") or []))
                lines.append(f"| {row['index']} | {row['text']} | {served_cells} | "
                             f"{format_number(row.get('mean_acceptance_length'))} | "
                             f"{'/'.join(format_number(v, 2) for v in row.get('predicted') or [])} | "
                             f"{'yes' if row.get('agrees') else 'no'} |")
        convention = (diagnosis.get("layer_convention") or {}).get("convention")
        if convention:
            lines += ["", f"Layer convention of the drafter's ids (best fit at ids, ids - 1, ids + 1): {convention}."]
        readings = report.get("prediction_readings") or {}
        if readings:
            lines += ["",
                      "Every reading replayed (first-draft KL: training's loss at draft position 0 on these answers; "
                      "the reading the drafter was trained under fits best):", "",
                      "| reading | mean acceptance length | per position | first-draft KL |", "|---|---|---|---|"]
            for name, r in readings.items():
                per_position = "/".join(format_number(v, 2) for v in r.get("predicted_per_position_acceptance") or [])
                lines.append(f"| {name} | {format_number(r.get('predicted_mean_acceptance_length'))} "
                             f"| {per_position} | {format_number(r.get('first_draft_kl'), 4)} |")
    prompts = [row for row in report.get("per_prompt") or [] if row["served_mean_acceptance_length"] is not None]
    if prompts:
        worst = sorted(prompts, key=lambda row: (row["served_mean_acceptance_length"], row["index"]))[:WORST_PROMPTS]
        lines += ["",
                  f"## Worst prompts ({drafter}, served per request beside the replay; {len(worst)} of {len(prompts)})",
                  "",
                  "Served: vLLM's per-request metrics; predicted: the replay of the same "
                  "answer, which leaves out its last drafts (fewer than the speculative "
                  "tokens left to verify). report.json `per_prompt` has every prompt.",
                  "", "| prompt | served mean acceptance length | drafts | predicted | drafts |",
                  "|---|---|---|---|---|"]
        for row in worst:
            lines.append(f"| {row['id'] if row['id'] is not None else row['index']} "
                         f"| {format_number(row['served_mean_acceptance_length'])} "
                         f"| {format_number(row['served_num_drafts'])} | "
                         f"{format_number(row['predicted_mean_acceptance_length'])} "
                         f"| {format_number(row['predicted_num_drafts'])} |")
    spec_modes = [name for name, s in modes.items() if s.get("per_position_acceptance")]
    if spec_modes:
        width = max(len(modes[name]["per_position_acceptance"]) for name in spec_modes)
        lines += ["", "## Acceptance per draft position (accepted / drafts)", "",
                  "| position | " + " | ".join(spec_modes) + " |",
                  "|---|" + "---|" * len(spec_modes)]
        for pos in range(width):
            cells = []
            for name in spec_modes:
                values = modes[name]["per_position_acceptance"]
                cells.append(format_number(values[pos], 3) if pos < len(values) else "-")
            lines.append(f"| {pos} | " + " | ".join(cells) + " |")
    mismatches = report.get("greedy_mismatches") or {}
    if mismatches:
        lines += ["", "## Greedy check (texts compared with no speculation)", ""]
        for name, indices in mismatches.items():
            lines.append(f"- {name}: " + ("identical on every prompt" if not indices
                                          else f"{len(indices)} prompt(s) differ: {indices}"))
        if any(mismatches.values()):
            lines += ["", "Speculative decoding verifies several positions in one forward pass, which rounds "
                      "differently from one-token decoding; in bf16 a near-tied logit can flip and the texts "
                      "then part ways. A few differing prompts in bf16 are expected; serving in float32 "
                      "checks exactness (measured on SmolLM2-135M: bf16 1 of 3 prompts differed, float32 none)."]
    plan = report.get("serving_plan")
    if plan:
        lines += render_plan_md(plan)
    return "\n".join(lines) + "\n"


def _spread(values: Sequence[float | None]) -> str:
    """Per-request acceptance at one level: median [min-max] over the requests that drafted."""
    got = sorted(v for v in values if v is not None)
    if not got:
        return "-"
    return f"{got[len(got) // 2]:.2f} [{got[0]:.2f}-{got[-1]:.2f}]"


def render_plan_md(plan: dict) -> list[str]:
    """report.md's load sections, from report.json's `serving_plan`, ending with its `vllm serve` command."""
    levels = plan["levels"]
    speedups = plan.get("speedup_by_concurrency") or {}
    acceptance = {row["concurrency"]: row for row in plan.get("acceptance_by_concurrency") or []}
    estimate = {row["concurrency"]: row for row in plan.get("estimate") or []}
    confirmed = {row["concurrency"]: row for row in ((plan.get("confirmed") or {}).get("levels") or [])}
    fastest = {row["concurrency"]: row["fastest"] for row in plan.get("method_by_concurrency") or []}
    k_max = plan["num_speculative_tokens"]
    names = [name for name in ("ngram", *DRAFTER_MODES) if name in speedups]
    drafter = drafter_mode(names)
    lines = ["", "## Acceptance and speed-up across load", "",
             f"Each server answered the prompts at each concurrency level in turn. Speed-up: output tokens/s over no "
             f"speculation's at the same level; {drafter} drafts k_max = {k_max}. Chosen k and its speed-up are "
             f"estimates from the measured per-position acceptance and time per output token (eagle_pipeline/serve/"
             f"plan.py); the confirmed speed-up is the chosen setting served.", "",
             "| concurrency | " + " | ".join(f"{name} speed-up" for name in names)
             + f" | {drafter} mean acceptance length | per request: median [min-max] | chosen k | estimated speed-up "
               "| confirmed speed-up | confirmed draft tokens per draft | fastest |",
             "|---|" + "---|" * len(names) + "---|---|---|---|---|---|---|"]
    for i, level in enumerate(levels):
        row, est, conf = acceptance.get(level) or {}, estimate.get(level) or {}, confirmed.get(level) or {}
        lines.append(f"| {level} | " + " | ".join(format_speedup(speedups[name][i]) for name in names)
                     + f" | {format_number(row.get('mean_acceptance_length'))} "
                       f"| {_spread(row.get('per_request') or [])} "
                       f"| {format_number(est.get('k'))}"
                       + (f" (k = {est['withdrawn_k']} served slower)" if est.get("withdrawn_k") else "")
                       + f" | {format_speedup(est.get('estimated_speedup'))} "
                       f"| {format_speedup(conf.get('speedup'))} "
                       f"| {format_number(conf.get('draft_tokens_per_draft'))} | {fastest.get(level, '-')} |")
    findings = plan.get("findings") or []
    lines += ["", "Acceptance across load: " + ("no collapse found." if not findings else "")]
    lines += [f"- FINDING: {finding['text']}" for finding in findings]
    by = (plan.get("confirmed") or {}).get("by")
    mismatches = (plan.get("confirmed") or {}).get("greedy_mismatches")
    lines += ["", "## Serving command", "",
              f"Schedule (`num_speculative_tokens_per_batch_size`, [batch_from, batch_to, k]): {plan.get('schedule')}"
              + (f"; confirmed by the {by} run" if by else "") + "."]
    if mismatches:
        lines.append(f"Greedy texts of the confirming run differ from no speculation's on prompts {mismatches}.")
    lines += [plan.get("note") or "", "", "```bash", plan["command"], "```"]
    return lines


def render_report_png(report: dict) -> bytes:
    # Figure + Agg canvas directly: no pyplot, so no global backend state and no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    modes = report.get("modes", {})
    plan = report.get("serving_plan")
    fig = Figure(figsize=(10, 8 if plan else 4), dpi=100)
    FigureCanvasAgg(fig)
    if plan:
        (left, right), (load_left, load_right) = fig.subplots(2, 2)
        _plot_load(plan, load_left, load_right)
    else:
        left, right = fig.subplots(1, 2)

    spec_modes = [name for name, s in modes.items() if s.get("per_position_acceptance")]
    if spec_modes:
        width = 0.8 / len(spec_modes)
        positions = max(len(modes[name]["per_position_acceptance"]) for name in spec_modes)
        for j, name in enumerate(spec_modes):
            values = modes[name]["per_position_acceptance"]
            bars = left.bar([i + j * width for i in range(len(values))], values, width=width, label=name)
            left.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=8)
            predicted = report.get("predicted_per_position_acceptance")
            if name in DRAFTER_MODES and predicted:  # the offline replay's figure on top of the served bar
                left.scatter([i + j * width for i in range(len(predicted))], predicted, marker="_", s=400,
                             color="black", zorder=3, label=f"{name} predicted offline")
        # Centre each position's label under its group of bars.
        left.set_xticks([i + width * (len(spec_modes) - 1) / 2 for i in range(positions)],
                        [str(i) for i in range(positions)])
        left.legend()
    else:
        left.text(0.5, 0.5, "no speculative mode measured", ha="center", va="center", transform=left.transAxes)
    left.set_ylim(0, 1)
    left.set_xlabel("draft position")
    left.set_ylabel("accepted / drafts")
    left.set_title("Acceptance per draft position")

    names = list(modes)
    rates = [modes[n]["tokens_per_s"] or 0.0 for n in names]
    bars = right.bar(names, rates, color=["tab:gray" if n == "none" else "tab:blue" for n in names])
    right.bar_label(bars, labels=[f"{r:.1f}" for r in rates])
    right.set_ylabel("output tokens / s")
    right.set_title(f"Throughput (concurrency {format_number(report.get('concurrency'))})")
    fig.tight_layout()

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    return buffer.getvalue()


def _plot_load(plan: dict, speed, acceptance) -> None:
    """Speed-up over no speculation against concurrency, and each request's acceptance at each level."""
    levels = plan["levels"]
    speedups = plan.get("speedup_by_concurrency") or {}
    speed.axhline(1.0, color="tab:gray", linestyle=":", label="none")
    styles = {"ngram": ("tab:green", "-", "n-gram"),
              **{mode: ("tab:blue", "-", f"{mode} k={plan['num_speculative_tokens']}") for mode in DRAFTER_MODES},
              "schedule": ("tab:red", "-", "schedule (its confirming run)")}
    for name, (color, style, label) in styles.items():
        points = [(c, v) for c, v in zip(levels, speedups.get(name) or []) if v is not None]
        if points:
            speed.plot(*zip(*points), marker="o", color=color, linestyle=style, label=label)
    estimated = [(row["concurrency"], row["estimated_speedup"]) for row in plan.get("estimate") or []
                 if row.get("estimated_speedup") is not None]
    if estimated:
        speed.plot(*zip(*estimated), marker="x", color="tab:red", linestyle="--", label="chosen k (estimate)")
    speed.set_xscale("log", base=2)
    speed.set_xticks(levels, [str(c) for c in levels])
    speed.set_xlabel("concurrency (requests in flight)")
    speed.set_ylabel("output tokens/s over no speculation")
    speed.set_title("Speed-up against load")
    speed.legend(fontsize=8)
    rows = plan.get("acceptance_by_concurrency") or []
    for i, row in enumerate(rows):
        values = [v for v in row.get("per_request") or [] if v is not None]
        acceptance.scatter([i] * len(values), values, alpha=0.5, color="tab:blue", s=12)
        if row.get("mean_acceptance_length") is not None:
            acceptance.scatter([i], [row["mean_acceptance_length"]], marker="_", s=400, color="black")
    for finding in plan.get("findings") or []:
        if finding["concurrency"] in levels:
            acceptance.axvline(levels.index(finding["concurrency"]), color="tab:red", alpha=0.3)
    acceptance.set_xticks(range(len(rows)), [str(row["concurrency"]) for row in rows])
    acceptance.set_xlabel("concurrency")
    acceptance.set_ylabel("mean acceptance length")
    # Dots: each request; bar: all drafts of the level; a red band: a finding at that level.
    acceptance.set_title(f"{drafter_mode(plan.get('speedup_by_concurrency') or {})} acceptance per request")


def write_report(out_dir: str | os.PathLike, report: dict, prompts: Sequence[list[dict]] | None = None) -> dict:
    """Write report.json (without the per-prompt texts and token ids), report.md, report.png, and when prompts are
    given responses.jsonl (per prompt its messages and each mode's text); {name: path} of what was written."""
    out_dir = Path(out_dir)
    paths = {name: out_dir / name for name in ("report.json", "report.md", "report.png")}
    atomic.write_json(paths["report.json"], {k: v for k, v in report.items() if k not in ("texts", "token_ids")})
    atomic.write_text(paths["report.md"], render_report_md(report))
    atomic.write_bytes(paths["report.png"], render_report_png(report))
    if prompts is not None and "texts" in report:
        paths["responses.jsonl"] = out_dir / "responses.jsonl"
        texts = report["texts"]
        lines = [json.dumps({"index": i, "messages": messages, "responses": {mode: texts[mode][i] for mode in texts}},
                            ensure_ascii=False) for i, messages in enumerate(prompts)]
        atomic.write_text(paths["responses.jsonl"], "\n".join(lines) + "\n")
    return paths
