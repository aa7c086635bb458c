"""The run config: one YAML file, validated by a typed schema.

- The file is read by file.py (`extends:` bases, `--set a.b=value` overrides, repeated keys refused); this module
  types what it read as a `RunConfig` of sections: verifier.py (the target and its engine), data.py (prompts,
  generation, hidden states, vocabulary), training.py (train, convert), serving.py (serve); base.py holds what
  every section shares and vllm_names.py the names the installed vLLM accepts.
- Unknown or misspelt keys are errors that name the key and where it is.
- Relative paths in a config are taken relative to the repository root, so a command works from any
  directory.
- Every number has a range and must be finite; rules that tie fields together (a generation length below
  the context length, ...) are checked here too, so that a bad value is refused when the config loads,
  `--dry-run` included, and never midway through a stage.
- An error names the file that set the offending value: the base a value was inherited from, or `--set`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from eagle_pipeline.config.base import (
    MAX_SEED,
    PathStr,
    Section,
    _checked_path,
    cross_field,
    env_problem,
    resolve_path,
)
from eagle_pipeline.config.data import DataConfig, GenerationConfig, HiddenStatesConfig, VocabConfig
from eagle_pipeline.config.file import Origins, read_config_file
from eagle_pipeline.config.serving import ServeConfig
from eagle_pipeline.config.training import ConvertConfig, TrainConfig
from eagle_pipeline.config.verifier import VerifierConfig
from eagle_pipeline.errors import BadInput
from eagle_pipeline.fingerprint import value_fingerprint

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
        dtype = self.generation.dtype
        if self.hidden_states.one_pass and dtype not in (None, self.verifier.dtype):
            raise cross_field("generation.dtype", f"{dtype} differs from verifier.dtype ({self.verifier.dtype}), but "
                                                  f"hidden_states.one_pass captures the states in the answering "
                                                  f"engine's dtype; leave generation.dtype unset or set one_pass false")
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

    @model_validator(mode="after")
    def _sglang_folder_of_eagle3(self):
        if self.convert.sglang and self.train.family == "dflash":
            raise cross_field("convert.sglang", "writes SGLang's EAGLE-3 folder (llama_eagle3), not a DFlash "
                                                "drafter's; set it false with train.family dflash")
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
