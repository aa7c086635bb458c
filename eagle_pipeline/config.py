"""The run config: one YAML file, validated by a typed schema.

- Unknown or misspelt keys are errors that name the key and where it is.
- `extends: other.yaml` (relative to the file) loads another config first and overlays this one on it.
- `--set a.b=value` overrides any key from the command line; the value is parsed as YAML and typed by
  the schema.
- Relative paths in a config are taken relative to the repository root, so a command works from any
  directory.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from eagle_pipeline.errors import BadInput
from eagle_pipeline.fingerprint import value_fingerprint
from eagle_pipeline.layer_ids import order_problem
from eagle_pipeline.samples import StorageDtype

REPO_ROOT = Path(__file__).resolve().parent.parent


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class VerifierConfig(Section):
    path: str = Field(description="HF model directory of the target, or embedded:<name> for a bundled model")
    trust_remote_code: bool = False
    dtype: Literal["bfloat16", "float16", "float32", "auto"] = "bfloat16"
    tensor_parallel_size: int = Field(1, ge=1)
    enable_expert_parallel: bool = False
    max_model_len: int = Field(2048, ge=16)
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    cpu_kvcache_gib: int = Field(4, ge=1, description="VLLM_CPU_KVCACHE_SPACE for the CPU backend")
    engine_args: dict[str, Any] = Field(default_factory=dict, description="extra vLLM engine arguments")


class DataConfig(Section):
    prompts: str = Field(description="JSONL file of prompts, or a local `datasets` folder")
    prompt_field: str = "prompt"
    eval_prompts: str = Field(description="held-out prompts for stage 06, never used in training")
    num_samples: int = Field(ge=1, description="how many training conversations to generate")
    num_eval_prompts: int = Field(32, ge=1)


class GenerationConfig(Section):
    max_tokens: int = Field(256, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    reasoning: bool = Field(False, description="thinking on or off, through the template's own switch (enable_thinking, thinking, ...)")
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict, description="extra chat-template arguments; override the detected thinking switch")
    system_prompt: Optional[str] = None
    batch_size: int = Field(32, ge=1, description="prompts per engine call; a crash loses at most one batch")


class HiddenStatesConfig(Section):
    layer_ids: Optional[list[int]] = Field(None, description="aux layer ids (HF hidden_states indices); default (2, L//2, L-3)")
    storage_dtype: StorageDtype = Field(StorageDtype.BFLOAT16, description="bfloat16, or fp8 with per-token scales (half the disk)")
    max_seq_len: int = Field(2048, ge=8)
    batch_size: int = Field(16, ge=1)

    @field_validator("layer_ids")
    @classmethod
    def _ordered(cls, ids):
        # The range check needs the verifier's depth: eagle_pipeline.layer_ids.check_layer_ids at stage start.
        problem = None if ids is None else order_problem(ids)
        if problem:
            raise ValueError(problem)
        return ids


class VocabConfig(Section):
    draft_vocab_size: int = Field(ge=1)


class DraftShape(Section):
    """An explicit drafter layer shape (Llama decoder layer); None fields come from the verifier."""

    hidden_size: Optional[int] = None
    num_hidden_layers: Optional[int] = Field(None, ge=1)
    num_attention_heads: Optional[int] = None
    num_key_value_heads: Optional[int] = None
    head_dim: Optional[int] = None
    intermediate_size: Optional[int] = None
    hidden_act: Optional[str] = None
    rope_theta: Optional[float] = None
    rms_norm_eps: Optional[float] = None
    max_position_embeddings: Optional[int] = None


class TrainConfig(Section):
    epochs: int = Field(3, ge=1)
    lr: float = Field(1e-4, gt=0)
    optimizer: Literal["adamw", "muon"] = "adamw"
    dtype: Literal["float32", "bfloat16"] = "bfloat16"
    total_seq_len: int = Field(2048, ge=8, description="tokens per packed batch")
    ttt_steps: int = Field(3, ge=1)
    # Loss weight of draft position k is decay**k; below 1 it spends the drafter's capacity on the early
    # positions, which decide most of the acceptance length.
    ttt_step_loss_decay: float = 1.0
    val_ratio: float = Field(0.05, gt=0, lt=1)
    keep_last: int = Field(2, ge=1)
    num_workers: int = Field(2, ge=0)
    threads: Optional[int] = Field(None, ge=1, description="torch threads for CPU training; None uses every core")
    num_gpus: int = Field(0, ge=0, description="0 trains on the CPU; 1 or more launches torch.distributed.run")
    fsdp_shard: bool = Field(False, description="multi-GPU: shard the drafter with FSDP instead of replicating it")
    draft_shape: Optional[DraftShape] = Field(None, description="explicit drafter shape; None derives it from the verifier")
    # speculators' EAGLE-3 defaults; drafters trained with SpecForge (and SGLang) use all False.
    norm_before_residual: bool = True
    norm_before_fc: bool = True
    fc_norm: bool = False
    norm_output: bool = True
    init_from: Optional[str] = Field(None, description="drafter directory to fine-tune from")

    @field_validator("ttt_step_loss_decay")
    @classmethod
    def _decay_in_range(cls, decay):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"must be in (0, 1], got {decay}")
        return decay

    @field_validator("fsdp_shard")
    @classmethod
    def _shard_needs_gpus(cls, shard, info):
        if shard and info.data.get("num_gpus") == 0:
            raise ValueError("needs GPUs to shard the drafter across; set train.num_gpus, or fsdp_shard false")
        return shard

    @field_validator("fc_norm")
    @classmethod
    def _one_fc_norm(cls, fc_norm, info):
        if fc_norm and info.data.get("norm_before_fc"):
            raise ValueError("speculators allows only one of norm_before_fc and fc_norm; set one false")
        return fc_norm

    @property
    def train_ratio(self) -> float:
        """The share of samples trained on; the rest (val_ratio) is validated on."""
        return 1 - self.val_ratio


class ConvertConfig(Section):
    sglang: bool = False
    reference_dir: Optional[str] = Field(None, description="released drafter to compare shapes against")
    parity_prompts: int = Field(4, ge=1)
    parity_max_tokens: int = Field(32, ge=1)
    parity_tolerance: float = Field(0.05, ge=0, description="allowed per-position acceptance difference")
    # Each check starts its own engine: a cold start of a ~600 GB target alone takes tens of minutes.
    engine_timeout_s: float = Field(3600.0, gt=0, description="seconds one vLLM job of the checks may take")


class ServeConfig(Section):
    num_speculative_tokens: int = Field(3, ge=1)
    max_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0)
    concurrency: int = Field(4, ge=1)
    port: Optional[int] = Field(None, ge=1, le=65535)
    ngram_baseline: bool = True
    min_acceptance_length: float = Field(1.5, ge=1)
    # Replay the trained drafter offline on the no-speculation server's answers (eagle_pipeline/predict) and
    # report the predicted acceptance beside the served one: a large gap means the engine serves the drafter
    # differently from how it was trained. Costs one hidden-state capture engine start.
    predict: bool = True
    # A cold start of a ~600 GB target (weights from disk, graph capture on 8 GPUs) takes tens of minutes.
    startup_timeout_s: float = Field(3600.0, gt=0, description="seconds a vLLM server may take to become healthy")


class RunConfig(Section):
    run_name: str
    data_root: str
    seed: int = 0
    device: Literal["cpu", "cuda"] = "cpu"
    disk_budget_gb: Optional[float] = Field(None, description="disk this run is expected to need on data_root")
    verifier: VerifierConfig
    data: DataConfig
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    hidden_states: HiddenStatesConfig = Field(default_factory=HiddenStatesConfig)
    vocab: VocabConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    convert: ConvertConfig = Field(default_factory=ConvertConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @model_validator(mode="after")
    def _names(self):
        if not self.run_name or "/" in self.run_name:
            raise ValueError("run_name must be a non-empty folder name without '/'")
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


# -- loading ---------------------------------------------------------------------------------------


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    if path in chain:
        raise BadInput(f"{path}: 'extends' forms a cycle ({' -> '.join(map(str, chain + (path,)))}); remove one link")
    if not path.exists():
        where = f" (extended by {chain[-1]})" if chain else ""
        raise BadInput(f"{path}: config file not found{where}; check the path")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark else ""
        raise BadInput(f"{path}{at}: not valid YAML ({getattr(e, 'problem', e)}); fix the syntax") from None
    if not isinstance(data, dict):
        raise BadInput(f"{path}: a config must be a YAML mapping of keys to values")
    parent = data.pop("extends", None)
    if parent is None:
        return data
    base = _read_yaml((path.parent / parent).resolve(), chain + (path,))
    return deep_merge(base, data)


def deep_merge(base: dict, overlay: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` override; the value is parsed as YAML (so 3 is an int, [1,2] a list)."""
    if "=" not in assignment:
        raise BadInput(f"--set {assignment!r}: expected dotted.key=value, e.g. --set data.num_samples=10")
    dotted, raw = assignment.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise BadInput(f"--set {assignment!r}: empty key segment; use dotted.key=value")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise BadInput(f"--set {dotted}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value


def _explain(error: ValidationError, source: str, section: str | None = None) -> str:
    first = error.errors()[0]
    loc = (section, *first["loc"]) if section else first["loc"]
    where = ".".join(str(p) for p in loc) or "(top level)"
    kind = first["type"]
    if kind == "extra_forbidden":
        parent, _, key = where.rpartition(".")
        place = f"section {parent!r}" if parent else "the top level"
        return f"{source}: unknown key {key!r} in {place}; check its spelling against configs/tiny.yaml"
    if kind == "missing":
        return f"{source}: {where} is required; set it in the config or with --set {where}=..."
    if kind == "value_error":  # the schema's own validators word the whole message
        return f"{source}: {where}: {first['ctx']['error']}"
    return f"{source}: {where}: {first['msg']} (got {first.get('input')!r})"


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    path = Path(path).resolve()
    data = _read_yaml(path)
    for assignment in overrides:
        apply_override(data, assignment)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise BadInput(_explain(e, str(path))) from None


def load_section(name: str, values: dict[str, Any], source: str) -> Section:
    """One section of a run config (e.g. "train") validated on its own, with load_config's error lines."""
    section = RunConfig.model_fields[name].annotation
    try:
        return section.model_validate(values)
    except ValidationError as e:
        raise BadInput(_explain(e, source, section=name)) from None


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
