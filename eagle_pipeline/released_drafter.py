"""Released EAGLE-3 drafters: read a flat `LlamaForCausalLMEagle3` folder (AQ-MedAI's Kimi-K2.5 drafter,
SpecForge's output, this pipeline's own stage 05 `vllm/`), check it against the target, and write it in
the speculators layout that speculators' trainer fine-tunes from (`--from-pretrained`), through
flat_to_speculators.py (docs/released_drafters.md).

A flat folder says less than a speculators one, and each gap is closed explicitly:
- its aux layer ids are usually only in `eagle_config`, where SGLang reads id k as the output of layer k and
  vLLM as the input of layer k; only a top-level `eagle_aux_hidden_state_layer_ids` (a key vLLM alone reads,
  which SGLang folders must not carry) says vLLM. Otherwise the run names the convention
  (`train.init_from_convention`) and the ids are converted once, by layer_ids.py, into HF indices;
- norm flags it leaves out are read as vLLM reads a flat config: false (SpecForge drafters have none);
- `embed_tokens` is usually absent: EAGLE-3 drafters embed with the target's own (frozen) embedding, so
  releases leave it out. The folder written here carries the target's, copied from the target's weights:
  speculators' `load_verifier_weights` fills only an embedding that loaded as NaN, and one missing from a
  folder loads as zeros, so without the copy the fine-tune would start from an all-zero embedding. One that
  is present is replaced for the same reason: stage 05 ships without it and vLLM then serves the drafter
  with the target's embedding, so training must use that one too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from eagle_pipeline.drafter_checks.shapes import shape_problems
from eagle_pipeline.drafter_checks.tensors import draft_dims, read_tensor_specs
from eagle_pipeline.drafter_format import EMBED_KEY, FLAT_ARCHITECTURE, flat_name, flat_norm_flags, weight_files
from eagle_pipeline.errors import BadInput
from eagle_pipeline.json_files import read_json_object
from eagle_pipeline.layer_ids import from_convention
from eagle_pipeline.verifier import target_embedding
from eagle_pipeline.vocab_map import safetensors_vocab_map_problems


@dataclass
class FlatDrafter:
    """A flat drafter folder as read from config.json and its safetensors headers."""

    path: Path
    field: str  # the config key that named it, for error lines
    config: dict[str, Any]
    tensor_files: dict[str, Path]  # stored tensor name -> file

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @property
    def weights_path(self) -> Path:
        files = set(self.tensor_files.values())
        return files.pop() if len(files) == 1 else self.path

    @property
    def hidden_size(self) -> int:
        return int(self.config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])

    @property
    def draft_vocab_size(self) -> int:
        return int(self.config.get("draft_vocab_size") or self.vocab_size)

    @property
    def flags(self) -> dict[str, bool]:
        # As vLLM reads them (a flag left out is false); the drafter was served (and trained) so.
        return flat_norm_flags(self.config)

    @property
    def written_layer_ids(self) -> list[int] | None:
        ids = (self.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        ids = ids if ids is not None else self.config.get("eagle_aux_hidden_state_layer_ids")
        return None if ids is None else [int(k) for k in ids]

    def fail(self, where: Path, problem: str) -> BadInput:
        return BadInput(f"{self.field}: {where}: {problem}")


def is_speculators_drafter(path: Path) -> bool:
    """A folder in speculators' own nested format (stage 04's checkpoints), which needs no conversion."""
    config_path = Path(path) / "config.json"
    try:
        config = json.loads(config_path.read_bytes().decode("utf-8"))
    except (OSError, ValueError):  # unreadable, not UTF-8, not JSON: read_flat_drafter names the defect
        return False
    return isinstance(config, dict) and "speculators_model_type" in config


def read_flat_drafter(path: str | Path, field: str) -> FlatDrafter:
    """The drafter in `path`, refused (BadInput naming `field`, the file and the key) unless its tensors are
    exactly the ones its config implies: no unknown key, none missing (d2t included), every shape right."""
    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise BadInput(f"{field}: {path} has no config.json; point it at a drafter folder")
    try:
        config = read_json_object(config_path, "point it at a released EAGLE-3 drafter or a speculators drafter folder",
                                  what="drafter config")
    except BadInput as error:
        raise BadInput(f"{field}: {error}") from None
    if FLAT_ARCHITECTURE not in (config.get("architectures") or []):
        raise BadInput(f"{field}: {config_path}: architectures is {config.get('architectures')!r}, expected "
                       f"[{FLAT_ARCHITECTURE!r}] (a released EAGLE-3 drafter) or a speculators drafter folder")
    check_weights_whole(path, field)
    drafter = FlatDrafter(path, field, config, weight_files(path))
    try:
        draft_dims(config)
    except BadInput as error:
        raise drafter.fail(config_path, str(error).removeprefix("drafter config.json ")) from None
    # `layers.0.*` (some exports) and `midlayer.*` (SpecForge, stage 05) name the same layer.
    specs = {}
    for name, spec in read_tensor_specs(path).items():
        if flat_name(name) in specs:
            raise drafter.fail(drafter.weights_path, f"{name}: holds layer 0 twice (midlayer.* and layers.0.*); keep one")
        specs[flat_name(name)] = spec
    embed = specs.pop(EMBED_KEY, None)
    problems = shape_problems(specs, config)
    if problems:
        raise drafter.fail(drafter.weights_path, problems[0])
    if embed is not None and embed.shape != (drafter.vocab_size, drafter.hidden_size):
        raise drafter.fail(drafter.weights_path, f"{EMBED_KEY}: shape {list(embed.shape)}, expected "
                                                 f"[{drafter.vocab_size}, {drafter.hidden_size}] (vocab_size, hidden_size)")
    if "d2t" not in specs:  # a full-vocabulary drafter: nothing maps draft ids to target ids
        raise drafter.fail(drafter.weights_path, "d2t: missing; the pipeline fine-tunes drafters with a draft "
                                                 "vocabulary (d2t and t2d), so use one that has them")
    problems = safetensors_vocab_map_problems(drafter.tensor_files["d2t"], drafter.tensor_files["t2d"],
                                              drafter.vocab_size, drafter.draft_vocab_size, where="d2t/t2d")
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


def check_against_target(drafter: FlatDrafter, *, hidden_size: int, vocab_size: int) -> None:
    """Refuse a drafter built for another target: its width and vocabulary must be the target's."""
    target_hidden = int(drafter.config.get("target_hidden_size") or drafter.hidden_size)
    for key, theirs, ours, what in (("hidden_size", drafter.hidden_size, hidden_size, "hidden size"),
                                    ("target_hidden_size", target_hidden, hidden_size, "hidden size"),
                                    ("vocab_size", drafter.vocab_size, vocab_size, "vocabulary size")):
        if theirs != ours:
            raise drafter.fail(drafter.config_path, f"{key} {theirs} differs from the target's {what} {ours}; "
                                                    f"the drafter was built for another target model")


def check_draft_vocab_size(drafter: FlatDrafter, configured: int) -> None:
    if drafter.draft_vocab_size != configured:
        raise drafter.fail(drafter.config_path, f"draft_vocab_size {drafter.draft_vocab_size} but "
                                                f"vocab.draft_vocab_size is {configured}; set vocab.draft_vocab_size: "
                                                f"{drafter.draft_vocab_size} to use its vocabulary")


def adopted_vocab_map(path: str | Path, field: str, *, hidden_size: int, vocab_size: int,
                      draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray, Path]:
    """A drafter's own d2t (int64) and t2d (bool), checked against the target and the configured draft
    vocabulary size, and the file they came from (for the manifest's fingerprint)."""
    path = Path(path)
    if is_speculators_drafter(path):
        from eagle_pipeline.convert import read_speculators_checkpoint, target_vocab

        ckpt = read_speculators_checkpoint(path)
        try:
            target_vocab(ckpt, vocab_size)
        except BadInput as error:
            raise BadInput(f"{field}: {path / 'config.json'}: {error}") from None
        if ckpt.draft_vocab_size != draft_vocab_size:
            raise BadInput(f"{field}: {path / 'config.json'}: draft_vocab_size {ckpt.draft_vocab_size} but "
                           f"vocab.draft_vocab_size is {draft_vocab_size}; set vocab.draft_vocab_size: {ckpt.draft_vocab_size}")
        if "d2t" not in ckpt.tensor_files or "t2d" not in ckpt.tensor_files:
            raise BadInput(f"{field}: {path}: d2t: missing; a drafter without a draft vocabulary has none to adopt")
        files = ckpt.tensor_files
    else:
        drafter = read_flat_drafter(path, field)
        check_against_target(drafter, hidden_size=hidden_size, vocab_size=vocab_size)
        check_draft_vocab_size(drafter, draft_vocab_size)
        files = drafter.tensor_files
    problems = safetensors_vocab_map_problems(files["d2t"], files["t2d"], vocab_size, draft_vocab_size,
                                              where=f"{field}: {files['d2t']}")
    if problems:
        raise BadInput(problems[0])
    from safetensors import safe_open

    with safe_open(files["d2t"], framework="np") as f:
        d2t = f.get_tensor("d2t")
    with safe_open(files["t2d"], framework="np") as f:
        t2d = f.get_tensor("t2d")
    return d2t, t2d, files["d2t"]


def layer_id_convention(drafter: FlatDrafter, configured: str | None) -> str:
    """How the drafter's aux ids are numbered: known from a top-level key, else the configured one."""
    top = drafter.config.get("eagle_aux_hidden_state_layer_ids")
    nested = (drafter.config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if top is not None:
        if nested is not None and list(nested) != list(top):
            raise drafter.fail(drafter.config_path, f"eagle_aux_hidden_state_layer_ids {list(top)} and "
                                                    f"eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} differ; "
                                                    f"keep the ones the drafter was trained on")
        if configured == "sglang":
            raise BadInput(f"train.init_from_convention: sglang, but {drafter.config_path} has a top-level "
                           f"eagle_aux_hidden_state_layer_ids, which only vLLM-convention folders carry; set vllm or leave it out")
        return "vllm"
    if nested is None:
        raise drafter.fail(drafter.config_path, "eagle_config.eagle_aux_hidden_state_layer_ids: missing; the "
                                                "drafter's aux layers are unknown, so it cannot be fine-tuned")
    if configured is None:
        raise BadInput(f"train.init_from_convention: not set, and {drafter.config_path} gives its aux layer ids "
                       f"{list(nested)} only in eagle_config, which SGLang (output of layer k) and vLLM (input of "
                       f"layer k) read differently; set sglang (SpecForge, AQ-MedAI) or vllm")
    return configured


def hf_layer_ids(drafter: FlatDrafter, convention: str) -> list[int]:
    """The drafter's aux ids in the pipeline's convention (HF hidden_states indices)."""
    return from_convention(drafter.written_layer_ids or [], convention)


def write_speculators_folder(drafter: FlatDrafter, out_dir: Path, *, verifier_dir: Path, layer_ids: list[int],
                             ttt_steps: int) -> dict[str, Any]:
    """The drafter in speculators' layout for fine-tuning, written atomically; `layer_ids` are HF indices.
    Returns what was written, for the manifest."""
    from safetensors import safe_open

    from eagle_pipeline.flat_to_speculators import write_speculators_folder as write_folder

    tensors = {}
    for name, path in sorted(drafter.tensor_files.items()):
        if flat_name(name) == EMBED_KEY:
            continue  # the target's embedding is used (module docstring)
        with safe_open(path, framework="pt") as f:
            tensors[name] = f.get_tensor(name)
    written = write_folder(out_dir, drafter.config, tensors, embedding=target_embedding(verifier_dir),
                           verifier_dir=verifier_dir, layer_ids=layer_ids, flags=drafter.flags,
                           speculative_tokens=ttt_steps)
    return written | {"embed_tokens": "the target's, copied"}
