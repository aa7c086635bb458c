"""Command line of the vLLM jobs that `subprocess_json.run_json_subprocess` starts: `inspect` (vLLM's
config view and load_weights result, and vLLM's side of the vllm_logits check) and `acceptance` (greedy
generation with spec-decode counters). Each writes its result as JSON to --out."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from eagle_pipeline.drafter.folder import is_dflash_drafter
from eagle_pipeline.drafter_checks import dflash
from eagle_pipeline.drafter_checks.parity import acceptance_run
from eagle_pipeline.drafter_checks.vllm_load import vllm_inspect
from eagle_pipeline.drafter_checks.vllm_logits import eagle3_side, vllm_side


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="vLLM-side drafter checks (run by eagle_pipeline.drafter_checks itself)")
    sub = parser.add_subparsers(dest="command", required=True)
    inspect = sub.add_parser("inspect", help="vLLM config view + load_weights of a drafter")
    accept = sub.add_parser("acceptance", help="greedy generation with a drafter; spec-decode counters")
    for p in (inspect, accept):
        p.add_argument("--target", required=True)
        p.add_argument("--drafter", required=True)
        p.add_argument("--engine-kwargs", default="{}")
        p.add_argument("--out", required=True)
        p.add_argument("--drafter-settings", default="{}",
                       help="speculative_config fields: how vLLM computes the drafter")
    inspect.add_argument("--logits-inputs", help="inputs of the vllm_logits check (vllm_logits.speculators_side)")
    inspect.add_argument("--logits-out", help="where vLLM's logits of the vllm_logits check go")
    accept.add_argument("--prompts", required=True)
    accept.add_argument("--num-speculative-tokens", type=int, required=True)
    accept.add_argument("--max-tokens", type=int, required=True)
    accept.add_argument("--chat-template-kwargs", default="{}",
                        help="the run's chat-template arguments (thinking switch, ...)")
    args = parser.parse_args(argv)
    engine_kwargs = json.loads(args.engine_kwargs)
    if args.command == "inspect":
        drafter_settings = json.loads(args.drafter_settings)
        logits = None
        if args.logits_inputs:
            # First: vLLM keeps the rotary modules it builds (get_rope's cache), and the logits need the ones built
            # under their own settings (vllm_logits).
            side = dflash.vllm_blocks if is_dflash_drafter(args.drafter) else eagle3_side
            logits = vllm_side(side, args.target, args.drafter, engine_kwargs, drafter_settings, args.logits_inputs,
                               args.logits_out)
        result = vllm_inspect(args.target, args.drafter, engine_kwargs, drafter_settings)
        if logits is not None:
            result["logits"] = (logits if result["load"]["ok"] else
                                {"error": "not compared: vLLM's loader did not take the folder"})
    else:
        prompts = json.loads(Path(args.prompts).read_text())
        result = acceptance_run(args.target, args.drafter, prompts, args.num_speculative_tokens,
                                args.max_tokens, engine_kwargs, json.loads(args.drafter_settings),
                                json.loads(args.chat_template_kwargs))
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
