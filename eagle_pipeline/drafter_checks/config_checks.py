"""The `config` check: the fields the engines read are present and agree with the target and with what
the caller expects; transformers parses the file and keeps them; vLLM's own config path (seen through
`vllm_load.vllm_inspect`) reads the same architecture, vocabularies, norm flags and aux layer ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle_pipeline.drafter.folder import written_layer_ids
from eagle_pipeline.drafter.layouts import (
    FLAT_ARCHITECTURES,
    MLA,
    MLA_MODEL_TYPES,
    NORM_FLAGS,
    SPECULATORS,
    config_layout,
    is_dflash_config,
    layer_shape,
    vllm_config_flags,
)
from eagle_pipeline.drafter.tensors import draft_dims

# vLLM's model class for each layer shape (llama_eagle3.py, deepseek_eagle3.py), and a DFlash drafter's
# (qwen3_dflash.py).
VLLM_MODEL_CLASSES = {"llama": "Eagle3LlamaForCausalLM", MLA: "Eagle3DeepseekV2ForCausalLM"}
DFLASH_MODEL_CLASS = "DFlashQwen3ForCausalLM"


def _dotted(config: dict[str, Any], key: str) -> Any:
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def flat_config_problems(config: dict[str, Any], target: dict[str, Any], engine: str = "vllm") -> list[str]:
    """Fields the engines read, present and consistent with the target (docs/formats.md, "config.json fields")."""
    problems = []
    shape = layer_shape(config)
    architecture = FLAT_ARCHITECTURES[shape]
    if config.get("architectures") != [architecture]:
        problems.append(f"architectures is {config.get('architectures')}, expected [{architecture!r}]")
    if shape == MLA:
        if config.get("model_type") not in MLA_MODEL_TYPES:
            problems.append(f"model_type is {config.get('model_type')!r}, expected one of {list(MLA_MODEL_TYPES)} "
                            "(vLLM builds the MLA layer from a DeepSeek config)")
        if config.get("norm_before_fc"):
            problems.append("norm_before_fc is true; vLLM's Eagle3DeepseekV2ForCausalLM has no input_norm")
        if config.get("rope_interleave") is False:
            # vllm/model_executor/models/deepseek_v2.py builds the MLA rotary embedding with is_neox_style=False.
            problems.append("rope_interleave is false; vLLM's MLA layers rotate interleaved pairs whatever the config "
                            "says, so the drafter would be served with another RoPE than it was trained with")
        if engine == "sglang":
            problems.append("an MLA drafter in an SGLang folder; SGLang's llama_eagle3 runs Llama layers only")
    elif config.get("model_type") != "llama":
        problems.append(f"model_type is {config.get('model_type')!r}, expected 'llama'")
    for name in NORM_FLAGS:
        if name not in config:
            problems.append(f"{name} is not written; vLLM's default for a missing flag depends on the format")
    eagle = config.get("eagle_config") or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        problems.append("eagle_config.eagle_aux_hidden_state_layer_ids is missing; engines would fall back to defaults")
    if eagle.get("use_aux_hidden_state") is not True:
        problems.append("eagle_config.use_aux_hidden_state is not true")
    if ids and config.get("num_aux_hidden_states") not in (None, len(ids)):
        problems.append(f"num_aux_hidden_states {config.get('num_aux_hidden_states')} != {len(ids)} layer ids")
    if config.get("draft_vocab_size") is None:
        problems.append("draft_vocab_size is missing")
    if engine == "vllm" and config.get("eagle_aux_hidden_state_layer_ids") != ids:
        problems.append("top-level eagle_aux_hidden_state_layer_ids differs from eagle_config's; vLLM's Model "
                        "Runner V2 reads only the top-level one")
    if engine == "sglang":
        problems += [f"{name} is true; SGLang's llama_eagle3 has no such norm variant"
                     for name in NORM_FLAGS if config.get(name)]
        if "eagle_aux_hidden_state_layer_ids" in config:
            problems.append("top-level eagle_aux_hidden_state_layer_ids in an SGLang folder: vLLM would read these "
                            "SGLang-convention (id - 1) ids")
        # SGLang ids are one lower: id j is the output of layer j, so vLLM's range check applies to j + 1.
        ids = [i + 1 for i in ids] if ids else ids
    problems += target_problems(config, target, ids)
    return problems


def target_problems(config: dict[str, Any], target: dict[str, Any], ids: list[int] | None) -> list[str]:
    target = target.get("text_config", target)
    dims = draft_dims(config)
    problems = []
    if dims.vocab_size != int(target["vocab_size"]):
        problems.append(f"vocab_size {dims.vocab_size} != the target's {target['vocab_size']}")
    if dims.target_hidden_size != int(target["hidden_size"]):
        problems.append(f"target_hidden_size {dims.target_hidden_size} "
                        f"!= the target's hidden_size {target['hidden_size']}")
    if ids and (min(ids) < 0 or max(ids) > int(target["num_hidden_layers"])):
        problems.append(f"aux layer ids {ids} fall outside the target's 0..{target['num_hidden_layers']}")
    return problems


def expected_problems(config: dict[str, Any], expected: dict[str, Any] | None) -> list[str]:
    problems = []
    for key, want in (expected or {}).items():
        got = _dotted(config, key)
        if got != want:
            problems.append(f"{key} is {got!r}, expected {want!r}")
    return problems


def transformers_parse(drafter_dir: Path, config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Parse with transformers (speculators' own config class for a speculators folder)."""
    problems = []
    try:
        if config_layout(config) == SPECULATORS:
            from speculators.models.dflash import DFlashSpeculatorConfig
            from speculators.models.eagle3 import Eagle3SpeculatorConfig

            reader = DFlashSpeculatorConfig if is_dflash_config(config) else Eagle3SpeculatorConfig
            parsed = reader.from_pretrained(str(drafter_dir))
            summary = {"class": type(parsed).__name__, "draft_vocab_size": parsed.draft_vocab_size}
        else:
            from transformers import AutoConfig, DeepseekV3Config

            # transformers has no kimi_k2 config; vLLM reads that model_type as DeepseekV3Config, and so does this.
            reader = DeepseekV3Config if config.get("model_type") == "kimi_k2" else AutoConfig
            parsed = reader.from_pretrained(str(drafter_dir))
            summary = {"class": type(parsed).__name__}
            # transformers keeps unknown fields as attributes; a field it dropped would be invisible to SGLang.
            for key in ("draft_vocab_size", "eagle_config", "target_hidden_size", *NORM_FLAGS):
                if key in config and getattr(parsed, key, None) != config[key]:
                    problems.append(f"transformers parses {key} as {getattr(parsed, key, None)!r}, not {config[key]!r}")
            summary["head_dim"] = getattr(parsed, "head_dim", None)
    except Exception as error:  # a parse failure is the finding
        return {"error": f"{type(error).__name__}: {error}"}, [f"transformers cannot parse config.json: {error}"]
    return summary, problems


def check_config(drafter_dir: str | Path, target_dir: str | Path, expected: dict[str, Any] | None,
                 vllm_view: dict[str, Any] | None, engine: str = "vllm") -> dict[str, Any]:
    drafter_dir, target_dir = Path(drafter_dir), Path(target_dir)
    config = json.loads((drafter_dir / "config.json").read_text())
    target = json.loads((target_dir / "config.json").read_text())
    problems: list[str] = []
    if config_layout(config) == SPECULATORS:
        problems += target_problems(config, target, config.get("eagle_aux_hidden_state_layer_ids"))
    else:
        problems += flat_config_problems(config, target, engine)
    problems += expected_problems(config, expected)
    parsed, parse_problems = transformers_parse(drafter_dir, config)
    problems += parse_problems
    detail: dict[str, Any] = {"transformers": parsed}
    if vllm_view is not None:
        detail["vllm"] = vllm_view
        problems += vllm_config_problems(config, vllm_view, check_layer_ids=engine == "vllm")
    detail["problems"] = problems
    return {"ok": not problems, "detail": detail}


def vllm_config_problems(config: dict[str, Any], view: dict[str, Any], check_layer_ids: bool = True) -> list[str]:
    """What vLLM's config path made of the drafter against what the file says (an SGLang folder's ids
    are in SGLang's convention, so they are not compared)."""
    if "error" in view:
        return [f"vLLM's config loader failed: {view['error']}"]
    problems = []
    dflash = is_dflash_config(config)
    model_class = DFLASH_MODEL_CLASS if dflash else VLLM_MODEL_CLASSES[layer_shape(config)]
    if view.get("model_class") != model_class:
        problems.append(f"vLLM resolves the drafter to {view.get('model_class')}, not {model_class}")
    dims = draft_dims(config)
    if view.get("draft_vocab_size") != dims.draft_vocab_size:
        problems.append(f"vLLM reads draft_vocab_size {view.get('draft_vocab_size')}, "
                        f"the file says {dims.draft_vocab_size}")
    ids = written_layer_ids(config)  # the ids the folder declares; vLLM's readings of them are compared below
    flags = {} if dflash else vllm_config_flags(config)  # a DFlash drafter has no norm variants
    for runner, captured in (view.get("aux_layer_ids") or {}).items() if check_layer_ids else ():
        if ids and captured != list(ids):
            problems.append(f"vLLM's {runner} would capture aux layers {captured or 'default'}, the file says "
                            f"{list(ids)}" + ("; write eagle_aux_hidden_state_layer_ids at the top level"
                                              if runner == "model_runner_v2" else ""))
    for name, value in flags.items():
        if view.get("norm_flags", {}).get(name) != value:
            problems.append(f"vLLM reads {name}={view.get('norm_flags', {}).get(name)}, the file means {value}")
    return problems
