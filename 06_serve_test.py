"""Stage 06: serve target + drafter with `vllm serve` and measure what speculative decoding buys.

The held-out evaluation prompts (never used in training) go through vLLM's OpenAI server three times,
one server at a time: with the trained drafter (EAGLE-3), without speculation, and with n-gram
speculation. Acceptance comes from the server's Prometheus counters (`vllm:spec_decode_*`); at temperature
0 the drafter must not change the text, so every differing prompt is reported. The stage fails (exit 1)
when the mean acceptance length is below `serve.min_acceptance_length`.

Embedded default (CPU, a few minutes):
    python 06_serve_test.py --config configs/tiny.yaml
Full scale (8 GPUs):
    python 06_serve_test.py --config configs/kimi-k2.5-10k.yaml

Output in <data_root>/<run_name>/06_serve_test/: report.json, report.md, report.png (acceptance per
position, tokens/s per mode), responses.jsonl, logs/server-<mode>.log, manifest.json.
"""

import json
import sys

from eagle_pipeline.chat_template import chat_template_kwargs
from eagle_pipeline.errors import BadInput
from eagle_pipeline.fingerprint import value_fingerprint
from eagle_pipeline.prompts import load_prompts
from eagle_pipeline.serve.measure import measure_modes
from eagle_pipeline.serve.report import format_speedup, read_report, render_report_md, write_report
from eagle_pipeline.serve.server import check_port_free
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
    converted = None if dry_run and not is_complete(cfg, 5) else require_complete(cfg, 5)
    drafter_dir = cfg.stage_dir("05_convert") / "vllm"
    eval_path = cfg.resolve_path(cfg.data.eval_prompts)
    prompts = load_prompts(eval_path, cfg.data.prompt_field, "data.eval_prompts")[: cfg.data.num_eval_prompts]
    train_texts = {json.dumps(p["messages"]) for p in load_prompts(cfg.resolve_path(cfg.data.prompts), cfg.data.prompt_field, "data.prompts")}
    overlap = [p["id"] for p in prompts if json.dumps(p["messages"]) in train_texts]
    if overlap:
        raise BadInput(f"data.eval_prompts: {len(overlap)} evaluation prompts (e.g. {overlap[0]}) also appear in data.prompts; "
                       f"held-out prompts must never be trained on")
    modes = ["none"] + (["ngram"] if s.ngram_baseline else []) + ["eagle3"]

    if dry_run:
        print(f"stage 06: serve {cfg.verifier.path} with modes {modes}, {len(prompts)} held-out prompts from {eval_path}")
        if converted is None:
            print(not_run_yet_note(cfg, 5))
        print(f"  drafter {drafter_dir}, {s.num_speculative_tokens} speculative tokens, temperature {s.temperature}, "
              f"concurrency {s.concurrency}, tensor_parallel={cfg.verifier.tensor_parallel_size}; floor {s.min_acceptance_length}")
        return
    # Every input is checked before the manifest is written: a refusal leaves the stage folder as it was.
    predicting = s.predict and "none" in modes
    if predicting:
        _, layout = require_sample_layout(cfg)
        trained = require_complete(cfg, 4)
    verifier = Verifier.from_config(cfg)
    template_kwargs = chat_template_kwargs(verifier.chat_template(), cfg.generation.reasoning, cfg.generation.chat_template_kwargs)
    inputs = {
        "drafter": upstream_fingerprint(converted),
        "drafter_weights": converted["output_fingerprint"],
        "eval_prompts": value_fingerprint(prompts),
        "serve": value_fingerprint(s.model_dump(mode="json", exclude={"min_acceptance_length", "port", "startup_timeout_s"})),
        "verifier": verifier.fingerprints()["verifier"],
        "chat_template_kwargs": template_kwargs,
    }
    if stage.start(inputs) is Start.ALREADY_COMPLETE:
        report = read_report(stage.dir / "report.json")
        ok, message = verdict(report, s.min_acceptance_length)
        print(f"stage 06 already complete for these inputs: {stage.dir}\n{message}")
        if not ok:
            sys.exit(1)
        return

    from eagle_pipeline.engine import server_kwargs

    report = measure_modes(
        verifier.path, drafter_dir, [p["messages"] for p in prompts],
        num_speculative_tokens=s.num_speculative_tokens, modes=modes, max_tokens=s.max_tokens, temperature=s.temperature,
        concurrency=s.concurrency, seed=cfg.seed, port=s.port, log_dir=stage.dir / "logs", **server_kwargs(cfg),
        startup_timeout_s=s.startup_timeout_s, chat_template_kwargs=template_kwargs,
    )
    if predicting:
        from eagle_pipeline.predict.served import predict_served, served_checkpoint

        print(f"stage 06: predicting acceptance offline on the {len(prompts)} answers served without speculation")
        prediction = predict_served(cfg, verifier.path, layout, served_checkpoint(cfg, trained),
                                    report["token_ids"]["none"], s.num_speculative_tokens, stage.dir / "prediction_scratch")
        # NaN (a position no chain reached) is not JSON: such a figure is reported as missing.
        report.update({k: [None if x != x else x for x in v] if isinstance(v, list) else v
                       for k, v in prediction.items() if k.startswith("predict")})
        report["predicted_num_drafts"] = prediction.get("num_drafts")
    ok, message = verdict(report, s.min_acceptance_length)
    report["verdict"] = message
    report["prompt_ids"] = [p["id"] for p in prompts]
    write_report(stage.dir, report, [p["messages"] for p in prompts])

    counts = {k: report.get(k) for k in ("num_prompts", "num_speculative_tokens", "mean_acceptance_length", "acceptance_rate",
                                         "per_position_acceptance", "tokens_per_s", "speedup", "greedy_match",
                                         "predicted_mean_acceptance_length", "predicted_per_position_acceptance")}
    counts["passed"] = ok
    stage.finish(counts, output_fingerprint=value_fingerprint(counts))
    print(render_report_md(report))
    print(message)
    if not report.get("greedy_match"):
        print(f"warning: greedy outputs differ with the drafter on prompts {report.get('greedy_mismatches')}; see responses.jsonl")
    if not ok:
        sys.exit(1)


if __name__ == "__main__":
    main(6, __doc__, run)
