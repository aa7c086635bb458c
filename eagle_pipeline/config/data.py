"""The sections that shape the training data: `data` (prompts), `generation` (stage 01's answers),
`hidden_states` (stage 02's capture, online or offline) and `vocab` (stage 03's draft vocabulary)."""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import (
    Field,
    field_serializer,
    field_validator,
    model_validator,
)

from eagle_pipeline.config.base import (
    MAX_COUNT,
    MAX_PARALLEL,
    MAX_TOKENS,
    MAX_VOCAB,
    PathStr,
    Section,
    cross_field,
    json_argument_problem,
    redact_url,
)
from eagle_pipeline.layer_ids import order_problem
from eagle_pipeline.samples import StorageDtype


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
    one_pass: bool = Field(False, description="stage 01 captures the states while it answers and stage 02 starts no "
                                              "engine (docs/one_pass.md)")

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
        elif self.one_pass:
            raise cross_field("one_pass", "speculators 0.9's online dataset prefills every sample itself, so states "
                                          "captured while stage 01 answers cannot reach it; set mode: offline or "
                                          "one_pass: false")
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
