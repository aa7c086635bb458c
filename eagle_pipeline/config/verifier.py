"""The `verifier` section: the target model and how vLLM computes it, and the engine arguments a config may pass
(`engine_args`) or may not (those another key owns, and those that would make vLLM compute another target)."""

from __future__ import annotations

import difflib
import json
from typing import Any, Literal, Optional

from pydantic import (
    Field,
    field_validator,
)

from eagle_pipeline.config.base import (
    MAX_PARALLEL,
    MAX_TOKENS,
    AttentionBackend,
    KvCacheDtype,
    PathStr,
    Section,
    argument_problem,
    cross_field,
    json_argument_problem,
)
from eagle_pipeline.config.vllm_names import vllm_engine_arg_names


class VerifierConfig(Section):
    path: PathStr = Field(description="HF model directory of the target, or embedded:<name> for a bundled model")
    trust_remote_code: bool = False
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    tensor_parallel_size: int = Field(1, ge=1, le=MAX_PARALLEL)
    enable_expert_parallel: bool = False
    max_model_len: int = Field(2048, ge=16, le=MAX_TOKENS)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    cpu_kvcache_gib: int = Field(4, ge=1, le=65536, description="VLLM_CPU_KVCACHE_SPACE for the CPU backend")
    # How vLLM computes the target, for every stage that starts it (01, 02, 05, 06). The same keys for the
    # drafter are serve.drafter_*; stage 06's report records both, so a known-good serving command can be
    # read off it (docs/engines.md, "Engine settings").
    attention_backend: Optional[AttentionBackend] = Field(None, description="vLLM attention backend of the target, "
                                                                            "e.g. TRITON_MLA; None: vLLM picks")
    kv_cache_dtype: KvCacheDtype = Field("auto", description="KV-cache dtype of the target: auto, fp8, fp8_e4m3, ...")
    enforce_eager: bool = Field(False, description="no CUDA graphs or torch.compile (on the CPU "
                                                   "build: no graph recompiles at each start)")
    model_runner: Literal["auto", "v1", "v2"] = Field("auto", description="vLLM's model runner "
                                                                          "(VLLM_USE_V2_MODEL_RUNNER); "
                                                                          "auto: vLLM's choice")
    log_level: Optional[Literal["DEBUG", "INFO", "WARNING", "ERROR"]] = Field(
        None, description="vLLM's log level; None: INFO on cuda (a cold start's "
                          "load time, KV memory and backends), WARNING on cpu")
    engine_args: dict[str, Any] = Field(default_factory=dict, description="extra vLLM engine arguments "
                                                                          "(not those a key above owns)")

    @field_validator("engine_args")
    @classmethod
    def _known_engine_args(cls, args):
        for key in args:
            owner = ENGINE_ARGS_OWNED_BY_KEYS.get(str(key))
            if owner:
                # A first-class key is fingerprinted, range-checked and used by every stage alike; the same
                # setting here would bypass all of that (engine_args.model would serve another target).
                raise cross_field(str(key), f"is set by {owner}, not by engine_args; move it there")
            reason = ENGINE_ARGS_REFUSED.get(str(key))
            if reason:
                raise cross_field(str(key), reason)
        # Each becomes a `vllm serve` flag, and all of them one JSON argument of the engine jobs.
        for key, value in args.items():
            problem = argument_problem(value if isinstance(value, str) else json.dumps(value, default=str))
            if problem:
                raise cross_field(str(key), problem)
        problem = json_argument_problem(args)
        if problem:
            raise ValueError(f"all of them as one JSON argument {problem}")
        # A misspelt engine argument would otherwise surface as a TypeError after minutes of model loading.
        names = vllm_engine_arg_names()
        if names is None:  # no vLLM here: nothing can start an engine, so there is nothing to check against
            return args
        for key in args:
            if key not in names:
                close = difflib.get_close_matches(str(key), sorted(names), n=1)
                hint = (f"did you mean {close[0]!r}?" if close
                        else "see vllm.engine.arg_utils.EngineArgs for the valid names")
                raise cross_field(str(key), f"not a vLLM engine argument; {hint}")
        return args


# vLLM engine arguments that a config key owns (engine.py passes them), with the key to use instead.
ENGINE_ARGS_OWNED_BY_KEYS = {
    "model": "verifier.path", "tokenizer": "verifier.path", "served_model_name": "verifier.path",
    "seed": "seed", "dtype": "verifier.dtype (generation.dtype for stage 01)",
    "max_model_len": "verifier.max_model_len", "tensor_parallel_size": "verifier.tensor_parallel_size",
    "enable_expert_parallel": "verifier.enable_expert_parallel",
    "gpu_memory_utilization": "verifier.gpu_memory_utilization", "trust_remote_code": "verifier.trust_remote_code",
    "attention_backend": "verifier.attention_backend", "kv_cache_dtype": "verifier.kv_cache_dtype",
    "enforce_eager": "verifier.enforce_eager",
    "speculative_config": "serve.* (stage 06) and the drafter folder",
    "spec_method": "serve.* (stage 06) and the drafter folder",
    "spec_model": "serve.* (stage 06) and the drafter folder", "spec_tokens": "serve.num_speculative_tokens",
    "kv_transfer_config": "hidden_states.*",
}
# vLLM engine arguments no key owns that would make the engine compute another target than the folder at
# verifier.path, whose files every manifest fingerprints: other weights, another depth or shape, another tokenizer.
# Each entry: why, and the fix.
_OTHER_WEIGHTS = ("would load other weights than the folder's, which every stage fingerprints; "
                  "remove it (to run another checkpoint, point verifier.path at it)")
_OTHER_CONFIG = ("would read another model config than the folder's config.json (its depth and sizes), which "
                 "every stage reads and fingerprints; remove it, and edit a copy of the folder instead")
_OTHER_REVISION = ("picks a hub revision, but verifier.path is a local folder whose files every stage "
                   "fingerprints; remove it, and point verifier.path at a download of that revision")
_QUANTIZED = ("would quantize the target on the fly, so the drafter would learn and be measured against another "
              "distribution than the folder's; remove it, and point verifier.path at a quantized checkpoint (its "
              "config.json declares its quantization)")
ENGINE_ARGS_REFUSED = {
    "load_format": _OTHER_WEIGHTS.replace("; remove", " (dummy: random ones); remove"),
    "model_weights": _OTHER_WEIGHTS,
    "ignore_patterns": _OTHER_WEIGHTS.replace("; remove", " (it skips weight files); remove"),
    "model_loader_extra_config": _OTHER_WEIGHTS, "hf_overrides": _OTHER_CONFIG, "hf_config_path": _OTHER_CONFIG,
    "config_format": _OTHER_CONFIG,
    "model_class_overrides": _OTHER_CONFIG.replace("; remove", " (it swaps the model class); remove"),
    "revision": _OTHER_REVISION, "code_revision": _OTHER_REVISION, "tokenizer_revision": _OTHER_REVISION,
    "quantization": _QUANTIZED, "quantization_config": _QUANTIZED,
    "tokenizer_mode": "would tokenize with another tokenizer mode than the "
                      "folder's, which every stage uses and fingerprints; remove it",
    "skip_tokenizer_init": "would leave the engine without the tokenizer every stage needs; remove it",
}
