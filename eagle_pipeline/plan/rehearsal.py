"""The engine rehearsal: every vLLM engine a stage will start, configured by vLLM's own code before any model loads.

vLLM's CPU platform replaces a named attention backend that does not fit a layer with one of its own, while its
CUDA platform refuses it ("Selected backend ... is not valid for this configuration"); a run configured on a
CPU can therefore stop on the GPU host after hours of work, at the first engine that meets such a setting. So
each engine a stage starts (the answering engine, the hidden-state capture, the drafter load check, the
servers of stage 06 and its capture, the capture servers of online training) is built here from exactly the
arguments the stage will use, and handed to vLLM: `create_engine_config()`, then the backend vLLM's selector
returns for each kind of layer in it (the target's, the drafter's) and the KV-cache block size they must share
(eagle_pipeline/plan/vllm_config.py). On the GPU host that is the real platform; on a machine without CUDA a
config for CUDA is checked by CUDA's own selector at the host's compute capability.

It runs in every dry run (the stage's engines) and again before the stage loads its first model; on the GPU
host stage 01, the first to load the target, rehearses the engines of every stage of the run, so that a
setting stage 05 or 06 cannot use is refused before the target is first loaded, not after a day of training.
A refusal is one `error:` line naming the engine, the layer, vLLM's reason and the config key to change.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eagle_pipeline.config import RunConfig
from eagle_pipeline.errors import BadInput
from eagle_pipeline.plan.vllm_config import cuda_available
from eagle_pipeline.samples import planned_sample_layout

# The stages that start vLLM engines (stage 04 only in online mode, without capture endpoints of its own).
ENGINE_STAGES = (1, 2, 4, 5, 6)
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
    """The engines stage `stage` of `cfg` starts, built by the functions the stage itself calls; files the engines
    only name (a drafter that does not exist yet, connector folders) go under `scratch`."""
    from eagle_pipeline.engine import engine_env, llm_kwargs, offline_engine_env
    from eagle_pipeline.verifier import Verifier

    verifier = Verifier.from_config(cfg)
    target = str(verifier.path)
    env = engine_env(cfg)  # stage 05's jobs and the servers; the offline engines of this process get their own
    offline = offline_engine_env(cfg)
    if stage == 1:
        dtype = cfg.generation.dtype or cfg.verifier.dtype
        return [PlannedEngine(1, "answering engine", offline, engine_args=llm_kwargs(cfg, target, dtype=dtype))]
    if stage == 2:
        if cfg.hidden_states.mode == "online":
            return []
        return [PlannedEngine(2, "hidden-state capture", offline,
                              engine_args=_capture_args(cfg, verifier, cfg.hidden_states.max_seq_len, scratch))]
    if stage == 4:
        if cfg.hidden_states.mode != "online" or cfg.hidden_states.capture_endpoints:
            return []
        return [PlannedEngine(4, "online capture server", env,
                              server_argv=_online_capture_argv(cfg, verifier, scratch))]
    if stage == 5:
        return _stage_05_engines(cfg, verifier, env, scratch)
    if stage == 6:
        return _stage_06_engines(cfg, verifier, scratch)
    return []


def _capture_args(cfg: RunConfig, verifier, longest: int, scratch: Path) -> dict[str, Any]:
    from eagle_pipeline.capture import HiddenStateCapture, capture_sizing
    from eagle_pipeline.engine import capture_engine_kwargs

    layout = planned_sample_layout(cfg, verifier.num_layers, verifier.hidden_size, verifier.vocab_size)
    capture = HiddenStateCapture(verifier.path, list(layout.layer_ids), num_layers=verifier.num_layers,
                                 **capture_sizing(longest), **capture_engine_kwargs(cfg))
    return capture.engine_args(scratch / "capture", cfg.device)


def _online_capture_argv(cfg: RunConfig, verifier, scratch: Path) -> list[str]:
    from eagle_pipeline.online.servers import server_kwargs_for
    from eagle_pipeline.serve.server import VllmServer

    layout = planned_sample_layout(cfg, verifier.num_layers, verifier.hidden_size, verifier.vocab_size)
    hs = cfg.hidden_states
    mooncake_client = None
    if hs.transfer == "mooncake":  # the store's address is only known once its master runs; vLLM reads none of it
        from eagle_pipeline.online.mooncake import client_config

        mooncake_client = client_config(hs.mooncake, hs.mooncake.master or "127.0.0.1:0")
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
    from eagle_pipeline import atomic
    from eagle_pipeline.convert import SpeculatorsCheckpoint, flat_config
    from eagle_pipeline.drafter.layouts import MLA, NORM_FLAGS, SPECULATORS_TYPE_KEY
    from eagle_pipeline.plan.disk import planned_draft_dims

    text = verifier.text_config()
    layout = planned_sample_layout(cfg, verifier.num_layers, verifier.hidden_size, verifier.vocab_size)
    flags = {name: getattr(cfg.train, name) for name in NORM_FLAGS}
    config = {"draft_vocab_size": cfg.vocab.draft_vocab_size, "target_hidden_size": verifier.hidden_size}
    if cfg.train.draft_layer == MLA:
        from eagle_pipeline.train.draft_config import build_mla_draft_config

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
    folder = scratch / "planned-drafter"
    folder.mkdir(parents=True, exist_ok=True)
    atomic.write_json(folder / "config.json", config)
    return folder


def _stage_05_engines(cfg: RunConfig, verifier, env: dict[str, str], scratch: Path) -> list[PlannedEngine]:
    from eagle_pipeline.drafter_checks.vllm_load import load_check_engine_kwargs
    from eagle_pipeline.engine import drafter_engine_settings, llm_kwargs

    drafter = str(drafter_folder(cfg, verifier, scratch))
    engine_kwargs = {k: v for k, v in llm_kwargs(cfg, str(verifier.path)).items() if k != "model"}
    engines = [PlannedEngine(5, "drafter load check", env, engine_args=load_check_engine_kwargs(
        str(verifier.path), drafter, engine_kwargs, drafter_engine_settings(cfg)), kv_cache=False)]
    if cfg.convert.parity == "vllm":
        from eagle_pipeline.drafter_checks.parity import acceptance_engine_kwargs

        parity_args = acceptance_engine_kwargs(str(verifier.path), drafter, cfg.serve.num_speculative_tokens,
                                               engine_kwargs, drafter_engine_settings(cfg))
        engines.append(PlannedEngine(5, "parity engine", env, engine_args=parity_args))
    return engines


def _stage_06_engines(cfg: RunConfig, verifier, scratch: Path) -> list[PlannedEngine]:
    from eagle_pipeline.engine import drafter_engine_settings, server_kwargs
    from eagle_pipeline.serve.engine_facts import server_env
    from eagle_pipeline.serve.engine_probe import describe, variant_config
    from eagle_pipeline.serve.measure import mode_server
    from eagle_pipeline.serve.plan import SCHEDULE_MODE

    s = cfg.serve
    drafter = drafter_folder(cfg, verifier, scratch)
    modes = (["none"] if s.baseline is None else []) + (["ngram"] if s.ngram_baseline else []) + ["eagle3"]

    def server(run_cfg: RunConfig, mode: str, name: str, overrides: dict[str, str], schedule=None) -> PlannedEngine:
        kwargs = server_kwargs(run_cfg)
        env = server_env(run_cfg, kwargs.pop("env"))
        argv = mode_server(mode, verifier.path, drafter, num_speculative_tokens=s.num_speculative_tokens,
                           drafter_settings=drafter_engine_settings(run_cfg), log_path=scratch / f"server-{mode}.log",
                           schedule=schedule, **kwargs).serve_argv(None)
        return PlannedEngine(6, name, env, server_argv=argv, overrides=overrides)

    engines = [server(cfg, mode, f"server {mode}", {}) for mode in modes]
    schedule = rehearsed_schedule(cfg)
    if schedule is not None:
        engines.append(server(cfg, SCHEDULE_MODE, "server schedule", {"variant": f"schedule {schedule}"}, schedule))
    if s.predict and s.engine_variants and s.probe_engine != "never":
        engines += [server(variant_config(cfg, v), "eagle3", f"engine variant {i}", {"variant": describe(v)})
                    for i, v in enumerate(s.engine_variants, 1)]
    if s.predict and s.baseline is None:
        from eagle_pipeline.engine import offline_engine_env

        engines.append(PlannedEngine(6, "replay capture", offline_engine_env(cfg),
                                     engine_args=_capture_args(cfg, verifier, cfg.verifier.max_model_len - 1, scratch)))
    return engines


def rehearsed_schedule(cfg: RunConfig) -> list[list[int]] | None:
    """The schedule stage 06's confirming server is rehearsed with: the configured one, else (the chosen one is only
    known once the levels are measured) one of the shape a choice takes over the configured levels, k_max at the
    first and 0 above it; None where no schedule server can start (no confirmation, or a single level: its choice
    is one k everywhere, the eagle3 server's setting)."""
    from eagle_pipeline.serve.plan import batch_ranges

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
    from eagle_pipeline.plan.vllm_config import check_engine

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
    from eagle_pipeline.engine import llm_kwargs

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


def stages_before_first_load(cfg: RunConfig, stage: int) -> tuple[int, ...]:
    """What a stage rehearses before it loads its first model: its own engines, and on the GPU host, at stage 01
    (the run's first target load), every stage's."""
    if stage == 1 and cfg.device == "cuda":
        return ENGINE_STAGES
    return (stage,)


def can_rehearse(cfg: RunConfig) -> str | None:
    """Why the engines cannot be configured here (None when they can): an embedded target that is not converted
    yet (a dry run does not convert it)."""
    from eagle_pipeline.embedded import EMBEDDED_PREFIX, converted_path

    raw = cfg.verifier.path
    if raw.startswith(EMBEDDED_PREFIX) and converted_path(raw[len(EMBEDDED_PREFIX):]) is None:
        return "the embedded target is converted at its first use; its engines are configured then"
    return None


def dry_run_lines(cfg: RunConfig, stage: int) -> None:
    """The dry run's engine lines for `stage` (and its refusal)."""
    if not planned_stage_has_engines(cfg, stage):
        return
    reason = can_rehearse(cfg)
    if reason is not None:
        print(f"  engine rehearsal skipped: {reason}")
        return
    check_engines(cfg, (stage,))


def planned_stage_has_engines(cfg: RunConfig, stage: int) -> bool:
    if stage not in ENGINE_STAGES:
        return False
    online = cfg.hidden_states.mode == "online"
    return not ((stage == 2 and online) or (stage == 4 and (not online or cfg.hidden_states.capture_endpoints)))


def before_first_load(cfg: RunConfig, stage: int) -> None:
    """A real run's rehearsal, right before the stage loads its first model (on the GPU host, stage 01 rehearses
    every stage's engines): one line per engine, and a refusal before any weight is read."""
    stages = stages_before_first_load(cfg, stage)
    print(f"stage {stage:02d}: engine rehearsal of stage{'s' if len(stages) > 1 else ''} "
          f"{', '.join(f'{s:02d}' for s in stages)} (vLLM's configuration, no model loaded)")
    check_engines(cfg, stages)
