"""The engine rehearsal: every vLLM engine a stage will start, built here from exactly the arguments the stage will
use and configured by vLLM's own code (eagle_pipeline/vllm_config.py) before any model loads. Why, where it runs,
and what a refusal says: docs/engines.md, "The engine rehearsal".
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle_pipeline import atomic
from eagle_pipeline.capture import HiddenStateCapture, capture_sizing, one_pass_engine_args
from eagle_pipeline.config import RunConfig
from eagle_pipeline.convert import SpeculatorsCheckpoint, flat_config
from eagle_pipeline.drafter.layouts import DFLASH, DFLASH_ARCHITECTURE, MLA, NORM_FLAGS, SPECULATORS_TYPE_KEY
from eagle_pipeline.drafter.planned import planned_draft_dims
from eagle_pipeline.drafter_checks.parity import acceptance_engine_kwargs
from eagle_pipeline.drafter_checks.vllm_load import load_check_engine_kwargs
from eagle_pipeline.embedded import not_converted_yet
from eagle_pipeline.engine import (
    capture_engine_kwargs,
    drafter_engine_settings,
    engine_env,
    llm_kwargs,
    offline_engine_env,
    server_kwargs,
)
from eagle_pipeline.errors import BadInput
from eagle_pipeline.online.mooncake import client_config
from eagle_pipeline.online.servers import server_kwargs_for
from eagle_pipeline.plan.engines import Engine, engine_stages, stage_engines
from eagle_pipeline.samples import planned_sample_layout
from eagle_pipeline.serve.engine_facts import server_env
from eagle_pipeline.serve.engine_probe import describe, variant_config
from eagle_pipeline.serve.measure import mode_server
from eagle_pipeline.serve.plan import SCHEDULE_MODE, batch_ranges
from eagle_pipeline.serve.server import VllmServer
from eagle_pipeline.train.draft_config import build_mla_draft_config
from eagle_pipeline.verifier import Verifier
from eagle_pipeline.vllm_config import check_engine, cuda_available

# The config keys that set each kind of layer's backend and KV-cache dtype (an unset drafter dtype is the target's).
FIX_KEYS = {"target": ("verifier.attention_backend", "verifier.kv_cache_dtype"),
            "drafter": ("serve.drafter_attention_backend",
                        "serve.drafter_kv_cache_dtype (unset, the drafter's is verifier.kv_cache_dtype)")}
# What a machine without CUDA cannot rehearse (vllm_config.selection_platform: only the selector is CUDA's).
NOT_REHEARSED = ("  not rehearsed without a GPU: CUDA graph sizes, chunked prefill, scheduler defaults (vLLM's CPU "
                 "platform built these configs); a backend left to vLLM is chosen among those installed here (with an "
                 "fp8 KV cache the GPU host may take FLASHINFER where a line says TRITON_ATTN)")


@dataclass
class PlannedEngine:
    """One engine a stage starts: an offline engine's keyword arguments or a server's `vllm serve` flags."""

    stage: int
    name: str
    env: dict[str, str]
    engine_args: dict[str, Any] | None = None
    server_argv: list[str] | None = None
    overrides: dict[str, str] = field(default_factory=dict)  # settings it changes (a variant's), for the printed line
    kv_cache: bool = True  # allocates a KV cache (the load check does not: it builds the drafter and loads weights)


def planned_engines(cfg: RunConfig, stage: int, scratch: Path) -> list[PlannedEngine]:
    """The engines stage `stage` of `cfg` starts (plan/engines.py), built by the functions the stage itself calls;
    files the engines only name (a drafter that does not exist yet, connector folders) go under `scratch`."""
    verifier = Verifier.from_config(cfg)
    target, s = str(verifier.path), cfg.serve
    env = engine_env(cfg)  # stage 05's jobs and the servers; the offline engines of this process get their own
    offline = offline_engine_env(cfg)
    planned = []
    for engine in stage_engines(cfg, stage):
        name = engine.name
        if engine.stage == 1:
            args = llm_kwargs(cfg, target, dtype=cfg.generation.dtype or cfg.verifier.dtype)
            if cfg.hidden_states.one_pass:
                layout = planned_sample_layout(cfg, verifier.num_layers, verifier.hidden_size, verifier.vocab_size)
                args.update(one_pass_engine_args(cfg, layout.layer_ids, verifier.num_layers, scratch / "capture"))
            planned.append(PlannedEngine(1, name, offline, engine_args=args))
        elif engine.stage == 2 or name == "replay capture":
            longest = cfg.hidden_states.max_seq_len if stage == 2 else cfg.verifier.max_model_len - 1
            planned.append(PlannedEngine(stage, name, offline,
                                         engine_args=_capture_args(cfg, verifier, longest, scratch)))
        elif engine.stage == 4:
            planned.append(PlannedEngine(4, name, env, server_argv=_online_capture_argv(cfg, verifier, scratch)))
        elif engine.stage == 5:
            drafter = str(drafter_folder(cfg, verifier, scratch))
            kwargs = {k: v for k, v in llm_kwargs(cfg, target).items() if k != "model"}
            if engine.loads_target:
                args = acceptance_engine_kwargs(target, drafter, s.num_speculative_tokens, kwargs,
                                                drafter_engine_settings(cfg))
            else:
                args = load_check_engine_kwargs(target, drafter, kwargs, drafter_engine_settings(cfg))
            planned.append(PlannedEngine(5, name, env, engine_args=args, kv_cache=engine.loads_target))
        elif engine.variant:
            variant = s.engine_variants[engine.variant - 1]
            planned.append(_server(variant_config(cfg, variant), engine, verifier, scratch,
                                   {"variant": describe(variant)}))
        elif engine.mode == SCHEDULE_MODE:
            schedule = rehearsed_schedule(cfg)
            if schedule is not None:  # otherwise the eagle3 server's setting, rehearsed there
                planned.append(_server(cfg, engine, verifier, scratch, {"variant": f"schedule {schedule}"}, schedule))
        else:
            planned.append(_server(cfg, engine, verifier, scratch, {}))
    return planned


def _server(run_cfg: RunConfig, engine: Engine, verifier, scratch: Path, overrides: dict[str, str],
            schedule=None) -> PlannedEngine:
    kwargs = server_kwargs(run_cfg)
    env = server_env(run_cfg, kwargs.pop("env"))
    argv = mode_server(engine.mode, verifier.path, drafter_folder(run_cfg, verifier, scratch),
                       num_speculative_tokens=run_cfg.serve.num_speculative_tokens,
                       drafter_settings=drafter_engine_settings(run_cfg),
                       log_path=scratch / f"server-{engine.mode}.log", schedule=schedule, **kwargs).serve_argv(None)
    return PlannedEngine(6, engine.name, env, server_argv=argv, overrides=overrides)


def _capture_args(cfg: RunConfig, verifier, longest: int, scratch: Path) -> dict[str, Any]:
    layout = planned_sample_layout(cfg, verifier.num_layers, verifier.hidden_size, verifier.vocab_size)
    capture = HiddenStateCapture(verifier.path, list(layout.layer_ids), num_layers=verifier.num_layers,
                                 **capture_sizing(longest), **capture_engine_kwargs(cfg))
    return capture.engine_args(scratch / "capture", cfg.device)


def _online_capture_argv(cfg: RunConfig, verifier, scratch: Path) -> list[str]:
    layout = planned_sample_layout(cfg, verifier.num_layers, verifier.hidden_size, verifier.vocab_size)
    hs = cfg.hidden_states
    # The store's address is only known once its master runs; vLLM reads none of it.
    mooncake_client = (client_config(hs.mooncake, hs.mooncake.master or "127.0.0.1:0")
                       if hs.transfer == "mooncake" else None)
    kwargs = server_kwargs_for(cfg, verifier, layout, storage=scratch / "online", mooncake_client=mooncake_client,
                               longest_sequence=hs.max_seq_len)
    kwargs.pop("env", None)
    return VllmServer(**kwargs, log_path=scratch / "server.log").serve_argv(None)


def drafter_folder(cfg: RunConfig, verifier, scratch: Path) -> Path:
    """The drafter folder stages 05 and 06 serve: `serve.drafter`, stage 05's output, or (before stage 05 has run)
    a config-only stand-in with the drafter's planned shape (Llama-shaped, or MLA with train.draft_layer mla), which
    is all vLLM reads to configure an engine."""
    if cfg.serve.drafter is not None:
        return cfg.resolve_path(cfg.serve.drafter)
    converted = cfg.stage_dir("05_convert") / "vllm"
    if (converted / "config.json").is_file():
        return converted

    text = verifier.text_config()
    layout = planned_sample_layout(cfg, verifier.num_layers, verifier.hidden_size, verifier.vocab_size)
    folder = scratch / "planned-drafter"
    folder.mkdir(parents=True, exist_ok=True)
    if cfg.train.family == DFLASH:  # vLLM loads speculators' DFlash folder as stage 05 writes it
        atomic.write_json(folder / "config.json", planned_dflash_config(cfg, verifier, list(layout.layer_ids)))
        return folder
    flags = {name: getattr(cfg.train, name) for name in NORM_FLAGS}
    config = {"draft_vocab_size": cfg.vocab.draft_vocab_size, "target_hidden_size": verifier.hidden_size}
    if cfg.train.draft_layer == MLA:
        # The DeepseekV3Config stage 04 trains, in the speculators config it writes: the flat config is then
        # convert.mla_flat_config's (Eagle3DeepseekV2ForCausalLM, model_type kimi_k2 for a Kimi target), whose
        # layers select an MLA backend as the served drafter's do.
        layer = build_mla_draft_config(cfg.train, text)
        config |= {SPECULATORS_TYPE_KEY: "eagle3", "transformer_layer_config": layer,
                   "speculators_config": {"verifier": {"name_or_path": str(verifier.path)}}}
    else:
        dims = planned_draft_dims(cfg, verifier, len(layout.layer_ids))
        shape = cfg.train.draft_shape.model_dump(exclude_none=True) if cfg.train.draft_shape else {}
        layer = {"hidden_size": dims.hidden_size, "num_attention_heads": dims.num_attention_heads,
                 "num_key_value_heads": dims.num_key_value_heads, "head_dim": dims.head_dim,
                 "intermediate_size": dims.intermediate_size, "vocab_size": verifier.vocab_size,
                 "rms_norm_eps": text.get("rms_norm_eps", 1e-6),
                 "max_position_embeddings": text.get("max_position_embeddings", cfg.verifier.max_model_len),
                 "rope_theta": shape.get("rope_theta", text.get("rope_theta", 10000.0))}
    planned = SpeculatorsCheckpoint(scratch, config, layer, {}, flags)
    config = flat_config(planned, vocab_size=verifier.vocab_size, written_layer_ids=list(layout.layer_ids),
                         dtype="bfloat16", engine="vllm")
    atomic.write_json(folder / "config.json", config)
    return folder


def planned_dflash_config(cfg: RunConfig, verifier, layer_ids: list[int]) -> dict[str, Any]:
    """The config of the DFlash drafter stage 04 will train, as speculators saves it and stage 05 serves it (every
    layer full attention, attending both ways), from its planned dimensions."""
    dims, d, text = planned_draft_dims(cfg, verifier, len(layer_ids)), cfg.train.dflash, verifier.text_config()
    layer = {"model_type": "qwen3", "hidden_size": dims.hidden_size, "num_attention_heads": dims.num_attention_heads,
             "num_key_value_heads": dims.num_key_value_heads, "head_dim": dims.head_dim,
             "intermediate_size": dims.intermediate_size, "num_hidden_layers": dims.num_layers,
             "layer_types": ["full_attention"] * dims.num_layers, "vocab_size": verifier.vocab_size,
             "rms_norm_eps": text.get("rms_norm_eps", 1e-6), "hidden_act": "silu",
             "max_position_embeddings": text.get("max_position_embeddings", cfg.verifier.max_model_len)}
    return {"architectures": [DFLASH_ARCHITECTURE], SPECULATORS_TYPE_KEY: DFLASH, "transformer_layer_config": layer,
            "aux_hidden_state_layer_ids": layer_ids, "block_size": d.block_size, "mask_token_id": d.mask_token_id or 0,
            "draft_vocab_size": cfg.vocab.draft_vocab_size, "sliding_window_non_causal": True,
            "speculators_config": {"algorithm": DFLASH, "default_proposal_method": "greedy", "proposal_methods": [
                {"proposal_type": "greedy", "speculative_tokens": d.block_size - 1, "accept_tolerance": 0.0,
                 "verifier_accept_k": 1}], "verifier": {"name_or_path": str(verifier.path),
                                                        "architectures": text.get("architectures") or []}}}


def rehearsed_schedule(cfg: RunConfig) -> list[list[int]] | None:
    """The schedule stage 06's confirming server is rehearsed with: the configured one, else (the chosen one is only
    known once the levels are measured) one of the shape a choice takes over the configured levels, k_max at the
    first and 0 above it; None where no schedule server can start (no confirmation, or a single level: its choice
    is one k everywhere, the eagle3 server's setting)."""
    s = cfg.serve
    if s.num_speculative_tokens_per_batch_size:
        return [list(entry) for entry in s.num_speculative_tokens_per_batch_size]
    levels = s.concurrency_levels
    if not s.confirm_schedule or len(levels) < 2:
        return None
    return batch_ranges([(level, s.num_speculative_tokens if i == 0 else 0) for i, level in enumerate(levels)])


@dataclass
class Rehearsed:
    engine: PlannedEngine
    result: Any  # vllm_config_check.EngineCheck

    def line(self) -> str:
        r = self.result
        head = f"  engine {self.engine.stage:02d} {self.engine.name}"
        if self.engine.overrides:
            head += f" ({self.engine.overrides['variant']})"
        if r.error is not None and not r.layers:
            return f"{head}: REFUSED by vLLM's configuration: {r.error}"
        layers = []
        for layer in r.layers:
            chosen = layer.backend or ("cannot be checked here" if layer.notes else "REFUSED")
            named = "" if layer.requested in (None, layer.backend) else f" (asked {layer.requested})"
            layers.append(f"{layer.kind} {layer.attention} -> {chosen}{named}")
        kv = ", ".join(sorted({layer.kv_cache_dtype for layer in r.layers}))
        block = (f"block {r.block_size}" if r.block_size else "no KV cache" if not self.engine.kv_cache
                 else "block size not settled")
        return f"{head}: {'; '.join(layers)}; KV {kv}, {block}; runner {r.runner} [{r.platform}]"

    def refusal(self) -> str | None:
        """The error line for an engine vLLM refuses (None where it accepts it, or could not check a backend)."""
        r = self.result
        where = f"engine rehearsal: stage {self.engine.stage:02d} {self.engine.name}"
        if self.engine.overrides:
            where += f" ({self.engine.overrides['variant']})"
        for layer in r.layers:
            if layer.error is not None and not layer.notes:
                backend, dtype = FIX_KEYS[layer.kind]
                fix = (f"{dtype} to a KV-cache dtype its backend takes, or {backend} to a backend that takes "
                       f"{layer.kv_cache_dtype}" if "kv_cache_dtype" in layer.error
                       else f"{backend} to a backend that takes them")
                return (f"{where}: vLLM on {r.platform} refuses the {layer.kind}'s {layer.attention} layers: "
                        f"{layer.error}; set {fix} (docs/engines.md, \"The engine rehearsal\")")
        if r.error is not None:
            return (f"{where}: vLLM refuses the engine's settings on {r.platform}: {r.error}; change the setting it "
                    f"names (the verifier and serve sections, or verifier.engine_args)")
        return None


def rehearse(cfg: RunConfig, stages: tuple[int, ...] | list[int]) -> list[Rehearsed]:
    """Every engine of `stages`, configured by vLLM (it imports vLLM; no model is loaded)."""
    done = []
    with tempfile.TemporaryDirectory(prefix="engine-rehearsal-") as tmp:
        for stage in stages:
            try:
                engines = planned_engines(cfg, stage, Path(tmp))
            except BadInput:
                raise
            except Exception as error:  # noqa: BLE001 - the run itself will meet it; the rehearsal says so and goes on
                print(f"  engine {stage:02d}: not rehearsed, its arguments could not be built here: "
                      f"{type(error).__name__}: {error}")
                continue
            for engine in engines:
                if engine.engine_args is not None and not engine.overrides:  # what it sets unlike the target's
                    engine.overrides = own_settings(cfg, engine.engine_args)
                done.append(Rehearsed(engine, check_engine(cfg.device, engine.engine_args, engine.server_argv,
                                                           engine.env, engine.kv_cache)))
    return done


def own_settings(cfg: RunConfig, engine_args: dict[str, Any]) -> dict[str, str]:
    """An offline engine's settings that differ from the run's target engine (`llm_kwargs`), for its printed line."""
    target, named = llm_kwargs(cfg, engine_args["model"]), ("tokenizer", "speculative_config", "kv_transfer_config")
    own = [f"{key}={value}" for key, value in engine_args.items() if key not in named and target.get(key) != value]
    return {"variant": ", ".join(own)} if own else {}


def check_engines(cfg: RunConfig, stages: tuple[int, ...] | list[int], *, show: bool = True) -> list[Rehearsed]:
    """Rehearse, print one line per engine (`show`), and refuse (BadInput) the first engine vLLM refuses."""
    done = rehearse(cfg, stages)
    if show:
        for item in done:
            print(item.line())
        if done and cfg.device == "cuda" and not cuda_available():
            print(NOT_REHEARSED)
    for item in done:
        problem = item.refusal()
        if problem is not None:
            raise BadInput(problem)
    return done


def dry_run_lines(cfg: RunConfig, stage: int) -> None:
    """The dry run's engine lines for `stage` (and its refusal)."""
    if not stage_engines(cfg, stage):
        return
    if not_converted_yet(cfg.verifier.path):
        print("  engine rehearsal skipped: the embedded target is converted at its first use; its engines are "
              "configured then")
        return
    check_engines(cfg, (stage,))


def before_first_load(cfg: RunConfig, stage: int) -> None:
    """A real run's rehearsal, right before the stage loads its first model (on the GPU host, stage 01 rehearses
    every stage's engines): one line per engine, and a refusal before any weight is read."""
    stages = engine_stages(cfg) if stage == 1 and cfg.device == "cuda" else (stage,)
    print(f"stage {stage:02d}: engine rehearsal of stage{'s' if len(stages) > 1 else ''} "
          f"{', '.join(f'{s:02d}' for s in stages)} (vLLM's configuration, no model loaded)")
    check_engines(cfg, stages)
