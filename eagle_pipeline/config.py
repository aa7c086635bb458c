"""The run config: one YAML file, validated by a typed schema.

- The file is read by config_file.py (`extends:` bases, `--set a.b=value` overrides, repeated keys refused);
  this module types what it read.
- Unknown or misspelt keys are errors that name the key and where it is.
- Relative paths in a config are taken relative to the repository root, so a command works from any
  directory.
- Every number has a range and must be finite; rules that tie fields together (a generation length below
  the context length, ...) are checked here too, so that a bad value is refused when the config loads,
  `--dry-run` included, and never midway through a stage.
- An error names the file that set the offending value: the base a value was inherited from, or `--set`.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from eagle_pipeline.config_file import Origins, read_config_file
from eagle_pipeline.errors import BadInput
from eagle_pipeline.fingerprint import value_fingerprint
from eagle_pipeline.layer_ids import order_problem
from eagle_pipeline.samples import StorageDtype
from eagle_pipeline.vllm_config import check_attention_backend, check_kv_cache_dtype, vllm_engine_arg_names

REPO_ROOT = Path(__file__).resolve().parent.parent
# The one list of the stages: folder `<run>/<name>/` (RunConfig.stage_dir), script `<name>.py`. scripts/launch.sh
# and scripts/run_pipeline.sh read it through eagle_pipeline.stage.
STAGES = {
    1: "01_generate_data",
    2: "02_extract_hidden",
    3: "03_build_vocab_map",
    4: "04_train",
    5: "05_convert",
    6: "06_serve_test",
}


# Upper bounds are far beyond any real run; they exist so that a slipped digit (1e10 epochs, a tensor
# parallel size of 80000) is refused up front instead of failing deep inside an engine or an allocator.
MAX_PARALLEL = 1024
MAX_TOKENS = 1 << 24  # 16M tokens: longer than any model's context; lengths inside a context stay below it
MAX_COUNT = 10**9
MAX_WIDTH = 1 << 20  # hidden / intermediate sizes
MAX_VOCAB = 1 << 24
MAX_SEED = 2**32 - 1  # numpy's limit; torch and vLLM take any of these

# What the OS refuses to carry, checked when the config loads, so that a value no process can be started with is
# not found by the first exec after `--force` has deleted a stage's output. Config values travel as command-line
# arguments (`--set`, the `vllm serve` flags engine_args become, JSON arguments of the engine jobs) and as
# environment entries (`env`); Linux refuses any single one above MAX_ARG_STRLEN (32 pages, with its NUL) with
# E2BIG, and every string with a NUL inside.
MAX_ARG_BYTES = 32 * 4096 - 1
# All of `env` together: a quarter of the usual 2 MiB ARG_MAX, leaving the rest to the inherited environment and
# the command line of the process it is passed to.
MAX_ENV_BYTES = 512 * 1024
# A file name (one path component) and a whole path, as Linux file systems take them (NAME_MAX, PATH_MAX).
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4095
# How much of one argument an engine-argument dict may fill: the JSON argument it travels in also holds the
# settings the pipeline adds (target_engine_settings, the drafter's folder).
ARG_HEADROOM_BYTES = 8 * 1024


def os_bytes(text: str) -> int | None:
    """`text`'s size as the OS gets it (file-system encoding), None where it cannot be encoded (a lone surrogate)."""
    try:
        return len(os.fsencode(text))
    except UnicodeEncodeError:
        return None


def argument_problem(text: str, limit: int = MAX_ARG_BYTES) -> str | None:
    """Why `text` cannot be one command-line argument or environment entry, or None."""
    if "\x00" in text:
        return "contains a NUL character, which no command line, environment or file name can carry; remove it"
    size = os_bytes(text)
    if size is None:
        return "holds a character the OS cannot encode (a lone surrogate such as \\ud800); remove it"
    if size > limit:
        room = (f"the {limit} bytes one command-line argument or environment entry may hold" if limit == MAX_ARG_BYTES
                else f"the {limit} bytes left for it in the one command-line argument it travels in")
        return f"is {size} bytes, above {room} (Linux refuses more with E2BIG when a process starts); shorten it"
    return None


def _unpassable_inside(value: Any, where: str = "") -> tuple[str, str] | None:
    """(where, why) for the first string in a value read from YAML (itself, or a name or value of a mapping or list
    inside) that no process can be given, or None: `where` is "" for the value itself, else a path such as "'A'"
    or "'kwargs'[0]"."""
    if isinstance(value, str):
        problem = argument_problem(value)
        return (where, problem) if problem else None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and argument_problem(key):
                return f"the name {key[:40]!r}", argument_problem(key)
            found = _unpassable_inside(item, f"{where}[{key!r}]" if where else repr(key))
            if found is not None:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _unpassable_inside(item, f"{where}[{index}]")
            if found is not None:
                return found
    return None


def env_problem(env: dict[str, str]) -> str | None:
    """Why the OS would refuse these environment variables (in `env`, or a serve.engine_variants entry's), or None."""
    total = 0
    for name, value in env.items():
        if not name:
            return "a variable with an empty name, which no environment can hold; name it or remove it"
        if "=" in name:
            return f"variable name {name!r} holds '=', which ends a name in the environment; rename it"
        problem = argument_problem(f"{name}={value}")
        if problem:
            return f"{name}: {problem}"
        total += os_bytes(f"{name}={value}") + 1
    if total > MAX_ENV_BYTES:
        return (f"{len(env)} variables of {total} bytes in all, above the {MAX_ENV_BYTES} bytes the run passes on to "
                f"every process it starts (the OS caps environment and command line together); shorten them")
    return None


def json_argument_problem(value: dict[str, Any]) -> str | None:
    """Why this mapping cannot travel as one JSON command-line argument (with room for what the pipeline adds)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return None  # not JSON at all: the engine's own argument check names it
    return argument_problem(text, MAX_ARG_BYTES - ARG_HEADROOM_BYTES)


def path_problem(path: str) -> str | None:
    """Why the OS would refuse `path` as a file or folder name, or None."""
    size = os_bytes(path)
    if size is not None and size > MAX_PATH_BYTES:
        return f"is {size} bytes long, above the {MAX_PATH_BYTES} a path may have (PATH_MAX); shorten it"
    for part in Path(path).parts:
        size = os_bytes(part)
        if size is not None and size > MAX_NAME_BYTES:
            return (f"has a component of {size} bytes ({part[:24]}...), above the {MAX_NAME_BYTES} a file name may "
                    f"have (NAME_MAX); shorten it")
    return None


def _checked_path(path: str) -> str:
    problem = path_problem(path)
    if problem:
        raise ValueError(problem)
    return path


# A file or folder the run reads or writes: its length is checked against what the file system takes.
PathStr = Annotated[str, AfterValidator(_checked_path)]


def redact_url(url: str) -> str:
    """`url` with the password of its user part replaced by ***: how a URL is printed and recorded (dry runs,
    manifests, a stage folder's config.yaml, error lines)."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return url
    if password is None:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{host}"))


def cross_field(field: str, message: str) -> PydanticCustomError:
    """A rule that ties fields together; `field` (relative to the model raising it) is the one blamed."""
    return PydanticCustomError("cross_field", "{message}", {"field": field, "message": message})


def _is_section(annotation: Any) -> bool:
    """A config section, or an Optional of one: it checks its own values."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union,
                                                                               types.UnionType) else (annotation,)
    return any(isinstance(a, type) and issubclass(a, BaseModel) for a in options)


def _is_number(annotation: Any) -> bool:
    """int, float, or an Optional of one."""
    if annotation in (int, float):
        return True
    return typing.get_origin(annotation) in (typing.Union,
                                             types.UnionType) and any(a in (int,
                                                                            float) for a in typing.get_args(annotation))


class Section(BaseModel):
    # allow_inf_nan=False: YAML reads .inf and .nan as floats, and neither is a usable setting anywhere.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bools_for_numbers_no_nul(cls, value, info):
        # pydantic reads true as 1; `seed: true` or `epochs: yes` is a mistake, not a number.
        if isinstance(value, bool) and _is_number(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, got {str(value).lower()}")
        # A NUL byte makes every file-system call and every process start fail with a traceback, and every value
        # must fit one command-line argument (`--set key=value` and the detached runner pass it as one; env and
        # engine_args reach processes as entries and flags): refused inside mappings and lists too.
        found = None if _is_section(cls.model_fields[info.field_name].annotation) else _unpassable_inside(value)
        if found is not None:
            where, problem = found
            raise ValueError(f"{where} {problem}" if where else problem)
        return value


# vLLM's names, checked against the installed vLLM when the config loads (eagle_pipeline/vllm_config.py).
AttentionBackend = Annotated[str, AfterValidator(lambda name: check_attention_backend(name))]
KvCacheDtype = Annotated[str, AfterValidator(lambda dtype: check_kv_cache_dtype(dtype))]


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


class SelfWrittenPrompts(Section):
    """The target writes its own user turns (Magpie): its chat template up to the user header, then sampling.
    A turn is kept only if it passes eagle_pipeline/prompt_filter.py; the bounds below are that filter's."""

    temperature: float = Field(1.0, gt=0, le=10, description="sampling temperature of the "
                                                             "user turns (not of the answers)")
    top_p: float = Field(0.99, gt=0, le=1)
    max_tokens: int = Field(96, ge=8, lt=MAX_TOKENS, description="a user turn's token budget; "
                                                                 "one cut off at it is dropped")
    min_words: int = Field(4, ge=1, le=100_000, description="shorter user turns are dropped")
    max_words: int = Field(80, ge=1, le=100_000, description="longer user turns are dropped")

    @model_validator(mode="after")
    def _word_bounds_ordered(self):
        if self.min_words > self.max_words:
            raise cross_field("min_words", f"{self.min_words} is above max_words "
                                           f"({self.max_words}); no turn could pass")
        return self


class DataConfig(Section):
    # "file": data.prompts; "self": the target writes them (data.self_written), on other topics than the eval prompts.
    prompt_source: Literal["file", "self"] = "file"
    prompts: PathStr = Field(description="JSONL file of prompts, or a local `datasets` folder (prompt_source file)")
    prompt_field: str = "prompt"
    self_written: SelfWrittenPrompts = Field(default_factory=SelfWrittenPrompts)
    eval_prompts: PathStr = Field(description="held-out prompts for stage 06, never used in training")
    num_samples: int = Field(ge=1, le=MAX_COUNT, description="how many training conversations to generate")
    num_eval_prompts: int = Field(32, ge=1, le=MAX_COUNT)


class GenerationConfig(Section):
    max_tokens: int = Field(256, ge=1, lt=MAX_TOKENS)
    temperature: float = Field(0.0, ge=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    reasoning: bool = Field(False, description="thinking on or off, through the template's "
                                               "own switch (enable_thinking, thinking, ...)")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra chat-template "
                                                                                   "arguments; override the "
                                                                                   "detected thinking switch")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _kwargs_fit_an_argument(cls, kwargs):
        problem = json_argument_problem(kwargs)  # stage 05's parity jobs get them as one JSON argument
        if problem:
            raise ValueError(f"as one JSON argument {problem}")
        return kwargs
    system_prompt: Optional[str] = None
    batch_size: int = Field(32, ge=1, le=MAX_COUNT, description="conversations the engine decodes at "
                                                                "once, and per part file (a crash "
                                                                "loses at most those not yet written)")
    refill: bool = Field(True, description="start the next conversation as soon as one finishes; false hands the "
                                           "engine fixed batches of batch_size (eagle_pipeline/answering.py)")
    dtype: Optional[Literal["bfloat16", "float16", "float32", "auto"]] = Field(
        None, description="the target's dtype while it answers (default: verifier.dtype); "
                          "stage 02 captures and stage 06 serves with verifier.dtype, so the "
                          "drafter still learns the served target's states and distribution")
    # Stage 01 drops a prompt that leaves less room than this (or than max_tokens, if lower) for its answer
    # within verifier.max_model_len (eagle_pipeline/prompt_fit.py).
    min_answer_tokens: int = Field(16, ge=1, lt=MAX_TOKENS, description="answer tokens a prompt must leave room for "
                                   "within verifier.max_model_len; prompts that leave less are dropped")
    max_truncated_share: float = Field(0.2, ge=0, le=1, description="share of answers that may stop at "
                                                                    "max_tokens before stage 01 warns "
                                                                    "(and records it in its manifest)")


class MooncakeSettings(Section):
    """The Mooncake store that carries hidden states from the capture servers to the trainer when
    hidden_states.transfer is mooncake (docs/online.md)."""

    master: Optional[str] = Field(None, description="host:port of a running Mooncake master; None: stage 04 starts a "
                                                    "master and a store on this host")
    store_gib: float = Field(4.0, gt=0, le=65536, description="memory of the store stage 04 starts beside its master: "
                                                              "the states in flight live there")
    protocol: Literal["tcp", "rdma"] = Field("tcp", description="Mooncake's transport between the hosts")
    device: str = Field("", description="RDMA device names, e.g. mlx5_0,mlx5_1; empty: Mooncake picks")
    local_hostname: Optional[str] = Field(None, description="this host's address as the store's peers "
                                                            "reach it; None: 127.0.0.1 with a local "
                                                            "master, else the host name's address")

    @field_validator("master")
    @classmethod
    def _host_and_port(cls, address):
        if address is not None:
            host, _, port = address.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{address!r} must be host:port, e.g. 10.0.0.5:50051")
        return address


class HiddenStatesConfig(Section):
    layer_ids: Optional[list[int]] = Field(None, description="aux layer ids (HF hidden_states "
                                                             "indices); default (2, L//2, L-3)")
    storage_dtype: StorageDtype = Field(StorageDtype.BFLOAT16, description="bfloat16, or fp8 with per-token "
                                                                           "scales (half the disk)")
    max_seq_len: int = Field(2048, ge=8, lt=MAX_TOKENS)
    batch_size: int = Field(16, ge=1, le=MAX_COUNT)
    # offline: stage 02 stores every sample's states; online: stage 04 asks vLLM capture servers for each sample's
    # states while it trains, through speculators' own online dataset, and discards them (docs/online.md).
    mode: Literal["offline", "online"] = Field("offline", description="offline: stage 02 stores the states; online: "
                                                                      "stage 04 captures them live and discards them")
    transfer: Literal["file", "fp8", "mooncake"] = Field(
        "file", description="online: how states reach the trainer: files on a disk both share, fp8-quantized files "
                            "(half the bytes), or a Mooncake store (no shared disk)")
    online_window: int = Field(2, ge=1, le=MAX_PARALLEL, description="online: samples whose states exist at once per "
                                                                     "training rank (1: the trainer asks in turn with "
                                                                     "its steps; N: N loader processes ask ahead)")
    capture_endpoints: list[str] = Field(default_factory=list, description="online: base URLs (http://host:port/v1) of "
                                         "capture servers started elsewhere, one per training rank in turn; empty: "
                                         "stage 04 starts one on this host")
    capture_retry_s: float = Field(300.0, ge=1, le=86400, description="online: how long a sample's capture is retried "
                                                                      "while its server does not answer (a restart); "
                                                                      "then training stops naming the server")
    # A capture server stage 04 starts on GPUs the trainer also uses takes only its share of them; stage 04's dry run
    # prints the memory plan that says whether the two fit (eagle_pipeline/online/memory.py).
    capture_gpu_memory_utilization: Optional[float] = Field(
        None, gt=0, le=1, description="online, cuda: the share of each GPU a capture server started by stage 04 takes "
                                      "(the trainer uses the rest); None: verifier.gpu_memory_utilization")
    mooncake: MooncakeSettings = Field(default_factory=MooncakeSettings)

    @field_validator("layer_ids")
    @classmethod
    def _ordered(cls, ids):
        # The range check needs the verifier's depth: eagle_pipeline.layer_ids.check_layer_ids at stage start.
        problem = None if ids is None else order_problem(ids)
        if problem:
            raise ValueError(problem)
        return ids

    @field_validator("capture_endpoints")
    @classmethod
    def _endpoint_urls(cls, urls):
        from urllib.parse import urlparse

        for url in urls:
            parsed = urlparse(url)
            try:
                port = parsed.port
            except ValueError:  # "Port out of range 0-65535", "Port could not be cast to integer value"
                raise ValueError(f"{redact_url(url)!r}: its port is not a number from 1 to 65535; e.g. "
                                 f"http://10.0.0.5:8000/v1") from None
            if parsed.scheme not in ("http", "https") or not parsed.hostname or port is None or port == 0:
                raise ValueError(f"{redact_url(url)!r} must be a server's base URL "
                                 "with its port, e.g. http://10.0.0.5:8000/v1")
        if len(set(urls)) != len(urls):
            raise ValueError("names a server twice; list each capture server once")
        return urls

    @field_serializer("capture_endpoints", when_used="json")
    def _without_passwords(self, urls):
        # What the manifests and each stage folder's config.yaml record: never a password.
        return [redact_url(url) for url in urls]

    @model_validator(mode="after")
    def _online_keys_need_online(self):
        if self.mode == "offline":
            if self.transfer == "fp8":
                raise cross_field("transfer", "fp8 quantizes states in flight, which mode: offline has none of; "
                                              "to store them in fp8 set storage_dtype: fp8")
            if (self.transfer != "file" or self.capture_endpoints or self.mooncake.master
                    or self.capture_gpu_memory_utilization):
                raise cross_field("mode", "offline stores the states and captures nothing live; set mode: online to "
                                          "use transfer, capture_endpoints, capture_gpu_memory_utilization or mooncake")
        elif self.storage_dtype != StorageDtype.BFLOAT16:
            raise cross_field("storage_dtype", "online stores no states (only a few validation "
                                               "rows, kept in the transfer's precision); to "
                                               "quantize the states in flight set transfer: fp8")
        if self.mooncake.master and self.transfer != "mooncake":
            raise cross_field("mooncake", f"a Mooncake master is set but transfer is {self.transfer}; set transfer: "
                                          f"mooncake or leave mooncake.master out")
        return self


class VocabConfig(Section):
    # At most the target's vocabulary: that needs the model, so stage 03 checks it (dry run included).
    draft_vocab_size: int = Field(ge=1, le=MAX_VOCAB)
    # A drafter to fine-tune can only keep its lm_head rows if the run uses its own draft vocabulary.
    from_drafter: Optional[PathStr] = Field(None, description="drafter folder whose d2t/t2d stage "
                                                              "03 adopts instead of counting tokens")


class DraftShape(Section):
    """An explicit drafter layer shape; None fields come from the verifier. A Llama layer needs the heads, head_dim
    and intermediate_size; an MLA layer (train.draft_layer: mla) keeps the verifier's MLA head dimensions and
    takes num_attention_heads, intermediate_size, hidden_act, rope_theta, rms_norm_eps, max_position_embeddings."""

    hidden_size: Optional[int] = Field(None, ge=1, le=MAX_WIDTH)
    num_hidden_layers: Optional[int] = Field(None, ge=1, le=256)
    num_attention_heads: Optional[int] = Field(None, ge=1, le=MAX_PARALLEL)
    num_key_value_heads: Optional[int] = Field(None, ge=1, le=MAX_PARALLEL)
    head_dim: Optional[int] = Field(None, ge=1, le=4096)
    intermediate_size: Optional[int] = Field(None, ge=1, le=MAX_WIDTH)
    hidden_act: Optional[str] = None
    rope_theta: Optional[float] = Field(None, gt=0, le=1e12)
    rms_norm_eps: Optional[float] = Field(None, gt=0, lt=1)
    max_position_embeddings: Optional[int] = Field(None, ge=1, le=MAX_TOKENS)

    @model_validator(mode="after")
    def _heads_group_evenly(self):
        # Grouped-query attention shares each key/value head among an equal number of query heads.
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if heads is not None and kv is not None and heads % kv:
            raise cross_field("num_attention_heads", f"{heads} is not a multiple of num_key_value_heads ({kv}); "
                                                     f"choose head counts that divide evenly")
        return self


class TrainConfig(Section):
    epochs: int = Field(3, ge=1, le=100_000)
    lr: float = Field(1e-4, gt=0, le=1)
    optimizer: Literal["adamw", "muon"] = "adamw"
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    total_seq_len: int = Field(2048, ge=8, le=MAX_TOKENS, description="tokens per packed batch")
    # How samples fill those batches: "sequential" is speculators' own (next samples in shuffled order until
    # one does not fit), "best_fit" fills the open batch with the least room (patches/speculators_packing.py).
    packing: Literal["sequential", "best_fit"] = "sequential"
    ttt_steps: int = Field(3, ge=1, le=64)
    # Loss weight of draft position k is decay**k; below 1 it spends the drafter's capacity on the early
    # positions, which decide most of the acceptance length.
    ttt_step_loss_decay: float = Field(1.0, gt=0, le=1)
    # Validation takes whole topics (the prompts' `topic`), about this share of the samples:
    # eagle_pipeline/train/topic_split.py.
    val_ratio: float = Field(0.05, gt=0, lt=1)
    early_stop_patience: Optional[int] = Field(None, ge=1, le=100_000,
                                               description="epochs without a lower validation loss "
                                                           "before training stops; None: every epoch")
    keep_last: int = Field(2, ge=1, le=100_000)
    # Which checkpoint best.json names (and stage 05 converts): the one whose replay on held-out conversations
    # predicts the longest accepted chains, or the lowest validation loss
    # (eagle_pipeline/train/predicted_acceptance.py).
    select_by: Literal["predicted_acceptance", "val_loss"] = "predicted_acceptance"
    predict_conversations: int = Field(16, ge=0, le=MAX_COUNT,
                                       description="validation conversations each epoch's "
                                                   "checkpoint is replayed on; 0: none")
    num_workers: int = Field(2, ge=0, le=MAX_PARALLEL)
    threads: Optional[int] = Field(None, ge=1, le=MAX_PARALLEL, description="torch threads for CPU "
                                                                            "training; None uses every core")
    num_gpus: int = Field(0, ge=0, le=MAX_PARALLEL, description="0 trains on the CPU; 1 or more "
                                                                "launches torch.distributed.run")
    fsdp_shard: bool = Field(False, description="multi-GPU: shard the drafter with FSDP instead of replicating it")
    draft_shape: Optional[DraftShape] = Field(None, description="explicit drafter shape; None "
                                                                "derives it from the verifier")
    draft_layer: Literal["llama", "mla"] = Field(
        "llama", description="the drafter's decoder layer: llama (Llama-shaped attention) or mla (the target's MLA "
                             "attention, vLLM's Eagle3DeepseekV2ForCausalLM)")
    # speculators' EAGLE-3 defaults; drafters trained with SpecForge (and SGLang) use all False.
    norm_before_residual: bool = True
    norm_before_fc: bool = True
    fc_norm: bool = False
    norm_output: bool = True
    init_from: Optional[PathStr] = Field(None, description="drafter directory to fine-tune from: "
                                                           "speculators or flat LlamaForCausalLMEagle3")
    # A flat drafter's aux ids mean different layers in vLLM and SGLang (docs/layer_ids.md); a folder
    # with only eagle_config ids does not say which, so the run must.
    init_from_convention: Optional[Literal["vllm", "sglang"]] = Field(
        None, description="how init_from's eagle_config aux layer ids are numbered (SpecForge drafters: sglang)")

    @field_validator("predict_conversations")
    @classmethod
    def _prediction_to_select_by(cls, conversations, info):
        if conversations == 0 and info.data.get("select_by") == "predicted_acceptance":
            raise ValueError("0 leaves nothing to select by; set select_by: "
                             "val_loss, or replay at least one conversation")
        return conversations

    @field_validator("fsdp_shard")
    @classmethod
    def _shard_needs_gpus(cls, shard, info):
        if shard and info.data.get("num_gpus") == 0:
            raise ValueError("needs GPUs to shard the drafter across; set train.num_gpus, or fsdp_shard false")
        return shard

    @field_validator("fc_norm")
    @classmethod
    def _one_fc_norm(cls, fc_norm, info):
        # An MLA drafter has no input norm (_mla_has_no_input_norm), so its fc_norm stands alone.
        if fc_norm and info.data.get("norm_before_fc") and info.data.get("draft_layer") != "mla":
            raise ValueError("speculators allows only one of norm_before_fc and fc_norm; set one false")
        return fc_norm

    @field_validator("init_from_convention")
    @classmethod
    def _convention_needs_init_from(cls, convention, info):
        if convention is not None and not info.data.get("init_from"):
            raise ValueError("names the layer-id convention of train.init_from, which is not set; set both or neither")
        return convention

    @model_validator(mode="after")
    def _mla_has_no_input_norm(self):
        # vLLM's Eagle3DeepseekV2ForCausalLM has no input norm before fc: an MLA drafter trains without one, the
        # default true giving way, an explicit true refused.
        if self.draft_layer == "mla" and self.norm_before_fc:
            if "norm_before_fc" in self.model_fields_set:
                raise cross_field("norm_before_fc", "draft_layer mla has no norm before fc (vLLM's "
                                                    "Eagle3DeepseekV2ForCausalLM reads none); set norm_before_fc false")
            self.norm_before_fc = False
        return self


class ConvertConfig(Section):
    sglang: bool = False
    reference_dir: Optional[PathStr] = Field(None, description="released drafter to compare shapes against")
    # How stage 05 checks that the conversion keeps the drafter's drafts: "replay" replays the checkpoint and
    # the converted folder offline on held-out conversations (no engine start); "vllm" serves each in a vLLM
    # engine of its own (two target cold starts) on eval prompts (eagle_pipeline/drafter_checks/parity.py).
    parity: Literal["replay", "vllm"] = "replay"
    parity_prompts: int = Field(4, ge=1, le=MAX_COUNT, description="held-out conversations (replay) "
                                                                   "or eval prompts (vllm)")
    parity_max_tokens: int = Field(32, ge=1, le=MAX_TOKENS)
    parity_tolerance: float = Field(0.05, ge=0, le=1, description="allowed per-position acceptance difference")
    # Each check starts its own engine: a cold start of a ~600 GB target alone takes tens of minutes.
    engine_timeout_s: float = Field(3600.0, gt=0, le=7 * 86400, description="seconds one vLLM job "
                                                                            "of the checks may take")


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


class RunConfig(Section):
    run_name: str
    data_root: PathStr
    seed: int = Field(0, ge=0, le=MAX_SEED)
    device: Literal["cpu", "cuda"] = "cpu"
    disk_budget_gb: Optional[float] = Field(None, gt=0, le=1e7, description="the most the run folder may hold; "
                                                                            "every stage refuses to go beyond it "
                                                                            "(eagle_pipeline/plan/preconditions.py)")
    # Extra environment for every process the run starts: vLLM engines and servers, the training launcher
    # and its ranks, the detached runner (NCCL settings, CUDA_VISIBLE_DEVICES, VLLM_* switches).
    env: dict[str, str] = Field(default_factory=dict, description="environment variables for "
                                                                  "every process the run starts")

    @field_validator("env")
    @classmethod
    def _env_the_os_takes(cls, env):
        # Refused here, not by the first process start (os.environ and execve raise, after --force has deleted).
        problem = env_problem(env)
        if problem:
            raise ValueError(problem)
        return env
    verifier: VerifierConfig
    data: DataConfig
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    hidden_states: HiddenStatesConfig = Field(default_factory=HiddenStatesConfig)
    vocab: VocabConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    convert: ConvertConfig = Field(default_factory=ConvertConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @field_validator("run_name")
    @classmethod
    def _run_name_stays_inside(cls, name):
        # The run folder is data_root/run_name and --force deletes inside it: it must not point elsewhere.
        if not name.strip() or name in (".", "..") or any(c in name for c in "/\\") or Path(name).is_absolute():
            raise ValueError(f"{name!r} must be a plain folder name (no '/', '\\', '.' or '..'), e.g. my-run")
        return _checked_path(name)

    @field_validator("data_root")
    @classmethod
    def _data_root_given(cls, root):
        if not root.strip():
            raise ValueError("must not be empty (it would write runs into the "
                             "repository itself); set a folder, e.g. runs")
        return root

    @model_validator(mode="after")
    def _lengths_fit_the_context(self):
        # The engine needs at least one prompt token besides what it generates or stores.
        limit = self.verifier.max_model_len
        for field, value in (("generation.max_tokens", self.generation.max_tokens),
                             ("hidden_states.max_seq_len", self.hidden_states.max_seq_len),
                             ("serve.max_tokens", self.serve.max_tokens)):
            if value >= limit:
                raise cross_field(field, f"{value} must be below verifier.max_model_len ({limit}); "
                                         f"lower it or raise verifier.max_model_len")
        return self

    @model_validator(mode="after")
    def _parity_vllm_can_serve_the_checkpoint(self):
        # convert.parity: vllm serves stage 04's speculators checkpoint beside the flat folder; vLLM reads a
        # speculators config with llama or qwen3 layers only (vllm/transformers_utils/configs/speculators/algos.py).
        if self.convert.parity == "vllm" and self.train.draft_layer == "mla":
            raise cross_field("convert.parity", "vllm serves the speculators checkpoint, which vLLM reads for Llama "
                                                "and Qwen3 layers only, not train.draft_layer mla; use replay (the "
                                                "default): stage 06 then compares what vLLM serves with it")
        return self

    # -- derived paths -------------------------------------------------------------------------
    def resolve_path(self, value: str) -> Path:
        return resolve_path(value)

    @property
    def run_dir(self) -> Path:
        return resolve_path(self.data_root) / self.run_name

    def stage_dir(self, stage: str) -> Path:
        return self.run_dir / stage

    def fingerprint(self) -> str:
        return value_fingerprint(self.model_dump(mode="json"))


def resolve_path(value: str) -> Path:
    if value.startswith("embedded:"):
        return Path(value)
    path = Path(value).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path


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


# -- loading ---------------------------------------------------------------------------------------

def _blame(origins: Origins, loc: tuple, default: str, message: str = "") -> str:
    """The source that set the value at `loc` (or the nearest section above it); for a rule across fields, a
    `--set` of another field the message names, where the value at `loc` came from a file: the override is what
    broke a config that loaded before."""
    found = default
    for n in range(len(loc), 0, -1):
        if tuple(loc[:n]) in origins:
            found = origins[tuple(loc[:n])]
            break
    if found.startswith("--set "):
        return found
    for key, origin in origins.items():
        if not origin.startswith("--set ") or tuple(key) == tuple(loc[:len(key)]):
            continue
        dotted = ".".join(key)
        # Named in full (verifier.max_model_len), or by its own name beside the blamed field (num_gpus in train).
        sibling = tuple(key[:-1]) == tuple(loc[:len(key) - 1]) and len(loc) == len(key)
        if re.search(rf"(?<![\w.]){re.escape(dotted)}\b", message) or (
                sibling and re.search(rf"(?<![\w.]){re.escape(key[-1])}\b", message)):
            return origin
    return found


def _read_by_yaml_as(value: Any) -> str | None:
    """What YAML made of an unquoted value where text was expected, or None."""
    import datetime as dt

    if isinstance(value, bool):
        return f"the boolean {str(value).lower()} (as it reads {'on, yes and true' if value else 'off, no and false'})"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, (dt.date, dt.datetime)):
        return f"a date ({value.isoformat()})"
    return None


def _quote_it(loc: tuple[str, ...], value: Any) -> str | None:
    """The error line's text for a value YAML typed where the schema wants text: say to quote it."""
    what = _read_by_yaml_as(value)
    if what is None:
        return None
    example = ("on" if value is True else "off" if value is False
               else value.isoformat() if hasattr(value, "isoformat") else value)
    if loc and loc[-1] == "[key]":  # a mapping's name (env: {1: x}): pydantic puts it at <mapping>.<name>.[key]
        return (f"{'.'.join(loc[:-2])}: YAML read the unquoted name {loc[-2]} as {what}, not text; quote it, "
                f"e.g. \"{example}\": ...")
    return f"{'.'.join(loc)}: YAML read the unquoted value as {what}, not text; quote it, e.g. {loc[-1]}: \"{example}\""


def _explain(error: ValidationError, source: str, section: str | None = None, origins: Origins | None = None) -> str:
    first = error.errors()[0]
    loc = tuple(str(p) for p in ((section, *first["loc"]) if section else first["loc"]))
    kind = first["type"]
    if kind == "cross_field":  # a rule across fields names the one it blames
        loc = loc + tuple(first["ctx"]["field"].split("."))
    said = {"value_error": lambda: first["ctx"]["error"],
            "cross_field": lambda: first["ctx"]["message"]}.get(kind, str)()
    source = _blame(origins or {}, loc, source, str(said))
    where = ".".join(loc) or "(top level)"
    if kind == "string_type" and _quote_it(loc, first.get("input")):
        return f"{source}: {_quote_it(loc, first.get('input'))}"
    if kind == "extra_forbidden":
        parent, _, key = where.rpartition(".")
        place = f"section {parent!r}" if parent else "the top level"
        return f"{source}: unknown key {key!r} in {place}; check its spelling against configs/tiny.yaml"
    if kind == "missing":
        return f"{source}: {where} is required; set it in the config or with --set {where}=..."
    if kind == "value_error":  # the schema's own validators word the whole message
        return f"{source}: {where}: {first['ctx']['error']}"
    if kind == "cross_field":
        return f"{source}: {where}: {first['ctx']['message']}"
    return f"{source}: {where}: {first['msg']} (got {first.get('input')!r})"


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    path, data, origins = read_config_file(Path(path), overrides)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise BadInput(_explain(e, str(path), origins=origins)) from None


def load_section(name: str, values: dict[str, Any], source: str) -> Section:
    """One section of a run config (e.g. "train") validated on its own, with load_config's error lines."""
    section = RunConfig.model_fields[name].annotation
    try:
        return section.model_validate(values)
    except ValidationError as e:
        raise BadInput(_explain(e, source, section=name)) from None


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
