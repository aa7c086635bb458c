"""The layouts of an EAGLE-3 drafter folder (docs/formats.md): speculators' checkpoint (stage 04's: a nested
config.json, `layers.<i>.*`), the flat folder vLLM loads (stage 05's `vllm/`, the released drafters: architecture
`LlamaForCausalLMEagle3` or `Eagle3DeepseekV2ForCausalLM`, `midlayer.*`) and SGLang's (stage 05's `sglang/`).

`WEIGHT_NAMES` is the one table of tensor names across them, and everything that renames a tensor goes through it.
The names inside a decoder layer are the layer shape's own and pass through `layers.0.` <-> `midlayer.` unchanged;
which of them a config implies is tensors.expected_tensor_specs'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eagle_pipeline.errors import BadInput

SPECULATORS, FLAT, SGLANG = "speculators", "flat", "sglang"

# The drafter's decoder layer: Llama-shaped attention, or the target's MLA attention (DeepSeek-V3, Kimi-K2).
LLAMA, MLA = "llama", "mla"
# A DFlash drafter: speculators' type, and its Qwen3 layers as stage 04 plans them (drafter/planned.py), each reading
# the hidden width only; the architecture speculators' checkpoints and z-lab's flat releases name.
DFLASH = "dflash"
DFLASH_ARCHITECTURE = "DFlashDraftModel"
# The flat architecture of each layer shape: vLLM's llama_eagle3.py and deepseek_eagle3.py.
FLAT_ARCHITECTURES = {LLAMA: "LlamaForCausalLMEagle3", MLA: "Eagle3DeepseekV2ForCausalLM"}
FLAT_ARCHITECTURE = FLAT_ARCHITECTURES[LLAMA]
# vLLM's alias of the MLA class (deepseek_eagle3.py), read as the MLA shape too.
MLA_ARCHITECTURE_ALIASES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")
# transformer_layer_config.model_type of each shape in a speculators checkpoint (speculators' `model_classes` key).
SPECULATORS_LAYER_TYPES = {LLAMA: "llama", MLA: "deepseek_v3"}
# What an MLA layer's model_type may say there: vLLM renames transformers' DeepseekV3Config to kimi_k2 in a process
# that has read a Kimi config, so a checkpoint written there says kimi_k2 (patches/speculators_mla.py takes both).
SPECULATORS_MLA_LAYER_TYPES = ("deepseek_v3", "kimi_k2")
# model_type values vLLM reads as a DeepSeek MLA config (kimi_k2 maps to DeepseekV3Config).
MLA_MODEL_TYPES = ("deepseek_v3", "deepseek_v2", "kimi_k2")
# The MLA layer's two input projections, as vLLM fuses them on load and some exports store them: rows
# [0, q_lora_rank) are q_a_proj, the remaining kv_lora_rank + qk_rope_head_dim rows kv_a_proj_with_mqa.
MLA_FUSED_QKV_A = "self_attn.fused_qkv_a_proj.weight"
MLA_QKV_A_PARTS = ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight")
# The key that makes a config.json speculators' own: speculators' `from_pretrained` dispatches on it, and vLLM
# reads a config that has it through its speculators config path.
SPECULATORS_TYPE_KEY = "speculators_model_type"
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
    # fc_norm.<i>.weight per aux layer
    WeightName("fc_norm.",                 "fc_norm.",          None, flag="fc_norm"),
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


def layer_shape(config: dict[str, Any]) -> str:
    """LLAMA or MLA: the decoder layer a config of either layout describes (a speculators checkpoint by its
    transformer_layer_config's model_type, a flat folder by its architecture)."""
    if config_layout(config) == SPECULATORS:
        layer = config.get("transformer_layer_config") or {}
        return MLA if layer.get("model_type") in MLA_MODEL_TYPES else LLAMA
    architectures = config.get("architectures") or []
    return MLA if any(name in MLA_ARCHITECTURE_ALIASES for name in architectures) else LLAMA


def flat_architecture_of(config: dict[str, Any]) -> str | None:
    """The flat EAGLE-3 architecture a config names (either shape's), or None."""
    known = (*FLAT_ARCHITECTURES.values(), *MLA_ARCHITECTURE_ALIASES)
    return next((name for name in config.get("architectures") or [] if name in known), None)


def config_layout(config: dict[str, Any]) -> str:
    """SPECULATORS for speculators' own nested config, FLAT for any other (flat and SGLang folders share it)."""
    return SPECULATORS if SPECULATORS_TYPE_KEY in config else FLAT


def is_dflash_config(config: dict[str, Any]) -> bool:
    """A DFlash drafter's config, in speculators' layout or z-lab's flat one: vLLM serves it with method dflash."""
    return config.get(SPECULATORS_TYPE_KEY) == DFLASH or DFLASH_ARCHITECTURE in (config.get("architectures") or [])


def dflash_trained_causal(config: dict[str, Any]) -> bool | None:
    """Whether a speculators DFlash config's layers were trained attending causally inside the block (True), both
    ways (False), or some each way (None): sliding-window layers attend causally unless sliding_window_non_causal,
    every other layer (each one where layer_types is unset) both ways (speculators/models/dflash/core.py)."""
    kinds = set((config.get("transformer_layer_config") or {}).get("layer_types") or ["full_attention"])
    causal = {kind == "sliding_attention" and not config.get("sliding_window_non_causal") for kind in kinds}
    return causal.pop() if len(causal) == 1 else None


def dflash_served_causal(config: dict[str, Any]) -> bool:
    """Whether vLLM attends causally inside the block of a speculators DFlash folder, every layer alike: where its
    sliding_window_non_causal is false, a missing one read as true (vLLM's speculators/algos.py, update_dflash)."""
    return not config.get("sliding_window_non_causal", True)


# The stage-06 modes that serve a drafter, named by vLLM's method for its family (train.family).
DRAFTER_MODES = ("eagle3", DFLASH)


def drafter_mode(modes) -> str:
    """The mode among `modes` (names, or a mapping keyed by them) that served the drafter (eagle3 where none did)."""
    return next((mode for mode in modes if mode in DRAFTER_MODES), "eagle3")


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
