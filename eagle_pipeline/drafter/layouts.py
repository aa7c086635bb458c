"""The layouts of an EAGLE-3 drafter folder: speculators' checkpoint, the flat folder vLLM loads, SGLang's.

- speculators (stage 04's checkpoints, what its trainer loads): a nested config.json (`speculators_config`,
  `transformer_layer_config`) and weights `layers.<i>.*`, with the verifier's copies of some tensors;
- flat (stage 05's `vllm/`, the released drafters): one Llama-shaped config.json with architecture
  `LlamaForCausalLMEagle3`, the first decoder layer named `midlayer.*` (the EAGLE-3 repository's name);
- SGLang (stage 05's `sglang/`): the flat names, for the one-layer, no-norm-variant drafters it can run.

`WEIGHT_NAMES` is the one table of tensor names across them. Everything that renames a tensor goes through
it: the conversion to flat (convert.py), the writer of speculators folders (drafter/to_speculators.py), the
shape check, fine-tuning from a flat folder and the replay of one. docs/formats.md describes the formats.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle_pipeline.errors import BadInput

SPECULATORS, FLAT, SGLANG = "speculators", "flat", "sglang"

FLAT_ARCHITECTURE = "LlamaForCausalLMEagle3"
# The key that makes a config.json speculators' own: speculators' `from_pretrained` dispatches on it, and vLLM
# reads a config that has it through its speculators config path.
SPECULATORS_TYPE_KEY = "speculators_model_type"
# What speculators' own EAGLE-3 checkpoints name as their architecture.
SPECULATORS_ARCHITECTURE = "Eagle3DraftModel"
WEIGHTS_NAME = "model.safetensors"
WEIGHTS_INDEX_NAME = "model.safetensors.index.json"

NORM_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")
# speculators' own default when a config leaves a flag out (Eagle3SpeculatorConfig). vLLM reads a missing
# norm_before_residual in a speculators config as true, which is why the converter refuses a config without it.
SPECULATORS_FLAG_DEFAULTS = {name: False for name in NORM_FLAGS}
# vLLM's default for a flag a flat config leaves out (llama_eagle3.py: getattr(config, flag, False)).
FLAT_FLAG_DEFAULT = False
# Some exports prefix every decoder key with `model.`; the replay reads them as the unprefixed names, the
# shapes check reports them as a slip.
EXPORT_PREFIX = "model."


@dataclass(frozen=True)
class WeightName:
    """One tensor, or a family of tensors when the names end in ".", in each layout; None: not in that layout."""

    speculators: str
    flat: str | None
    sglang: str | None
    flag: str | None = None  # the norm flag whose module this is

    def spelled(self, layout: str) -> str | None:
        return getattr(self, layout)

    def matches(self, name: str, layout: str) -> bool:
        spelled = self.spelled(layout)
        return spelled is not None and (name.startswith(spelled) if spelled.endswith(".") else name == spelled)


LAYERS = "layers."
EMBED_KEY = "embed_tokens.weight"
WEIGHT_NAMES = (
    #           speculators                flat                 SGLang
    WeightName(LAYERS + "0.",              "midlayer.",         "midlayer."),  # the first decoder layer
    WeightName(LAYERS,                     LAYERS,              None),  # further layers: SGLang builds one midlayer
    WeightName("fc.weight",                "fc.weight",         "fc.weight"),
    WeightName("norm.weight",              "norm.weight",       "norm.weight"),
    WeightName("lm_head.weight",           "lm_head.weight",    "lm_head.weight"),
    WeightName("d2t",                      "d2t",               "d2t"),  # vLLM loads it as draft_id_to_target_id
    WeightName("t2d",                      "t2d",               "t2d"),  # both engines skip it on load
    WeightName("input_norm.weight",        "input_norm.weight", None, flag="norm_before_fc"),
    WeightName("fc_norm.",                 "fc_norm.",          None, flag="fc_norm"),  # fc_norm.<i>.weight per aux layer
    # The verifier's tensors: the engines take them from the served target, so flat folders leave them out.
    WeightName(EMBED_KEY,                  None,                None),
    WeightName("verifier_lm_head.weight",  None,                None),
    WeightName("verifier_norm.weight",     None,                None),
)
VERIFIER_ONLY_KEYS = tuple(row.speculators for row in WEIGHT_NAMES if row.flat is None)


def weight_row(name: str, layout: str) -> WeightName | None:
    """The table row of a tensor named `name` in `layout`; None for a name the layout does not have."""
    return next((row for row in WEIGHT_NAMES if row.matches(name, layout)), None)


def weight_name(name: str, *, source: str, target: str) -> str | None:
    """A tensor's name in `target` given its name in `source`; None where `target` has no such tensor.

    A name outside the table comes back unchanged: the checks, not the renaming, report unknown tensors.
    """
    row = weight_row(name, source)
    if row is None:
        return name
    target_name = row.spelled(target)
    if target_name is None:
        return None
    return target_name + name[len(row.spelled(source)):]


def flat_name(name: str) -> str:
    """Any spelling of a drafter tensor (speculators' `layers.0.*`, a flat folder's `midlayer.*`) as the flat
    layout writes it; the verifier's tensors keep their names."""
    return weight_name(name, source=SPECULATORS, target=FLAT) or name


def speculators_name(name: str) -> str:
    """Any spelling of a drafter tensor (`midlayer.*`, or `layers.0.*` as some flat exports write it) as
    speculators writes it."""
    return weight_name(name, source=FLAT, target=SPECULATORS) or name


def layer_prefix(index: int, layout: str) -> str | None:
    """The prefix of decoder layer `index`'s tensors in `layout` (None: the layout has no such layer)."""
    return weight_name(f"{LAYERS}{index}.", source=SPECULATORS, target=layout)


def layer_index(name: str) -> int | None:
    """The decoder layer a tensor belongs to, in any spelling; None for the tensors outside the layers."""
    name = speculators_name(name)
    index = name[len(LAYERS):].split(".", 1)[0] if name.startswith(LAYERS) else ""
    return int(index) if index.isdigit() else None


def config_layout(config: dict[str, Any]) -> str:
    """SPECULATORS for speculators' own nested config, FLAT for any other (flat and SGLang folders share it)."""
    return SPECULATORS if SPECULATORS_TYPE_KEY in config else FLAT


def strip_export_prefix(name: str) -> str:
    return name.removeprefix(EXPORT_PREFIX)


def flat_norm_flags(config: dict[str, Any]) -> dict[str, bool]:
    """The norm flags of a flat config as vLLM's llama_eagle3 reads them: a missing flag is false, and
    `eagle_config.norm_before_fc` comes before the top-level one."""
    flags = {name: bool(config.get(name, FLAT_FLAG_DEFAULT)) for name in NORM_FLAGS}
    eagle = config.get("eagle_config") or {}
    flags["norm_before_fc"] = bool(eagle.get("norm_before_fc", flags["norm_before_fc"]))
    return flags


def speculators_norm_flags(config: dict[str, Any]) -> dict[str, bool]:
    """The norm flags of a speculators config as speculators builds the drafter from them."""
    return {name: bool(config.get(name, default)) for name, default in SPECULATORS_FLAG_DEFAULTS.items()}


def vllm_config_flags(config: dict[str, Any]) -> dict[str, bool]:
    """The norm flags as vLLM's config path holds them: its speculators path reads a missing
    norm_before_residual as true (transformers_utils/configs/speculators/algos.py), a flat config's is false."""
    if config_layout(config) == SPECULATORS:
        return {n: bool(config.get(n, n == "norm_before_residual")) for n in NORM_FLAGS}
    return {n: bool(config.get(n, FLAT_FLAG_DEFAULT)) for n in NORM_FLAGS}


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Map every tensor name to its safetensors file (single file or sharded with an index)."""
    from safetensors import safe_open

    index = model_dir / WEIGHTS_INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / shard for name, shard in weight_map.items()}
    single = model_dir / WEIGHTS_NAME
    if not single.exists():
        raise BadInput(f"{model_dir}: no {WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}; point at a saved drafter folder")
    with safe_open(single, framework="pt") as f:
        return {name: single for name in f.keys()}
