"""The one reader of a drafter folder: which layout it is in (layouts.config_layout), its dimensions
(`DrafterFolder.dims`: tensors.DraftDims, the one owner of every size), its norm flags and aux layer ids as each
engine reads them, and its tensors. The offline replay reads no more of a flat folder than `read_flat_config`, since
it must run whatever the engine is asked to serve; error lines name the config key the caller passes (`field`) and
the file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle_pipeline.drafter.layouts import (
    EMBED_KEY,
    FLAT_ARCHITECTURES,
    MLA,
    SPECULATORS,
    SPECULATORS_LAYER_TYPES,
    SPECULATORS_MLA_LAYER_TYPES,
    SPECULATORS_TYPE_KEY,
    config_layout,
    flat_architecture_of,
    flat_name,
    flat_norm_flags,
    is_dflash_config,
    layer_shape,
    speculators_norm_flags,
    strip_export_prefix,
    weight_files,
)
from eagle_pipeline.drafter.tensors import (
    MLA_LAYER_KEYS,
    DraftDims,
    draft_dims,
    read_tensor_specs,
    shape_problems,
    split_fused_tensors,
)
from eagle_pipeline.errors import BadInput
from eagle_pipeline.json_files import read_json_object
from eagle_pipeline.layer_ids import vllm_read_aux_ids
from eagle_pipeline.vocab_map import safetensors_vocab_map_problems

if TYPE_CHECKING:
    import torch


@dataclass
class DrafterFolder:
    """What a drafter folder's config.json says, in either layout; `tensor_files` (tensor name -> safetensors
    file) reads the weights' index or header once."""

    path: Path
    config: dict[str, Any]

    @property
    def layout(self) -> str:
        return config_layout(self.config)

    @cached_property
    def dims(self) -> DraftDims:
        return draft_dims(self.config)

    @property
    def layer_shape(self) -> str:
        """layouts.LLAMA or layouts.MLA."""
        return layer_shape(self.config)

    @property
    def flags(self) -> dict[str, bool]:
        """The norm flags as the drafter was built with them: speculators' reading of its own config, vLLM's
        of a flat one (the engine a flat folder is made for)."""
        flags = speculators_norm_flags(self.config) if self.layout == SPECULATORS else flat_norm_flags(self.config)
        return flags | {"norm_before_fc": self.dims.norm_before_fc}  # false for vLLM's MLA drafter (no input_norm)

    @property
    def written_layer_ids(self) -> list[int] | None:
        return written_layer_ids(self.config)

    @property
    def engine_layer_ids(self) -> dict[str, list[int] | None]:
        return engine_layer_ids(self.config)

    @cached_property
    def tensor_files(self) -> dict[str, Path]:
        return weight_files(self.path)


def written_layer_ids(config: dict[str, Any]) -> list[int] | None:
    """The aux layer ids as the folder writes them (a flat folder's `eagle_config` first, then the top level);
    their convention is the layout's and, for a flat folder, the writer's (layer_ids.py)."""
    if is_dflash_config(config):  # speculators' DFlash config names them without eagle_
        ids = config.get("aux_hidden_state_layer_ids")
    else:
        ids = None if config_layout(config) == SPECULATORS else (config.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
        ids = ids if ids is not None else config.get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else [int(k) for k in ids]


def engine_layer_ids(config: dict[str, Any]) -> dict[str, list[int] | None]:
    """The aux ids each engine takes from the folder (None: the target's defaults): vLLM's two model runners
    (layer_ids.vllm_read_aux_ids; a speculators config is read at the top level by both) and SGLang, which
    reads a flat folder's `eagle_config` only (and runs no speculators folder)."""
    if config_layout(config) == SPECULATORS:
        ids = written_layer_ids(config) or None
        return {"v1": ids, "v2": ids, "sglang": None}
    nested = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    return vllm_read_aux_ids(config) | {"sglang": [int(k) for k in nested] if nested else None}


def read_config(path: str | Path) -> dict[str, Any] | None:
    """A folder's config.json as a dict; None when it is missing or unreadable (the caller's reader names it)."""
    try:
        config = json.loads((Path(path) / "config.json").read_bytes().decode("utf-8"))
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def describe(path: str | Path) -> DrafterFolder | None:
    """The drafter folder at `path`, or None without a readable config.json."""
    config = read_config(path)
    return None if config is None else DrafterFolder(Path(path), config)


def is_dflash_drafter(path: str | Path) -> bool:
    """A DFlash drafter folder, in speculators' layout or z-lab's (layouts.is_dflash_config)."""
    return is_dflash_config(read_config(path) or {})


@dataclass
class SpeculatorsCheckpoint:
    """What a speculators EAGLE-3 checkpoint says about itself, read from config.json and weight headers."""

    path: Path
    config: dict[str, Any]
    layer: dict[str, Any]          # transformer_layer_config
    tensor_files: dict[str, Path]  # tensor name -> safetensors file holding it
    flags: dict[str, bool] = field(default_factory=dict)

    @cached_property
    def dims(self) -> DraftDims:
        # Read with `layer` as its transformer_layer_config: the rehearsal plans one whose config lacks it.
        return draft_dims(self.config | {SPECULATORS_TYPE_KEY: "eagle3", "transformer_layer_config": self.layer})

    @property
    def verifier_path(self) -> str | None:
        return ((self.config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")

    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.tensor_files[name], framework="pt") as f:
            return f.get_tensor(name)


def read_speculators_checkpoint(ckpt_dir: str | Path) -> SpeculatorsCheckpoint:
    ckpt_dir = Path(ckpt_dir)
    config_path = ckpt_dir / "config.json"
    if not config_path.exists():
        raise BadInput(f"{config_path} is missing; point at a speculators checkpoint folder (04_train output)")
    config = read_json_object(config_path, "rerun 04_train.py to write the checkpoint again")
    if config.get(SPECULATORS_TYPE_KEY) != "eagle3":
        raise BadInput(
            f"{config_path}: {SPECULATORS_TYPE_KEY} is {config.get(SPECULATORS_TYPE_KEY)!r}, expected 'eagle3'; "
            "this converter reads speculators EAGLE-3 checkpoints only"
        )
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise BadInput(f"{config_path}: transformer_layer_config is missing; "
                       "the checkpoint is not a speculators drafter")
    if layer.get("model_type", "llama") not in (*SPECULATORS_LAYER_TYPES.values(), *SPECULATORS_MLA_LAYER_TYPES):
        raise BadInput(
            f"{config_path}: transformer_layer_config.model_type is {layer.get('model_type')!r}; the flat formats "
            f"hold {' or '.join(SPECULATORS_LAYER_TYPES.values())} layers only ("
            + ", ".join(FLAT_ARCHITECTURES.values()) + "); serve this checkpoint with vLLM as it is"
        )
    missing = [key for key in (*MLA_LAYER_KEYS, "intermediate_size", "rms_norm_eps") if key not in layer]
    if layer_shape(config) == MLA and missing:
        raise BadInput(f"{config_path}: transformer_layer_config has no {missing[0]}; the MLA layer's shape is unknown")
    if "norm_before_residual" not in config:
        # speculators builds the layer with False, vLLM serves a speculators config with True.
        raise BadInput(f"{config_path}: norm_before_residual is not written; speculators reads a missing flag as "
                       "false and vLLM as true, so write the value the drafter was trained with")
    return SpeculatorsCheckpoint(ckpt_dir, config, layer, weight_files(ckpt_dir), speculators_norm_flags(config))


def target_vocab(ckpt: SpeculatorsCheckpoint, target_vocab_size: int | None) -> int:
    vocab_size = ckpt.dims.vocab_size
    if target_vocab_size is not None and int(target_vocab_size) != vocab_size:
        raise BadInput(
            f"target_vocab_size {target_vocab_size} differs from the checkpoint's transformer_layer_config.vocab_size "
            f"{vocab_size}; the drafter was built for another verifier"
        )
    return vocab_size


@dataclass
class FlatDrafter(DrafterFolder):
    """A flat drafter folder as read from config.json and its safetensors headers, checked by read_flat_drafter."""

    field: str = ""  # the config key that named it, for error lines

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @property
    def weights_path(self) -> Path:
        files = set(self.tensor_files.values())
        return files.pop() if len(files) == 1 else self.path

    @cached_property
    def dims(self) -> DraftDims:
        try:
            return draft_dims(self.config)
        except BadInput as error:
            raise self.fail(self.config_path, str(error).removeprefix("drafter config.json ")) from None

    def fail(self, where: Path, problem: str) -> BadInput:
        return BadInput(f"{self.field}: {where}: {problem}")


def is_speculators_drafter(path: Path) -> bool:
    """A folder in speculators' own nested format (stage 04's checkpoints), which needs no conversion; an
    unreadable config is not one (read_flat_drafter names the defect)."""
    folder = describe(path)
    return folder is not None and folder.layout == SPECULATORS


def read_flat_drafter(path: str | Path, field: str) -> FlatDrafter:
    """The drafter in `path`, refused (BadInput naming `field`, the file and the key) unless its tensors are
    exactly the ones its config implies: no unknown key, none missing (d2t included), every shape right."""
    path = Path(path)
    config = read_flat_config(path, field, "point it at a released EAGLE-3 drafter or a speculators drafter folder")
    check_weights_whole(path, field)
    drafter = FlatDrafter(path, config, field)
    dims = drafter.dims
    # `layers.0.*` (some exports, vLLM's own names) and `midlayer.*` (SpecForge, stage 05) name the same layer.
    specs = {}
    for name, spec in read_tensor_specs(path).items():
        if flat_name(name) in specs:
            raise drafter.fail(drafter.weights_path,
                               f"{name}: holds layer 0 twice (midlayer.* and layers.0.*); keep one")
        specs[flat_name(name)] = spec
    try:  # an MLA layer's fused_qkv_a_proj reads as its two projections
        specs = split_fused_tensors(specs, dims)
    except BadInput as error:
        raise drafter.fail(drafter.weights_path, str(error)) from None
    embed = specs.pop(EMBED_KEY, None)
    problems = shape_problems(specs, config)
    if problems:
        raise drafter.fail(drafter.weights_path, problems[0])
    if embed is not None and embed.shape != (dims.vocab_size, dims.hidden_size):
        raise drafter.fail(drafter.weights_path,
                           f"{EMBED_KEY}: shape {list(embed.shape)}, expected "
                           f"[{dims.vocab_size}, {dims.hidden_size}] (vocab_size, hidden_size)")
    if "d2t" not in specs:  # a full-vocabulary drafter (shape_problems required d2t for a smaller one)
        return drafter
    problems = safetensors_vocab_map_problems(drafter.tensor_files["d2t"], drafter.tensor_files["t2d"],
                                              dims.vocab_size, dims.draft_vocab_size, where="d2t/t2d")
    if problems:
        raise drafter.fail(drafter.weights_path, problems[0])
    return drafter


def check_weights_whole(path: str | Path, field: str) -> None:
    """Read every tensor of the drafter folder `path` once, in full: a torn or unreadable weights file, or a
    floating tensor holding NaN or infinity, is refused naming `field`, the file and the tensor. Headers alone
    cannot tell: a drafter with NaN weights would fine-tune at `loss nan` for as long as it runs, and a torn
    file would fail deep inside vocabulary building or a server start."""
    import torch
    from safetensors import safe_open

    try:
        files = weight_files(Path(path))
    except BadInput as error:
        raise BadInput(f"{field}: {error}") from None
    except Exception as error:  # noqa: BLE001 - an unreadable index, or a header safetensors refuses
        raise BadInput(f"{field}: {path}: cannot read its weights ({type(error).__name__}: {error}); the file is "
                       f"torn or not safetensors, replace it") from None
    by_file: dict[Path, list[str]] = {}
    for name, file in files.items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        name = None
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in sorted(names):
                    tensor = f.get_tensor(name)
                    if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                        bad = int((~torch.isfinite(tensor)).sum())
                        raise BadInput(f"{field}: {file}: tensor {name} holds {bad} NaN or infinite values of "
                                       f"{tensor.numel()}; this drafter cannot be used, replace it")
        except BadInput:
            raise
        except Exception as error:  # noqa: BLE001 - whatever safetensors raises for a torn file
            where = f"tensor {name}" if name else "its header"
            raise BadInput(f"{field}: {file}: cannot read {where} ({type(error).__name__}: {error}); the file is "
                           f"torn or not safetensors, replace it") from None


def read_flat_config(path: str | Path, field: str = "serve.drafter",
                     fix: str = "convert a speculators checkpoint with 05_convert.py first") -> dict[str, Any]:
    """A flat drafter's config.json, refused (naming `field`, the file and `fix`) unless it is a JSON object that
    names a flat EAGLE-3 architecture."""
    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise BadInput(f"{field}: {path} has no config.json; point it at a drafter folder")
    try:
        config = read_json_object(config_path, fix, what="drafter config")
    except BadInput as error:
        raise BadInput(f"{field}: {error}") from None
    if flat_architecture_of(config) is None:
        raise BadInput(f"{field}: {config_path}: architectures is {config.get('architectures')!r}, expected "
                       + " or ".join(f"[{name!r}]" for name in FLAT_ARCHITECTURES.values()) + f"; {fix}")
    return config


def read_flat_tensors(path: str | Path, dims: DraftDims | None = None) -> dict:
    """Every tensor of a drafter folder under its flat name (an export's `model.` prefix dropped, as the replay
    reads it), an MLA layer's fused_qkv_a_proj as its two projections (vLLM fuses them again on load); `dims`:
    the folder's, read from its config.json when not given."""
    from safetensors import safe_open

    tensors = {}
    for name, file in sorted(weight_files(Path(path)).items()):
        with safe_open(file, framework="pt") as f:
            tensors[flat_name(strip_export_prefix(name))] = f.get_tensor(name)
    return split_fused_tensors(tensors, dims or draft_dims(read_flat_config(path)))
