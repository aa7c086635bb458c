"""Capture a verifier's auxiliary hidden states with vLLM's offline engine and store them for speculators.

How vLLM's `extract_hidden_states` method and its hidden-states connector hand over each finished request's states
is docs/engines.md's ("Hidden-state capture through vLLM"); the file is read, deleted, checked and written as
`hs_<row>.safetensors` in speculators' offline format.

Layer ids follow eagle_pipeline.layer_ids (HF `output_hidden_states` indices); vLLM is asked for the aux
ids plus the final layer (its output before the final norm), which speculators expects in the last slot
(`verifier_last_hidden_states`). The stored sample format belongs to eagle_pipeline.samples.

The engine starts once per `HiddenStateCapture` context. On a CPU host without tensor parallelism it runs in the
stage's own process (engine.in_process_engine, set through engine.apply_engine_env), and `capture` steps it until
the connector has written every finished request; otherwise (the GPU host, tensor parallelism) vLLM runs it in
engine processes it spawns, for which the calling script must guard its entry point with
`if __name__ == "__main__":`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle_pipeline import atomic, engine_starts
from eagle_pipeline.engine import offline_engine
from eagle_pipeline.errors import BadInput
from eagle_pipeline.layer_ids import capture_layer_ids
from eagle_pipeline.samples import StorageDtype, check_sample, write_sample

if TYPE_CHECKING:
    import torch

# The step after a batch ends hands every pending write to the connector; this is a bound, not a wait.
MAX_STEPS_TO_WRITE = 100

# A capture engine's states come out in verifier.dtype; `auto` counts as the bf16 most checkpoints carry.
ENGINE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def capture_sizing(longest_sequence: int) -> dict[str, int]:
    """`max_model_len` and `max_num_batched_tokens` of a capture engine whose longest sequence has this many
    tokens: room for it and the one token each request samples, and a batch of one such prefill (why the data
    sizes it: docs/engines.md, "Hidden-state capture through vLLM")."""
    size = int(longest_sequence) + 1
    return {"max_model_len": size, "max_num_batched_tokens": size}


def capture_memory_line(cfg, num_states: int, hidden_size: int, longest_sequence: int) -> str:
    """What a dry run prints: the hidden states a capture engine of `cfg` (a RunConfig) holds for one batch
    (`capture_sizing`), beside the KV-cache budget they come out of (`ENGINE_DTYPE_BYTES`)."""
    v = cfg.verifier
    width = ENGINE_DTYPE_BYTES.get(v.dtype, 2)
    per_token = num_states * hidden_size * width
    batch = capture_sizing(longest_sequence)["max_num_batched_tokens"]
    budget = (f"verifier.cpu_kvcache_gib {v.cpu_kvcache_gib} GiB" if cfg.device == "cpu" else
              f"verifier.gpu_memory_utilization {v.gpu_memory_utilization:.2f} "
              "of each GPU, less weights and activations")
    return (f"  capture memory: {num_states} states x {hidden_size} x {width} B = {per_token / 1e3:.1f} "
            f"KB per token; a batch of {batch} tokens (max_num_batched_tokens) holds "
            f"{per_token * batch / 2**20:.1f} MiB of hidden states, out of the KV-cache budget ({budget})")


def speculative_config(layer_ids: Sequence[int], num_layers: int) -> dict[str, Any]:
    return {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": capture_layer_ids(layer_ids,
                                                                                                   num_layers)}},
    }


CPU_HS_CONNECTORS_MODULE = "patches.cpu_hs_connectors"
# The connector (class, module; None: vLLM's own) of each transfer (hidden_states.transfer) on each device: files
# in bf16 (vLLM's), files in fp8 and a Mooncake store (speculators' hs_connectors), each with a CPU variant in
# patches/ where upstream's needs CUDA streams.
CONNECTORS: dict[tuple[str, str], tuple[str, str | None]] = {
    ("file", "cuda"): ("ExampleHiddenStatesConnector", None),
    ("file", "cpu"): ("CpuHiddenStatesConnector", "patches.cpu_hidden_states_connector"),
    ("fp8", "cuda"): ("FP8HiddenStatesConnector", "hs_connectors.fp8_hidden_states_connector"),
    ("fp8", "cpu"): ("CpuFp8HiddenStatesConnector", CPU_HS_CONNECTORS_MODULE),
    ("mooncake", "cuda"): ("MooncakeHiddenStatesConnector", "hs_connectors.mooncake_hidden_states_connector"),
    ("mooncake", "cpu"): ("CpuMooncakeHiddenStatesConnector", CPU_HS_CONNECTORS_MODULE),
}


def kv_transfer_config(storage_path: str | os.PathLike | None, device_type: str, transfer: str = "file",
                       mooncake: dict[str, Any] | None = None) -> dict[str, Any]:
    """The hidden-states connector for this device and transfer: upstream's on CUDA, the patched CPU one on CPU.
    `storage_path` is where file and fp8 connectors write; `mooncake` (MooncakeStoreConfig's fields) is where the
    Mooncake connector puts them."""
    if device_type not in ("cpu", "cuda"):
        raise RuntimeError(f"hidden-state capture supports CPU and CUDA platforms, not {device_type!r}")
    connector, module = CONNECTORS[(transfer, device_type)]
    if transfer == "mooncake":
        if mooncake is None:
            raise ValueError("the Mooncake connector needs the store's settings")
        extra: dict[str, Any] = {"mooncake": dict(mooncake)}
    else:
        if storage_path is None:
            raise ValueError(f"the {transfer} connector needs a storage path")
        extra = {"shared_storage_path": str(storage_path)}
    config: dict[str, Any] = {"kv_role": "kv_producer", "kv_connector_extra_config": extra, "kv_connector": connector}
    if module is not None:
        config["kv_connector_module_path"] = module
    return config


def one_pass_engine_args(cfg, layer_ids: Sequence[int], num_layers: int, storage_path: str | os.PathLike) -> dict:
    """What stage 01's answering engine adds to capture while it answers (hidden_states.one_pass, docs/one_pass.md):
    the capture's speculative method and connector. The V1 model runner's async scheduling feeds the dummy draft the
    first of a step's two sampled tokens where it needs the last (vLLM #56417): off where that runner runs on a GPU.
    Each request then asks for its generated tokens' states too (`ONE_PASS_REQUEST`)."""
    args = {"speculative_config": speculative_config(layer_ids, num_layers),
            "kv_transfer_config": kv_transfer_config(storage_path, cfg.device)}
    if cfg.device == "cuda" and cfg.verifier.model_runner == "v1":
        args["async_scheduling"] = False
    return args


# SamplingParams.extra_args of a one-pass request: the connector saves prompt + completion less its last token.
ONE_PASS_REQUEST = {"kv_transfer_params": {"include_output_tokens": True}}


def connector_sample(path: str, expected_token_ids: Sequence[int], *, num_states: int, where: str,
                     wait: bool = True) -> dict[str, torch.Tensor] | None:
    """The states the hidden-states connector wrote to `path` (a finished request's `hidden_states_path`), read,
    removed with its lock file and checked against `expected_token_ids`; None while the write is still under way and
    not `wait`. vLLM's load_hidden_states without the wait: the connector holds an exclusive flock on path.lock from
    the request's first step until the file is written, which an in-process engine does only on a later step."""
    import fcntl

    from safetensors.torch import load_file

    with open(path + ".lock") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_SH | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            return None
        data = load_file(path)
    for name in (path, path + ".lock"):
        Path(name).unlink(missing_ok=True)
    check_sample(data, expected_token_ids, num_states=num_states, where=where)
    return {"hidden_states": data["hidden_states"], "token_ids": data["token_ids"].long()}


def let_the_connector_write(llm) -> None:
    """Step an in-process engine until its connector has written every finished request's states.

    The connector writes a request's states one engine step after the request finishes (the scheduler hands the
    pending save to the worker with the next step), and `connector_sample` waits on the file's lock until that write
    is done. Engine processes keep stepping on their own; an engine in this process steps only when called, and
    `generate` returns as soon as the outputs are complete, so the reader would wait forever. The scheduler holds
    each request until its write has been handed over.
    """
    # An in-process client holds the engine core itself (vLLM's InprocClient); a multiprocess client talks to it in
    # another process, which needs no help.
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    if core is None:
        return
    for _ in range(MAX_STEPS_TO_WRITE):
        if not core.scheduler.has_requests():
            return
        llm.llm_engine.step()
    raise RuntimeError(f"capture: vLLM still holds finished requests after {MAX_STEPS_TO_WRITE} engine steps; "
                       "their hidden states were never written")


def _platform_device_type() -> str:
    """'cpu' or 'cuda' (ROCm included: upstream's connector runs there through torch.cuda), else vLLM's name."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return "cpu"
    if current_platform.is_cuda_alike():
        return "cuda"
    return current_platform.device_type


class HiddenStateCapture:
    """vLLM engine that returns per-token hidden states for batches of token id lists.

    with HiddenStateCapture(verifier_dir, [2, 15, 27], num_layers=30, max_model_len=2048) as cap:
        for sample in cap.capture([[1, 2, 3], [4, 5]]):
            sample["hidden_states"]  # [seq, 4, H] in the engine dtype; sample["token_ids"] int64 [seq]
    """

    def __init__(
        self,
        verifier_dir: str | os.PathLike,
        layer_ids: Sequence[int],
        *,
        num_layers: int,
        tensor_parallel_size: int = 1,
        dtype: str = "bfloat16",
        max_model_len: int = 4096,
        max_num_batched_tokens: int | None = None,
        trust_remote_code: bool = False,
        extra_engine_args: dict[str, Any] | None = None,
        storage_path: str | os.PathLike | None = None,
    ):
        self.verifier_dir = Path(verifier_dir)
        self.layer_ids = list(layer_ids)
        self.num_layers = num_layers
        self.vllm_ids = capture_layer_ids(self.layer_ids, num_layers)
        self.tensor_parallel_size = tensor_parallel_size
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.trust_remote_code = trust_remote_code
        self.extra_engine_args = dict(extra_engine_args or {})
        self._requested_storage_path = storage_path
        self.storage_path: Path | None = None
        self._owns_storage = False
        self._llm = None

    @property
    def num_states(self) -> int:
        return len(self.vllm_ids)

    def engine_args(self, storage_path: str | os.PathLike, device_type: str) -> dict[str, Any]:
        args: dict[str, Any] = {
            "model": str(self.verifier_dir),
            "tokenizer": str(self.verifier_dir),
            "dtype": self.dtype,
            "max_model_len": self.max_model_len,
            "tensor_parallel_size": self.tensor_parallel_size,
            "trust_remote_code": self.trust_remote_code,
            # Each request is a one-off prefill; skipping cached prefixes would only add the risk of
            # reading hidden-state blocks written by another request.
            "enable_prefix_caching": False,
            "speculative_config": speculative_config(self.layer_ids, self.num_layers),
            "kv_transfer_config": kv_transfer_config(storage_path, device_type),
        }
        if self.max_num_batched_tokens is not None:
            args["max_num_batched_tokens"] = self.max_num_batched_tokens
        args.update(self.extra_engine_args)  # verifier.engine_args may size the batch otherwise
        return args

    def __enter__(self) -> "HiddenStateCapture":
        if self._requested_storage_path is None:
            self.storage_path = Path(tempfile.mkdtemp(prefix="hs-capture-"))
            self._owns_storage = True
        else:
            self.storage_path = Path(self._requested_storage_path)
            self.storage_path.mkdir(parents=True, exist_ok=True)
        args = self.engine_args(self.storage_path, _platform_device_type())
        # In this process or with engine processes, as the environment says (engine.apply_engine_env); the engine
        # core and workers import the connector module (patches/, part of the installed package) by name either way.
        try:
            with engine_starts.timed("hidden-state capture engine"):
                self._llm = offline_engine(**args)
        except BaseException:
            self._remove_storage()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        if self._llm is not None:
            engine_core = getattr(self._llm.llm_engine, "engine_core", None)
            if engine_core is not None:
                engine_core.shutdown()
            self._llm = None
        self._remove_storage()

    def _remove_storage(self) -> None:
        if self._owns_storage and self.storage_path is not None:
            shutil.rmtree(self.storage_path, ignore_errors=True)
            self._owns_storage = False

    def capture(self, batch: Sequence[Sequence[int]]) -> list[dict[str, torch.Tensor]]:
        """Hidden states for each token id list, in order: dicts with `hidden_states` and `token_ids`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._llm is None:
            raise RuntimeError("HiddenStateCapture.capture() called outside its `with` block")
        prompts = []
        for i, ids in enumerate(batch):
            ids = [int(t) for t in ids]
            # The engine needs room for the one token it samples after the prompt.
            if not 0 < len(ids) < self.max_model_len:
                raise BadInput(
                    f"capture: sequence {i} of the batch has {len(ids)} tokens; it must have 1 to "
                    f"{self.max_model_len - 1} (max_model_len - 1): raise max_model_len or shorten the data"
                )
            prompts.append(TokensPrompt(prompt_token_ids=ids))

        # The sampled token is irrelevant; max_tokens=1 ends each request right after its prefill.
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        outputs = self._llm.generate(prompts, params, use_tqdm=False)
        let_the_connector_write(self._llm)

        samples = []
        paths = [(out.kv_transfer_params or {}).get("hidden_states_path") for out in outputs]
        try:
            for i, (prompt, path) in enumerate(zip(prompts, paths)):
                if path is None:
                    raise RuntimeError(f"capture: vLLM returned no hidden_states_path for sequence {i}")
                samples.append(connector_sample(path, prompt["prompt_token_ids"], num_states=self.num_states,
                                                where=f"captured sequence {i} ({path})"))
        finally:
            for path in filter(None, paths):
                for name in (path, path + ".lock"):
                    Path(name).unlink(missing_ok=True)
        return samples


def _main(argv: Sequence[str] | None = None) -> None:
    """Capture a JSON list of token id lists into OUT/hs_<i>.safetensors (a tool for checks and timing)."""
    import argparse
    import json
    import time

    parser = argparse.ArgumentParser(prog="python -m eagle_pipeline.capture", description=_main.__doc__)
    parser.add_argument("--verifier", required=True, help="HF model directory of the verifier")
    parser.add_argument("--layer-ids", required=True, help="aux ids, HF hidden_states indices, e.g. 2,15,27")
    parser.add_argument("--num-layers", type=int, required=True)
    parser.add_argument("--tokens", required=True, help="JSON file: a list of token id lists")
    parser.add_argument("--out", required=True, help="folder for hs_<i>.safetensors and timing.json")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--storage-dtype", choices=[d.value for d in StorageDtype], default=StorageDtype.BFLOAT16.value)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--extra-engine-args", default="{}", help="JSON dict passed on to vllm.LLM")
    parser.add_argument("--storage-path", default=None, help="connector scratch folder (default: a temp folder)")
    args = parser.parse_args(argv)

    sequences = json.loads(Path(args.tokens).read_text())
    layer_ids = [int(k) for k in args.layer_ids.split(",")]
    started = time.perf_counter()
    with HiddenStateCapture(
        args.verifier,
        layer_ids,
        num_layers=args.num_layers,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        extra_engine_args=json.loads(args.extra_engine_args),
        storage_path=args.storage_path,
    ) as capture:
        engine_start_s = time.perf_counter() - started
        capture_s = write_s = 0.0
        for start in range(0, len(sequences), args.batch_size):
            batch = sequences[start : start + args.batch_size]
            t0 = time.perf_counter()
            samples = capture.capture(batch)
            t1 = time.perf_counter()
            for offset, sample in enumerate(samples):
                write_sample(
                    args.out, start + offset, sample, batch[offset],
                    num_states=capture.num_states, storage_dtype=args.storage_dtype,
                )
            capture_s += t1 - t0
            write_s += time.perf_counter() - t1
    num_tokens = sum(len(s) for s in sequences)
    timing = {
        "engine_start_s": engine_start_s,
        "capture_s": capture_s,
        "write_s": write_s,
        "num_sequences": len(sequences),
        "num_tokens": num_tokens,
        "capture_tokens_per_s": num_tokens / capture_s,
        "tokens_per_s_with_writes": num_tokens / (capture_s + write_s),
    }
    atomic.write_json(Path(args.out) / "timing.json", timing)
    print(json.dumps(timing))


if __name__ == "__main__":
    _main()
