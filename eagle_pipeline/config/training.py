"""The sections of the drafter and its checks: `train` (stage 04, its decoder shape in `draft_shape`) and
`convert` (stage 05)."""

from __future__ import annotations

from typing import Literal, Optional

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from eagle_pipeline.config.base import (
    MAX_COUNT,
    MAX_PARALLEL,
    MAX_TOKENS,
    MAX_VOCAB,
    MAX_WIDTH,
    PathStr,
    Section,
    cross_field,
)


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


class DFlashConfig(Section):
    """A DFlash block drafter (train.family: dflash): speculators' DFlashDraftModel, Qwen3 layers of the verifier's
    width over its aux states, drafting block_size - 1 tokens in one pass. Defaults are speculators'."""

    block_size: int = Field(8, ge=2, le=64, description="tokens per block: the last verified token and "
                                                        "block_size - 1 mask tokens, one draft each")
    num_layers: int = Field(5, ge=1, le=64)
    # Every pack pads to exactly max_anchors blocks, so a step costs max_anchors x block_size query tokens whatever the
    # data: size it to the answer tokens of a pack.
    max_anchors: int = Field(512, ge=1, le=MAX_TOKENS, description="anchor blocks per packed batch")
    mask_token_id: Optional[int] = Field(None, ge=0, lt=MAX_VOCAB, description="None: the lowest added special "
                                         "token the chat template and the answers never use (eagle_pipeline/vocab.py)")


# What a DFlash drafter has no use for, and why: each refused with family dflash.
EAGLE3_ONLY = {
    "draft_layer": "vLLM's DFlash drafter (DFlashQwen3ForCausalLM) has Qwen3 layers; leave draft_layer at llama",
    "draft_shape": "a DFlash drafter has the verifier's width (speculators: another is not yet supported); set "
                   "train.dflash.num_layers instead",
    "ttt_steps": "a DFlash drafter drafts a block in one pass; set train.dflash.block_size instead",
    **{flag: "a DFlash drafter has no EAGLE-3 norm variants; leave it at its default" for flag in (
        "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")},
}


class TrainConfig(Section):
    # eagle3: a chain of one-token draft steps (speculators' Eagle3DraftModel); dflash: a block of tokens drafted in
    # one pass (DFlashDraftModel, train.dflash), vLLM's method dflash.
    family: Literal["eagle3", "dflash"] = "eagle3"
    dflash: DFlashConfig = Field(default_factory=DFlashConfig)
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
    def _settings_of_the_family(self):
        if self.family == "eagle3":
            if self.dflash != DFlashConfig():
                raise cross_field("dflash", "applies to train.family dflash only; set family: dflash or remove it")
            return self
        # Changed from its default: a config extending an EAGLE-3 one sets the defaults back (kimi-k2.5.yaml's flags).
        for field, why in EAGLE3_ONLY.items():
            if getattr(self, field) != TrainConfig.model_fields[field].default:
                raise cross_field(field, f"an EAGLE-3 setting, but train.family is dflash: {why}")
        return self

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
