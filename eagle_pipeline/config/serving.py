"""The `serve` section (stage 06): the servers, their loads, the acceptance floor, the prediction and the engine
settings the probe serves (`engine_variants`)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from eagle_pipeline.config.base import (
    MAX_PARALLEL,
    MAX_TOKENS,
    AttentionBackend,
    KvCacheDtype,
    PathStr,
    Section,
    cross_field,
    env_problem,
)
from eagle_pipeline.config.verifier import VerifierConfig


class ServeConfig(Section):
    num_speculative_tokens: int = Field(3, ge=1, le=64)
    max_tokens: int = Field(128, ge=1, lt=MAX_TOKENS)
    temperature: float = Field(0.0, ge=0, le=10)
    # Requests in flight while measuring. A list is a sweep: every server answers the prompts at each level in turn
    # (client-side, no extra start), and stage 06 chooses `num_speculative_tokens` per batch size from it.
    concurrency: int | list[int] = Field(4, description="requests in flight while measuring; a list measures each "
                                                        "level in turn on every server, e.g. [1, 4, 16, 64]")
    # vLLM's `num_speculative_tokens_per_batch_size` to confirm instead of the schedule stage 06 chooses: entries
    # [batch_from, batch_to, k], the first from 1, k = 0 switching speculation off for that range.
    num_speculative_tokens_per_batch_size: Optional[list[tuple[int, int, int]]] = Field(
        None, description="the schedule to serve and confirm instead of the one chosen, e.g. [[1, 4, 3], [5, 64, 0]]")
    # Serve the chosen schedule once more to confirm it (one target start; skipped when the choice is a setting
    # already served: the drafter's k at every level, or no speculation at every level).
    confirm_schedule: bool = True
    port: Optional[int] = Field(None, ge=1, le=65535)
    ngram_baseline: bool = True
    min_acceptance_length: float = Field(1.5, ge=1, le=65)
    # Replay the trained drafter offline on the no-speculation server's answers (eagle_pipeline/predict) and
    # report the predicted acceptance beside the served one: a large gap means the engine serves the drafter
    # differently from how it was trained. Costs one hidden-state capture engine start.
    predict: bool = True
    # A drafter folder to serve instead of stage 05's (a released one, or one converted elsewhere): flat
    # `LlamaForCausalLMEagle3`, served with the aux ids its config declares; stages 04-05 are not needed.
    drafter: Optional[PathStr] = None
    # A finished stage-06 folder (`<run>/06_serve_test`) whose no-speculation answers and captured states
    # are reused instead of serving without speculation again; it must match this run's target and prompts.
    baseline: Optional[PathStr] = None
    # A cold start of a ~600 GB target (weights from disk, graph capture on 8 GPUs) takes tens of minutes.
    startup_timeout_s: float = Field(3600.0, gt=0, le=7 * 86400, description="seconds a vLLM server may "
                                                                             "take to become healthy")
    # How vLLM computes the drafter (stage 05's parity and stage 06), beside verifier.attention_backend etc.
    drafter_attention_backend: Optional[AttentionBackend] = Field(None, description="vLLM attention backend of the "
                                                                                    "drafter; None: vLLM picks")
    drafter_kv_cache_dtype: Optional[KvCacheDtype] = Field(None, description="KV-cache dtype of the "
                                                                             "drafter; None: the target's")
    # When served acceptance falls short of the replay and no reading of the drafter's config explains it, the
    # engine computes the drafter differently: these engine settings are then served with the drafter in turn,
    # each a dict of ENGINE_VARIANT_KEYS, until one serves as predicted (eagle_pipeline/serve/engine_probe.py).
    engine_variants: list[dict[str, Any]] = Field(default_factory=list, description="engine settings to serve the "
                                                                                    "drafter with in turn when the "
                                                                                    "diagnosis names the engine, e.g. "
                                                                                    "[{verifier.attention_backend: "
                                                                                    "TRITON_MLA, env: {VAR: value}}]")
    probe_engine: Literal["on_engine_verdict", "always", "never"] = Field(
        "on_engine_verdict", description="when to serve engine_variants: on an engine verdict, always, or never")

    @field_validator("engine_variants")
    @classmethod
    def _known_engine_variants(cls, variants):
        for index, variant in enumerate(variants):
            problem = engine_variant_problem(variant)
            if problem:
                raise ValueError(f"entry {index}: {problem}")
            if variant in variants[:index]:  # each entry costs a cold start of the target
                raise ValueError(f"entry {index} repeats entry {variants.index(variant)}, and each "
                                 "entry is served with a cold start of the target; remove one")
        return variants

    @field_validator("concurrency")
    @classmethod
    def _levels_in_order(cls, value):
        levels = value if isinstance(value, list) else [value]
        example = "[1, 4, 16, 64]"
        if not levels:
            raise ValueError(f"an empty list measures nothing; give one level (4) or several, e.g. {example}")
        for level in levels:
            if not 1 <= level <= MAX_PARALLEL:
                raise ValueError(f"{level} is not a number of requests in flight (1 to {MAX_PARALLEL})")
        if any(b <= a for a, b in zip(levels, levels[1:])):
            raise ValueError(f"{levels}: list the levels in ascending order without repeats, e.g. {example}")
        return value

    @property
    def concurrency_levels(self) -> list[int]:
        """`concurrency` as a list of levels; the first is the headline level."""
        return list(self.concurrency) if isinstance(self.concurrency, list) else [self.concurrency]

    @model_validator(mode="after")
    def _schedule_vllm_takes(self):
        # vLLM checks these ranges only when its scheduler starts (v1/spec_decode/dynamic/utils.py); refused here
        # before any server, with vLLM's own rules, and k no larger than the drafter's k, which vLLM would clamp.
        schedule = self.num_speculative_tokens_per_batch_size
        if schedule is None:
            return self
        field = "num_speculative_tokens_per_batch_size"
        fix = "e.g. [[1, 4, 3], [5, 64, 0]]: ranges from batch 1 upwards, in order, without overlaps"
        previous_end = 0
        for start, end, k in schedule:
            if start < 1 or end < start:
                raise cross_field(field, f"[{start}, {end}, {k}] is not a batch-size range; {fix}")
            if previous_end == 0 and start != 1:
                raise cross_field(field, f"the first range [{start}, {end}, {k}] must start at batch 1; {fix}")
            if start <= previous_end:
                raise cross_field(field, f"[{start}, {end}, {k}] overlaps or precedes the range before; {fix}")
            if not 0 <= k <= self.num_speculative_tokens:
                raise cross_field(field, f"k = {k} in [{start}, {end}, {k}] is not between 0 and "
                                         f"num_speculative_tokens {self.num_speculative_tokens}; lower it")
            previous_end = end
        if not any(k for _, _, k in schedule):
            raise cross_field(field, "k = 0 in every range serves no speculation; leave the key out (stage 06 then "
                                     "reports that choice without a speculating server)")
        return self

    @model_validator(mode="after")
    def _reachable_acceptance(self):
        # Each verification step accepts at most every draft token plus the verifier's own token.
        if self.min_acceptance_length > self.num_speculative_tokens + 1:
            raise cross_field("min_acceptance_length", f"{self.min_acceptance_length} can never be reached with "
                                                       f"num_speculative_tokens {self.num_speculative_tokens} "
                                                       f"(at most {self.num_speculative_tokens + 1}); lower it "
                                                       "or draft more tokens")
        return self


# The engine settings a serve.engine_variants entry may override (docs/engines.md, "Engine settings"): each
# names the field it overrides, whose own checks its value gets; `env` is merged into the run's env.
ENGINE_VARIANT_KEYS = ("verifier.attention_backend", "verifier.kv_cache_dtype", "verifier.enforce_eager",
                       "verifier.model_runner", "serve.drafter_attention_backend", "serve.drafter_kv_cache_dtype",
                       "env")


def engine_variant_problem(variant: Any) -> str | None:
    """Why a serve.engine_variants entry cannot be served, or None."""
    if not isinstance(variant, dict) or not variant:
        return (f"each entry is a mapping of engine keys to values, e.g. {{verifier.attention_backend: TRITON_MLA}}; "
                f"got {variant!r}")
    sections = {"verifier": VerifierConfig, "serve": ServeConfig}
    for key, value in variant.items():
        if key not in ENGINE_VARIANT_KEYS:
            return f"unknown key {key!r}; allowed: {', '.join(ENGINE_VARIANT_KEYS)}"
        if key == "env":
            if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k,
                                                      v in value.items()):
                return "env: must map variable names to strings (quote numbers)"
            problem = env_problem(value)
            if problem:
                return f"env: {problem}"
            continue
        section, field = key.split(".")
        model = sections[section]
        try:  # the field's own type and validators, on an otherwise empty section
            model.__pydantic_validator__.validate_assignment(model.model_construct(), field, value)
        except ValidationError as e:
            first = e.errors()[0]
            return f"{key}: {first['ctx']['error'] if first['type'] == 'value_error' else first['msg']} (got {value!r})"
    return None
