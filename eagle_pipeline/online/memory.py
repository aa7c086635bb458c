"""Whether an online run's target and trainer fit on the same GPUs (co-located): the capture server holds
`hidden_states.capture_gpu_memory_utilization` of every GPU and the trainer, sharded with FSDP over the same GPUs,
the rest. Every figure is an estimate whose parts a dry run prints; the constants below are its assumptions, sized
for a Kimi-K2.5-class target on Blackwell GPUs (docs/online.md, "Kimi-K2.5 on the one 8-GPU host", shows the
arithmetic, why time-slicing the GPUs does not fit, and that the first run should check it with `nvidia-smi`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from eagle_pipeline.drafter.layouts import DFLASH, MLA
from eagle_pipeline.drafter.planned import drafter_params, layer_params, planned_draft_dims
from eagle_pipeline.gpus import CUDA_CONTEXT_GIB, GIB, gpu_memory_bytes

# vLLM's prefill activations for one batch of the longest capture sequence, profiled by vLLM at start-up (an
# MoE target of hidden 7168 at 4k tokens: a few GiB; CUDA graphs matter little to prefill-only capture).
VLLM_ACTIVATIONS_GIB = 3.0
# Room left free on every GPU for fragmentation and what the estimate misses.
MARGIN_FRACTION = 0.05


def attention_activations(dims) -> int:
    """Activation elements one token holds in one pass of the drafter layer's attention, o_proj's output aside. A
    Llama layer's: q, k, v and the attention output. An MLA layer's (transformers' DeepseekV3Attention): the query
    latent and its norm (q_lora_rank each, none without one), the per-head queries (heads x qk, qk = qk_nope +
    qk_rope: 192 for Kimi-K2.5), the kv latent with the rope key (kv_lora_rank + qk_rope) and the latent's norm, the
    per-head keys without rope and the values (heads x (qk_nope + v_head_dim)), the queries and keys the attention
    reads (two new heads x qk tensors: the rotated slice concatenated back) and its output (heads x v_head_dim: 128
    wide for Kimi-K2.5)."""
    heads = dims.num_attention_heads
    if dims.layer_shape != MLA:
        return (heads + 2 * dims.num_key_value_heads) * dims.head_dim + heads * dims.head_dim
    qk = dims.qk_nope_head_dim + dims.qk_rope_head_dim
    q_latent = 2 * dims.q_lora_rank if dims.q_lora_rank is not None else 0
    kv_latent = 2 * dims.kv_lora_rank + dims.qk_rope_head_dim
    return (q_latent + kv_latent + heads * qk + heads * (dims.qk_nope_head_dim + dims.v_head_dim) + 2 * heads * qk
            + heads * dims.v_head_dim)


def layer_activations(dims) -> int:
    """Activation elements (bf16 under speculators' autocast) one token holds in one pass of the drafter's decoder
    layer for the backward pass: its attention's (`attention_activations`), and the norms', o_proj's and the MLP's
    outputs (4 x hidden + 3 x intermediate)."""
    return attention_activations(dims) + 4 * dims.hidden_size + 3 * dims.intermediate_size


def activation_bytes_per_token(layer_elements: int, draft_vocab: int, vocab: int, ttt_steps: int) -> int:
    """Activation bytes a training token holds for the backward pass: per TTT step its decoder layer
    (`layer_activations`, in bf16) and its draft logits (bf16 and a float32 log-softmax and its gradient); once, the
    teacher's logits over the target vocabulary (bf16) and their softmax over the draft vocabulary (float32)."""
    layer = 2 * layer_elements
    logits = (2 + 4 + 4) * draft_vocab
    teacher = 2 * vocab + 4 * draft_vocab
    return ttt_steps * (layer + logits) + teacher


def replicated_params(text_config: dict) -> int:
    """Parameters that vLLM's tensor parallelism does not split, so that every GPU holds them whole
    (vllm/model_executor/models/deepseek_v2.py and its kin): each layer's two RMSNorms; on an MLA target the
    low-rank projections `q_a_proj` and `kv_a_proj_with_mqa` (ReplicatedLinear, or fused with `disable_tp`) and
    their norms; on an MoE target each MoE layer's router `gate` (GateLinear, a ReplicatedLinear) and its score
    bias; the final norm. The embedding and lm_head are split by vocabulary (VocabParallelEmbedding,
    ParallelLMHead)."""
    hidden = int(text_config["hidden_size"])
    layers = int(text_config["num_hidden_layers"])
    per_layer = 2 * hidden
    if text_config.get("kv_lora_rank"):
        q_rank = int(text_config.get("q_lora_rank") or 0)
        kv_rank = int(text_config["kv_lora_rank"])
        per_layer += (q_rank * hidden + q_rank + (kv_rank + int(text_config.get("qk_rope_head_dim", 0))) * hidden
                      + kv_rank)
    experts = int(text_config.get("n_routed_experts") or text_config.get("num_experts") or 0)
    moe_layers = max(0, layers - int(text_config.get("first_k_dense_replace") or 0)) if experts else 0
    return layers * per_layer + moe_layers * experts * (hidden + 1) + hidden


def named(parts: dict[str, float]) -> str:
    return " + ".join(f"{name} {value / GIB:.1f}" for name, value in parts.items())


@dataclass(frozen=True)
class TargetShape:
    weights_bytes: int  # the checkpoint's weight files on disk
    layers: int
    hidden_size: int
    vocab_size: int
    kv_bytes_per_token: int  # the target's KV cache per token on one GPU (MLA: latent + rope, every layer)
    replicated_bytes: int = 0  # of weights_bytes, what every GPU holds whole (`replicated_params`)


@dataclass(frozen=True)
class DrafterShape:
    draft_vocab: int
    layer_activations: int  # activation elements per token and TTT step of its decoder layer (`layer_activations`)
    trainable_params: int
    frozen_params: int  # the target's embedding, the drafter's lm_head and the target's draft-vocabulary rows
    layer_params: int  # the largest decoder layer: an FSDP unit of its own
    root_params: int  # everything outside the decoder layers (embedding, fc, lm_head, verifier_lm_head): the root unit

    @classmethod
    def from_dims(cls, dims) -> "DrafterShape":
        """speculators' EAGLE-3 drafter (`Eagle3DraftModel`), Llama-shaped or MLA: its first decoder layer reads
        2 x hidden."""
        hidden, draft_vocab = dims.hidden_size, dims.draft_vocab_size
        params = drafter_params(dims)  # with the embedding, not verifier_lm_head
        embedding = dims.vocab_size * hidden
        layer = layer_params(dims, first=dims.layer_shape != DFLASH)
        # speculators 0.9 trains neither the embedding nor the drafter's lm_head (speculators/model.py sets both
        # requires_grad False: the head keeps the verifier's draft-vocabulary rows, or a release's).
        head = verifier_head = draft_vocab * hidden
        # A DFlash block passes through every layer once; an EAGLE-3 drafter's one layer once per ttt step.
        passes = dims.num_layers if dims.layer_shape == DFLASH else 1
        return cls(draft_vocab=draft_vocab, layer_activations=passes * layer_activations(dims),
                   trainable_params=params - embedding - head, frozen_params=embedding + head + verifier_head,
                   layer_params=layer, root_params=params - layer + verifier_head)


def target_shape(verifier_dir: Path, text_config: dict, tensor_parallel: int, kv_dtype_bytes: int = 2) -> TargetShape:
    """The target's figures from its folder: weight files on disk and its config."""
    weights = sum(p.stat().st_size for p in Path(verifier_dir).glob("*.safetensors"))
    layers = int(text_config["num_hidden_layers"])
    # Replicated tensors are unquantized in the checkpoints this plans for (Kimi-K2.5 INT4 quantizes its routed
    # experts only): bf16.
    replicated = min(weights, 2 * replicated_params(text_config))
    if text_config.get("kv_lora_rank"):  # MLA: every GPU holds the whole compressed latent of every layer
        per_layer = int(text_config["kv_lora_rank"]) + int(text_config.get("qk_rope_head_dim", 0))
    else:  # grouped-query attention: keys and values, heads split over the GPUs
        heads = int(text_config.get("num_key_value_heads", text_config["num_attention_heads"]))
        head_dim = int(text_config.get("head_dim") or text_config["hidden_size"] // text_config["num_attention_heads"])
        per_layer = 2 * max(1, heads // tensor_parallel) * head_dim
    return TargetShape(weights_bytes=weights, layers=layers, hidden_size=int(text_config["hidden_size"]),
                       vocab_size=int(text_config["vocab_size"]),
                       kv_bytes_per_token=per_layer * layers * kv_dtype_bytes, replicated_bytes=replicated)


@dataclass(frozen=True)
class MemoryPlan:
    gpu_bytes: int
    gpus: int
    utilization: float
    vllm: dict[str, float]  # bytes per GPU by part; vLLM gives its KV cache whatever its share leaves
    trainer: dict[str, float]
    per_sequence_bytes: float  # the KV and capture cache of one longest capture sequence
    concurrent_requests: int  # sequences the ranks may ask for at once (window x ranks)

    @property
    def vllm_bytes(self) -> float:
        return self.utilization * self.gpu_bytes

    @property
    def trainer_bytes(self) -> float:
        return sum(self.trainer.values())

    @property
    def sequences_in_cache(self) -> int:
        """Longest capture sequences vLLM's cache holds at once (the others wait for room)."""
        return max(0, int(self.vllm["KV and capture cache"] // self.per_sequence_bytes))

    @property
    def server_sequences(self) -> int:
        """The capture server's --max-num-seqs: what the ranks ask for at once that its cache holds, one at least."""
        return max(1, min(self.sequences_in_cache, self.concurrent_requests))

    @property
    def margin_bytes(self) -> float:
        return self.gpu_bytes - self.vllm_bytes - self.trainer_bytes

    @property
    def fits(self) -> bool:
        return self.sequences_in_cache >= 1 and self.margin_bytes >= MARGIN_FRACTION * self.gpu_bytes

    def fitting_utilization(self) -> float | None:
        """The largest gpu_memory_utilization (in hundredths) that leaves the trainer and the margin their room,
        if it holds one capture sequence; None where none does."""
        fixed = sum(v for k, v in self.vllm.items() if k != "KV and capture cache")
        low = (fixed + self.per_sequence_bytes) / self.gpu_bytes
        high = int((1 - MARGIN_FRACTION - self.trainer_bytes / self.gpu_bytes) * 100) / 100
        return high if high >= low else None

    def lines(self) -> list[str]:
        verdict = "co-located: fits" if self.fits else "co-located: does NOT fit"
        held = min(self.sequences_in_cache, self.concurrent_requests)
        out = [
            f"  memory plan ({verdict}), per GPU of {self.gpu_bytes / GIB:.1f} GiB, each shared by the capture server "
            f"(tensor parallel over {self.gpus}) and one of {self.gpus} training ranks:",
            f"    capture server, gpu_memory_utilization {self.utilization:.2f} = {self.vllm_bytes / GIB:.1f} GiB: "
            f"{named(self.vllm)}; the cache holds {held} of the {self.concurrent_requests} longest sequences the ranks "
            f"may ask for at once ({self.per_sequence_bytes / GIB:.2f} GiB each): the server takes "
            f"{self.server_sequences} at once (--max-num-seqs), the others wait",
            f"    trainer (FSDP): {named(self.trainer)} = {self.trainer_bytes / GIB:.1f} GiB",
            f"    left free: {self.margin_bytes / GIB:.1f} GiB (wanted: {MARGIN_FRACTION:.0%} = "
            f"{MARGIN_FRACTION * self.gpu_bytes / GIB:.1f} GiB)",
        ]
        if not self.fits:
            fitting = self.fitting_utilization()
            fix = (f"set hidden_states.capture_gpu_memory_utilization {fitting:.2f}" if fitting
                   else "lower train.total_seq_len")
            out.append(f"    to fit: {fix}, or capture on another host "
                       f"(hidden_states.capture_endpoints; docs/online.md)")
        return out


def trainer_memory(drafter: DrafterShape, *, gpus: int, sharded: bool, vocab: int, total_seq_len: int,
                   ttt_steps: int) -> dict[str, float]:
    """What one training rank holds on its GPU, by part (bytes), AdamW assumed: sharded with FSDP over `gpus` ranks,
    or replicated on each (DDP; one process when `gpus` is 1)."""
    per_token = activation_bytes_per_token(drafter.layer_activations, drafter.draft_vocab, vocab, ttt_steps)
    # Master weights (fp32) of every parameter, fp32 gradients and AdamW's two fp32 moments of the trainable ones.
    states = 4 * (drafter.trainable_params + drafter.frozen_params) + 12 * drafter.trainable_params
    if not sharded:
        parts = {"weights, gradients and AdamW moments (fp32)": states}
        if gpus > 1:  # DDP's reduction buckets: a second fp32 copy of the gradients
            parts["DDP gradient buckets (fp32)"] = 4 * drafter.trainable_params
        return {**parts, "activations": total_seq_len * per_token, "CUDA context": CUDA_CONTEXT_GIB * GIB}
    # speculators' FSDP2 (MixedPrecisionPolicy: bf16 parameters, fp32 reduction): the states sharded over the
    # ranks; the root unit stays gathered in bf16 from its forward to its backward; a unit's gradients leave as bf16
    # and an fp32 copy of them that is reduce-scattered (its gathered bf16 weights are freed first, so the two are
    # the peak: 6 bytes a parameter).
    root = 2 * drafter.root_params
    gradients = 6 * max(drafter.layer_params, drafter.trainable_params - drafter.layer_params)
    return {"sharded states": states / gpus, "gathered root (bf16)": root,
            "gradients in flight (bf16 + fp32)": gradients, "activations": total_seq_len * per_token,
            "CUDA context": CUDA_CONTEXT_GIB * GIB}


def activation_tokens(train) -> tuple[int, int]:
    """(tokens, passes) a training step holds activations for: a pack's tokens once per ttt step, or a DFlash pack's
    query blocks (max_anchors x block_size, whatever the data: speculators pads to max_anchors) once."""
    if train.family == "dflash":
        return train.dflash.max_anchors * train.dflash.block_size, 1
    return train.total_seq_len, train.ttt_steps


def trainer_memory_line(cfg, verifier, n_aux: int) -> str:
    """Stage 04's dry-run line: the memory one training rank needs (per GPU, or the CPU's for an in-process run),
    by part, for this run's drafter (Llama-shaped or MLA) and pack length."""
    t = cfg.train
    gpus = max(1, t.num_gpus)
    tokens, passes = activation_tokens(t)
    drafter = DrafterShape.from_dims(planned_draft_dims(cfg, verifier, n_aux))
    parts = trainer_memory(drafter, gpus=gpus, sharded=t.fsdp_shard, vocab=verifier.vocab_size,
                           total_seq_len=tokens, ttt_steps=passes)
    if t.num_gpus == 0:
        parts.pop("CUDA context")
    where = "per GPU" if t.num_gpus else "on the CPU"
    how = f"FSDP over {gpus} ranks" if t.fsdp_shard else ("replicated on each rank" if gpus > 1 else "one process")
    pack = f"{tokens} block tokens a pack" if t.family == "dflash" else f"packs of {tokens} tokens"
    return (f"  memory {where} (trainer, {how}, {pack}, estimate): {named(parts)} = "
            f"{sum(parts.values()) / GIB:.1f} GiB")


def plan_memory(*, gpu_bytes: int, gpus: int, utilization: float, target: TargetShape, drafter: DrafterShape,
                num_states: int, longest_sequence: int, total_seq_len: int, ttt_steps: int, window: int) -> MemoryPlan:
    """The co-located plan: what the capture server and one training rank hold on each GPU."""
    hidden_state_bytes = num_states * target.hidden_size * 2  # the capture's own cache group, bf16
    fixed = {
        "weights": (target.weights_bytes - target.replicated_bytes) / gpus + target.replicated_bytes,
        "prefill activations": VLLM_ACTIVATIONS_GIB * GIB,
        "CUDA graphs": 0.0,  # none: capture servers run eager (a capture is one prefill, never a decode batch)
        "CUDA context": CUDA_CONTEXT_GIB * GIB,
    }
    vllm = {**fixed, "KV and capture cache": max(0.0, utilization * gpu_bytes - sum(fixed.values()))}
    trainer = trainer_memory(drafter, gpus=gpus, sharded=True, vocab=target.vocab_size, total_seq_len=total_seq_len,
                             ttt_steps=ttt_steps)
    return MemoryPlan(gpu_bytes=gpu_bytes, gpus=gpus, utilization=utilization, vllm=vllm, trainer=trainer,
                      per_sequence_bytes=(longest_sequence + 1) * (target.kv_bytes_per_token + hidden_state_bytes),
                      concurrent_requests=window * gpus)


def capture_share(cfg) -> float | None:
    """The share of each GPU a capture server of this run asks vLLM for (gpu_memory_utilization); None off CUDA."""
    if cfg.device != "cuda":
        return None
    return cfg.hidden_states.capture_gpu_memory_utilization or cfg.verifier.gpu_memory_utilization


def run_plan(cfg, verifier, layout) -> MemoryPlan | str | None:
    """The plan of an online run whose capture server shares this host's GPUs with the trainer (device cuda, no
    capture_endpoints), or the line that says why it cannot be made here; None for other runs."""
    hs = cfg.hidden_states
    if cfg.device != "cuda" or hs.capture_endpoints or cfg.train.num_gpus == 0:
        return None
    gpu_bytes = gpu_memory_bytes()
    if gpu_bytes is None:
        return "  memory plan: no nvidia-smi here to read the GPUs' memory from; run this dry run on the GPU host"
    gpus = cfg.verifier.tensor_parallel_size
    if cfg.train.num_gpus != gpus:
        return (f"  memory plan: the capture server spans {gpus} GPUs and training {cfg.train.num_gpus}; co-location "
                f"is planned for the same GPUs: set train.num_gpus to verifier.tensor_parallel_size")
    tokens, passes = activation_tokens(cfg.train)
    return plan_memory(gpu_bytes=gpu_bytes, gpus=gpus, utilization=capture_share(cfg),
                       target=target_shape(verifier.path, verifier.text_config(), gpus),
                       drafter=DrafterShape.from_dims(planned_draft_dims(cfg, verifier, len(layout.layer_ids))),
                       num_states=layout.num_hidden_states, longest_sequence=hs.max_seq_len,
                       total_seq_len=tokens, ttt_steps=passes, window=hs.online_window)


def run_plan_lines(cfg, verifier, layout) -> list[str]:
    """What stage 04's dry run prints about GPU memory (`run_plan`); nothing for runs without such a plan."""
    plan = run_plan(cfg, verifier, layout)
    return [] if plan is None else [plan] if isinstance(plan, str) else plan.lines()
