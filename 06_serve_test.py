"""Stage 06: serve target + drafter with `vllm serve` and measure what speculative decoding buys.

The held-out evaluation prompts (never used in training) go through vLLM's OpenAI server three times,
one server at a time: with the trained drafter (EAGLE-3), without speculation, and with n-gram
speculation; each server answers them at every level of `serve.concurrency` in turn. Acceptance comes from the
server's Prometheus counters (`vllm:spec_decode_*`) and each request's own metrics; at temperature 0 the drafter
must not change the text, so every differing prompt is reported. From the levels the stage chooses
`num_speculative_tokens` per batch size (k = 0 where speculation loses), serves that schedule once to confirm it
(eagle_pipeline/serve/plan.py; unconfirmed if its server fails), and ends report.md with the `vllm serve` command.
The stage fails (exit 1) when the mean acceptance length is below `serve.min_acceptance_length`.

Embedded default (CPU, a few minutes):
    python 06_serve_test.py --config configs/tiny.yaml
Full scale (8 GPUs):
    python 06_serve_test.py --config configs/kimi-k2.5-10k.yaml

Output in <data_root>/<run_name>/06_serve_test/: report.json, report.md, report.png (acceptance per
position, tokens/s per mode, speed-up and per-request acceptance against concurrency), responses.jsonl,
served/<mode>.json (each mode's measurements in full; served/schedule.json the confirming run), baseline/ (the
no-speculation answers and their captured states), logs/server-<mode>.log, manifest.json.

Each mode's measurements are written as soon as it is served (served/<mode>.json, and baseline/answers.json for
the answers without speculation), and report.json and report.md before the offline prediction starts: a rerun
of the same inputs serves only the modes still missing (none after a failed prediction, which it retries).
When the diagnosis names the engine, `serve.engine_variants` are served with the drafter in turn
(logs/engine-variant-<n>/) until one serves as predicted.
"""

import json
import sys

from eagle_pipeline.capture import capture_memory_line
from eagle_pipeline.chat_template import chat_template_kwargs
from eagle_pipeline.drafter.folder import check_weights_whole, read_config
from eagle_pipeline.drafter.layouts import drafter_mode, weight_files
from eagle_pipeline.errors import BadInput
from eagle_pipeline.fingerprint import model_dir_fingerprint, value_fingerprint
from eagle_pipeline.layer_ids import default_layer_ids, vllm_read_aux_ids
from eagle_pipeline.plan.engines import served_modes
from eagle_pipeline.plan.preconditions import speculation_warnings
from eagle_pipeline.plan.rehearsal import before_first_load, dry_run_lines
from eagle_pipeline.prompts import load_prompts
from eagle_pipeline.samples import planned_sample_layout
from eagle_pipeline.serve.baseline import (
    BASELINE_DIR,
    baseline_states,
    kept_baseline,
    load_baseline,
    save_baseline_answers,
    save_baseline_states,
)
from eagle_pipeline.serve.engine_probe import describe, probe_engine, variant_config
from eagle_pipeline.serve.measure import measure_modes
from eagle_pipeline.serve.plan import (
    SCHEDULE_MODE,
    plan_serving,
    plan_speculative_config,
    served_by,
    serving_plan,
    sweep_plan_line,
)
from eagle_pipeline.serve.report import (
    SERVED_DIR,
    format_speedup,
    per_prompt_acceptance,
    read_report,
    read_served,
    render_report_md,
    write_report,
    write_served,
)
from eagle_pipeline.serve.server import ServerFailed, check_port_free
from eagle_pipeline.stage import (
    Stage,
    Start,
    is_complete,
    main,
    not_run_yet_note,
    require_complete,
    require_sample_layout,
    upstream_fingerprint,
)
from eagle_pipeline.verifier import Verifier


def verdict(report: dict, floor: float) -> tuple[bool, str]:
    length = report.get("mean_acceptance_length") or 1.0
    diagnosis = report.get("diagnosis")
    if diagnosis is not None and not diagnosis["passed"]:
        return False, (f"FAIL: the engine does not serve the drafter as it was trained (mean acceptance length "
                       f"{length:.2f}, predicted {report.get('predicted_mean_acceptance_length') or 0:.2f}): "
                       f"{diagnosis['cause_text'] or 'cause unknown'}")
    if length < floor:
        return False, (f"FAIL: mean acceptance length {length:.2f} is below serve.min_acceptance_length {floor:.2f}: "
                       f"the drafter does not pay for itself; train on more samples or epochs")
    return True, (f"PASS: mean acceptance length {length:.2f} >= {floor:.2f}, "
                  f"speed-up {format_speedup(report.get('speedup'))}")


def run(stage: Stage, dry_run: bool) -> None:
    cfg = stage.cfg
    s = cfg.serve
    if s.port is not None and not dry_run:
        check_port_free(s.port)
    # A drafter from elsewhere (serve.drafter) needs none of stages 02-05: its config says its ids and flags.
    foreign = s.drafter is not None
    if foreign:
        drafter_dir = cfg.resolve_path(s.drafter)  # a folder with a config.json (eagle_pipeline/plan/preconditions.py)
        # Read in full once, dry run too: a torn or NaN drafter is named here, not after three server starts.
        check_weights_whole(drafter_dir, "serve.drafter")
        converted = None
    else:
        converted = None if dry_run and not is_complete(cfg, 5) else require_complete(cfg, 5)
        drafter_dir = cfg.stage_dir("05_convert") / "vllm"
    eval_path = cfg.resolve_path(cfg.data.eval_prompts)
    prompts = load_prompts(eval_path, cfg.data.prompt_field, "data.eval_prompts")[: cfg.data.num_eval_prompts]
    train_texts = {json.dumps(p["messages"]) for p in load_prompts(cfg.resolve_path(cfg.data.prompts),
                                                                   cfg.data.prompt_field, "data.prompts")}
    overlap = [p["id"] for p in prompts if json.dumps(p["messages"]) in train_texts]
    if overlap and not foreign:
        raise BadInput(f"data.eval_prompts: {len(overlap)} evaluation prompts (e.g. {overlap[0]}) "
                       "also appear in data.prompts; held-out prompts must never be trained on")
    modes = served_modes(cfg)

    if dry_run:
        if s.baseline:  # its files read as the run reads them: a torn one is named before any serving
            load_baseline(cfg.resolve_path(s.baseline), {})
        print(f"stage 06: serve {cfg.verifier.path} with modes {modes}, "
              f"{len(prompts)} held-out prompts from {eval_path}")
        if converted is None and not foreign:
            print(not_run_yet_note(cfg, 5))
        print(f"  drafter {drafter_dir}, {s.num_speculative_tokens} speculative tokens, temperature "
              f"{s.temperature}, concurrency {s.concurrency}, "
              f"tensor_parallel={cfg.verifier.tensor_parallel_size}; floor {s.min_acceptance_length}"
              + (f"; no-speculation answers from {s.baseline}" if s.baseline else ""))

        print(sweep_plan_line(s.concurrency_levels, modes, len(prompts), s.max_tokens, s.confirm_schedule, cfg.device,
                              configured=bool(s.num_speculative_tokens_per_batch_size)))
        if s.num_speculative_tokens_per_batch_size:
            print(f"  schedule to confirm (serve.num_speculative_tokens_per_batch_size): "
                  f"{[list(entry) for entry in s.num_speculative_tokens_per_batch_size]}")
        if s.predict:
            print_replay_capture_plan(cfg, foreign, drafter_dir)
        for warning in speculation_warnings(cfg):
            print(f"warning: {warning}")
        if s.engine_variants:
            print(f"  engine variants to serve ({s.probe_engine}): "
                  + "; ".join(f"{i} {describe(v)}" for i, v in enumerate(s.engine_variants, 1)))
        return
    # Every input is checked before the manifest is written: a refusal leaves the stage folder as it was.
    if s.predict and not foreign:  # the replay reads stage 02's layout and stage 04's best checkpoint
        require_sample_layout(cfg)
        require_complete(cfg, 4)
    verifier = Verifier.from_config(cfg)
    template_kwargs = chat_template_kwargs(verifier.chat_template(), cfg.generation.reasoning,
                                           cfg.generation.chat_template_kwargs)
    # What shapes the no-speculation answers: a reused baseline must match all of it.
    shaped_by = {"verifier": verifier.fingerprints()["verifier"], "eval_prompts": value_fingerprint(prompts),
                 "max_tokens": s.max_tokens, "temperature": s.temperature, "seed": cfg.seed,
                 "chat_template_kwargs": template_kwargs, "dtype": cfg.verifier.dtype}
    inputs = {
        "drafter": model_dir_fingerprint(drafter_dir) if foreign else upstream_fingerprint(converted),
        "drafter_weights": model_dir_fingerprint(drafter_dir) if foreign else converted["output_fingerprint"],
        "eval_prompts": shaped_by["eval_prompts"],
        "serve": value_fingerprint(s.model_dump(mode="json", exclude={"min_acceptance_length", "port",
                                                                      "startup_timeout_s", "confirm_schedule"})),
        "verifier": shaped_by["verifier"],
        "chat_template_kwargs": template_kwargs,
    }
    if not foreign:  # the draft vocabulary now in stage 03, which stage 05's drafter must have been built with
        inputs["d2t"] = require_complete(cfg, 3)["output_fingerprint"]
    baseline = load_baseline(cfg.resolve_path(s.baseline), shaped_by) if s.baseline else None
    # README's cheap rerun points serve.baseline at this very folder, and its changed input needs --force: the
    # baseline it reads is kept, not deleted with the rest.
    own_baseline = s.baseline is not None and cfg.resolve_path(s.baseline).resolve() == stage.dir.resolve()
    if stage.begin(inputs, keep=(BASELINE_DIR,) if own_baseline else (),
                   before_writing=lambda: before_first_load(cfg, 6)) is Start.ALREADY_COMPLETE:
        report = read_report(stage.dir / "report.json")
        ok, message = verdict(report, s.min_acceptance_length)
        print(f"stage 06 already complete for these inputs: {stage.dir}\n{message}")
        if report.get("diagnosis"):
            print(report["diagnosis"]["line"])
        if not ok:
            sys.exit(1)
        return

    messages = [p["messages"] for p in prompts]
    served = read_served(stage, inputs, modes, s.num_speculative_tokens, shaped_by if baseline is None else None)
    missing = [mode for mode in modes if mode not in served]
    if not missing:
        print(f"stage 06: the served measurements of these inputs are in {stage.dir / SERVED_DIR} (an earlier run "
              f"stopped after serving): predicting without serving again")
    elif served:
        print(f"stage 06: {', '.join(served)} served by an earlier run of these inputs ({stage.dir / SERVED_DIR}): "
              f"serving {', '.join(missing)} only")

    def keep_served(mode: str, record: dict) -> None:
        stage.keep_file(write_served(stage.dir, inputs, mode, record))
        if mode == "none":
            save_baseline_answers(stage.dir, shaped_by, record)

    if baseline is not None:  # the kept answers without speculation go into the report as that mode's record
        served, modes = {"none": baseline, **served}, ["none", *modes]
    report = measure_modes(cfg, verifier.path, drafter_dir, messages, modes, stage.dir / "logs", template_kwargs,
                           measured=served, on_measured=keep_served)
    if baseline is None and kept_baseline(stage.dir, shaped_by) is None:  # recovered from elsewhere
        save_baseline_answers(stage.dir, shaped_by, served["none"])
    if baseline is not None:
        report["baseline"] = baseline["dir"]
    report["prompt_ids"] = [p["id"] for p in prompts]
    report["serving_plan"], confirmed_now = plan_and_confirm(cfg, stage, inputs, verifier.path, drafter_dir, messages,
                                                             template_kwargs, report)
    if missing or confirmed_now:
        # Written before predicting: what was served survives a failed prediction.
        report["per_prompt"] = per_prompt_acceptance(report)
        write_report(stage.dir, {**report, "verdict": "served; prediction pending" if s.predict else None}, messages)
    if s.predict:
        # States an earlier run of these inputs captured and kept (it stopped after capturing) are reused too.
        kept = kept_baseline(stage.dir, shaped_by) if baseline is None else None
        captured, prediction_report = predict_and_diagnose(cfg, stage, verifier, foreign, drafter_dir, report,
                                                           baseline or kept)
        report.update(prediction_report)
        if baseline is None and captured is not None:
            save_baseline_states(stage.dir, captured)
        diagnosis = report.get("diagnosis")
        if diagnosis is not None and should_probe(s, diagnosis):
            report["diagnosis"] = probe(cfg, verifier.path, drafter_dir, messages, stage.dir / "logs", template_kwargs,
                                        report, diagnosis)
    report["per_prompt"] = per_prompt_acceptance(report)
    ok, message = verdict(report, s.min_acceptance_length)
    report["verdict"] = message
    write_report(stage.dir, report, messages)

    counts = {k: report.get(k) for k in ("num_prompts", "num_speculative_tokens", "mean_acceptance_length",
                                         "acceptance_rate",
                                         "per_position_acceptance", "tokens_per_s", "speedup", "greedy_match",
                                         "predicted_mean_acceptance_length", "predicted_per_position_acceptance")}
    diagnosis = report.get("diagnosis")
    counts["diagnosis"] = None if diagnosis is None else {k: diagnosis.get(k) for k in ("status", "cause",
                                                                                        "engine_variant")}
    plan = report["serving_plan"]
    confirmed_rows = (plan["confirmed"] or {}).get("levels", [])
    counts["serving_plan"] = {"concurrency_levels": plan["levels"], "kind": plan["kind"], "schedule": plan["schedule"],
                              "confirmed_speedup": [row["speedup"] for row in confirmed_rows],
                              "findings": [finding["kind"] for finding in plan["findings"]]}
    counts["passed"] = ok
    stage.finish(counts, output_fingerprint=value_fingerprint(counts))
    print(render_report_md(report))
    print(message)
    if diagnosis is not None:
        print(diagnosis["line"])
    for finding in plan["findings"]:
        print(f"warning: {finding['text']}")
    if not report.get("greedy_match"):
        print("warning: greedy outputs differ with the drafter on prompts "
              f"{report.get('greedy_mismatches')}; see responses.jsonl")
    if not ok:
        sys.exit(1)


def plan_and_confirm(cfg, stage: Stage, inputs: dict, target, drafter_dir, messages, template_kwargs,
                     report: dict) -> tuple[dict, bool]:
    """The serving plan chosen from the served levels, its schedule served once to confirm it unless a mode already
    served it (eagle_pipeline/serve/plan.py); (report.json's `serving_plan`, served now)."""
    s = cfg.serve
    plan = plan_serving(report["modes"], s.concurrency_levels, s.num_speculative_tokens,
                        s.num_speculative_tokens_per_batch_size)
    drafter = drafter_mode(report["modes"])
    spec = plan_speculative_config(plan, report["modes"][drafter]["speculative_config"])
    confirmed_by, confirmed, served_now = served_by(plan, s.num_speculative_tokens, drafter), None, False
    if confirmed_by is not None:
        confirmed = {"summary": report["modes"].get(confirmed_by), "texts": report["texts"].get(confirmed_by)}
    elif spec is not None and s.confirm_schedule:
        schedule_inputs = {**inputs, "speculative_config": spec}
        kept = read_served(stage, schedule_inputs, [SCHEDULE_MODE], plan["k"])
        if SCHEDULE_MODE in kept:
            print(f"stage 06: the schedule was confirmed by an earlier run of these inputs ({stage.dir / SERVED_DIR})")
            confirmed = kept[SCHEDULE_MODE]
        else:
            print(f"stage 06: serving the chosen setting once to confirm it: {json.dumps(spec)}")
            def keep(mode: str, record: dict) -> None:
                stage.keep_file(write_served(stage.dir, schedule_inputs, mode, record))

            try:
                served = measure_modes(cfg, target, drafter_dir, messages, [SCHEDULE_MODE], stage.dir / "logs",
                                       template_kwargs, on_measured=keep, num_speculative_tokens=plan["k"],
                                       schedule=spec.get("num_speculative_tokens_per_batch_size"))
                confirmed = {"summary": served["modes"][SCHEDULE_MODE], "texts": served["texts"][SCHEDULE_MODE]}
                served_now = True
            except ServerFailed as error:  # what was measured stands: the plan goes on unconfirmed and says why
                confirmed = {"failed": f"its server failed to start: {stage.dir / 'logs' / 'server-schedule.log'}"}
                print(f"warning: the chosen setting is not confirmed: {error}")
        confirmed_by = SCHEDULE_MODE

    return serving_plan(plan, report, cfg, spec, confirmed_by, confirmed, target), served_now


def should_probe(s, diagnosis: dict) -> bool:
    if not s.engine_variants or s.probe_engine == "never":
        return False
    return s.probe_engine == "always" or diagnosis["status"] == "engine"


def probe(cfg, target, drafter_dir, messages, log_dir, template_kwargs, report: dict, diagnosis: dict) -> dict:
    """The engine variants served with the drafter in turn; the verdict with what they showed."""
    from eagle_pipeline.predict.diagnose import with_probe

    drafter = drafter_mode(report["modes"])

    def serve_variant(index: int, variant) -> dict:
        folder = log_dir / f"engine-variant-{index}"
        # Acceptance is what a variant is served for: the headline level alone.
        served = measure_modes(variant_config(cfg, variant), target, drafter_dir, messages, [drafter], folder,
                               template_kwargs, levels=cfg.serve.concurrency_levels[:1])
        return {**served["modes"][drafter], "engine": served["engine"], "log": str(folder / f"server-{drafter}.log")}

    rows = probe_engine(cfg.serve.engine_variants, serve_variant, report.get("predicted_per_position_acceptance") or [],
                        report.get("predicted_num_drafts"))
    return with_probe(diagnosis, rows)


def print_replay_capture_plan(cfg, foreign: bool, drafter_dir) -> None:
    """The dry run's line on the replay's capture engine: the layers it captures and their memory."""
    from eagle_pipeline.predict.diagnose import capture_ids, readings

    verifier = Verifier.from_config(cfg)
    num_layers = verifier.num_layers
    if foreign:
        ids = (vllm_read_aux_ids(read_config(drafter_dir) or {})["v1" if cfg.device == "cpu" else "v2"]
               or default_layer_ids(num_layers))
    else:
        ids = planned_sample_layout(cfg, num_layers, verifier.hidden_size, verifier.vocab_size).layer_ids
    captured = capture_ids(readings(ids, num_layers, {}, has_d2t=False), num_layers)
    print(f"  replay: captures layers {captured} + final layer {num_layers} (every reading's ids) of the "
          f"no-speculation answers, in one engine sized for the longest answer")
    # The longest prompt and answer stay below verifier.max_model_len.
    print(capture_memory_line(cfg, len(captured) + 1, verifier.hidden_size,
                              cfg.verifier.max_model_len - 1) + " (at most)")


def predict_and_diagnose(cfg, stage: Stage, verifier, foreign: bool, drafter_dir, report: dict, baseline):
    """The replay under every reading of the drafter, and the verdict with a cause; (states captured now, or None
    where `baseline`'s kept states held every layer the readings need; fields)."""
    from eagle_pipeline.predict.served import (
        capture_states,
        diagnosis,
        folder_plan,
        predict_served,
        served_checkpoint,
        trained_plan,
    )
    from eagle_pipeline.state_meaning import check_replay_states, target_head_for

    s = cfg.serve
    scratch = stage.dir / "prediction_scratch"
    num_layers = verifier.num_layers
    if foreign:
        plan = folder_plan(drafter_dir, verifier.path, num_layers, verifier.vocab_size, cfg.device, scratch,
                           s.num_speculative_tokens)
    else:
        _, layout = require_sample_layout(cfg)
        from eagle_pipeline.predict.diagnose import config_findings

        findings = config_findings(read_config(drafter_dir) or {}, num_layers=num_layers,
                                   target_vocab_size=verifier.vocab_size,
                                   has_d2t="d2t" in weight_files(drafter_dir))
        plan = trained_plan(served_checkpoint(cfg, require_complete(cfg, 4)), layout.layer_ids, num_layers, findings)
    answered = [i for i, (p, c) in enumerate(report["token_ids"]["none"]) if p is not None and c is not None]
    pairs = [(list(p), list(c)) for p, c in (report["token_ids"]["none"][i] for i in answered)]
    captured: list = []
    checked: dict = {}

    def capture(layer_ids):
        stored = baseline_states(baseline, layer_ids) if baseline is not None else None
        where = f"the states kept in {baseline['dir']}" if stored is not None else "the replay's capture"
        if stored is None:
            stored = capture_states(cfg, verifier.path, layer_ids, num_layers, [p + c for p, c in pairs],
                                    scratch), list(layer_ids)
            captured.append(stored)
        # Shape is checked by the capture; meaning here, before any replay trusts the states.
        checked.update(check_replay_states(stored[0], pairs, lambda: target_head_for(verifier), stored[1], num_layers,
                                           greedy=s.temperature == 0, where=where))
        return stored

    print(f"stage 06: predicting acceptance offline on the {len(pairs)} answers served without speculation")
    prediction = predict_served(plan, report["token_ids"]["none"], s.num_speculative_tokens, num_layers, capture)
    # NaN (a position no chain reached) is not JSON: such a figure is reported as missing.
    fields = {k: [None if x != x else x for x in v] if isinstance(v, list) else v
              for k, v in prediction.items() if k.startswith("predict")}
    fields["predicted_num_drafts"] = prediction.get("num_drafts")
    # Per prompt, in the prompts' order (None where the server returned no ids to replay on).
    for key in ("per_prompt_mean_acceptance_length", "per_prompt_num_drafts"):
        by_prompt = dict(zip(answered, prediction.get(key) or []))
        fields[f"predicted_{key}"] = [by_prompt.get(i) for i in range(len(report["token_ids"]["none"]))]
    fields["prediction_readings"] = prediction.get("readings")
    fields["capture_check"] = checked or None
    fields["diagnosis"] = diagnosis(plan, report, prediction)
    return (captured[0] if captured else None), fields


if __name__ == "__main__":
    main(6, __doc__, run, rehearsal=dry_run_lines)
