"""Released EAGLE-3 drafters (a flat `LlamaForCausalLMEagle3` or `Eagle3DeepseekV2ForCausalLM` folder): check one
against the target and the run, and write it in the speculators layout that speculators' trainer fine-tunes from,
through drafter/to_speculators.py. How each gap of a flat folder is closed (the aux ids' convention, a full
vocabulary, absent norm flags, the target's embedding) is docs/released_drafters.md's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from eagle_pipeline.atomic import atomic_dir
from eagle_pipeline.drafter.folder import (
    DrafterFolder,
    FlatDrafter,
    is_speculators_drafter,
    read_flat_drafter,
    read_flat_tensors,
    read_speculators_checkpoint,
    target_vocab,
)
from eagle_pipeline.drafter.layouts import EMBED_KEY, MLA, is_dflash_config
from eagle_pipeline.drafter.tensors import MLA_LAYER_KEYS, dflash_tensor_problems, read_tensor_specs
from eagle_pipeline.drafter.to_speculators import MLA_ROPE_KEYS, rope_parameters
from eagle_pipeline.drafter.to_speculators import write_speculators_folder as write_folder
from eagle_pipeline.errors import BadInput
from eagle_pipeline.json_files import read_json_object
from eagle_pipeline.layer_ids import from_convention
from eagle_pipeline.verifier import target_embedding
from eagle_pipeline.vocab_map import safetensors_vocab_map_problems


def check_against_target(drafter: FlatDrafter, *, hidden_size: int, vocab_size: int,
                         target: dict[str, Any] | None = None) -> None:
    """Refuse a drafter built for another target: its width and vocabulary must be the target's, and an MLA one's
    attention sizes and rope those of `target` (the target's text config) where it is given."""
    dims = drafter.dims
    compared = [("hidden_size", dims.hidden_size, hidden_size, "hidden size"),
                ("target_hidden_size", dims.target_hidden_size, hidden_size, "hidden size"),
                ("vocab_size", dims.vocab_size, vocab_size, "vocabulary size")]
    if target is not None and drafter.layer_shape == MLA:  # vLLM's MLA drafter runs the target's latent and rope
        theirs, ours = rope_parameters(drafter.config), rope_parameters(target)
        compared += [(key, drafter.config.get(key), target.get(key), key) for key in MLA_LAYER_KEYS]
        compared += [(f"rope_scaling.{key}", theirs[key], ours[key], f"rope_scaling.{key}") for key in MLA_ROPE_KEYS
                     if key in theirs and key in ours]
    for key, theirs, ours, what in compared:
        if theirs != ours:
            raise drafter.fail(drafter.config_path, f"{key} {theirs} differs from the target's {what} {ours}; "
                                                    f"the drafter was built for another target model")


def full_vocabulary(drafter: FlatDrafter) -> bool:
    """A drafter whose lm_head covers the target's whole vocabulary (no d2t)."""
    return drafter.dims.draft_vocab_size == drafter.dims.vocab_size


def check_draft_vocab_size(drafter: FlatDrafter, configured: int) -> None:
    """The run's draft vocabulary must be the drafter's; a full-vocabulary drafter also takes a smaller one, its
    lm_head cut to those rows (write_speculators_folder)."""
    draft_vocab_size = drafter.dims.draft_vocab_size
    if full_vocabulary(drafter) and configured <= drafter.dims.vocab_size:
        return
    if draft_vocab_size != configured:
        raise drafter.fail(drafter.config_path, f"draft_vocab_size {draft_vocab_size} but "
                                                f"vocab.draft_vocab_size is {configured}; set vocab.draft_vocab_size: "
                                                f"{draft_vocab_size} to use its vocabulary")


def adopted_vocab_map(path: str | Path, field: str, *, hidden_size: int, vocab_size: int,
                      draft_vocab_size: int) -> tuple[np.ndarray, np.ndarray, Path]:
    """A drafter's own d2t (int64) and t2d (bool), checked against the target and the configured draft
    vocabulary size, and the file they came from (for the manifest's fingerprint)."""
    path = Path(path)
    if is_speculators_drafter(path):
        ckpt = read_speculators_checkpoint(path)
        try:
            target_vocab(ckpt, vocab_size)
        except BadInput as error:
            raise BadInput(f"{field}: {path / 'config.json'}: {error}") from None
        if ckpt.dims.draft_vocab_size != draft_vocab_size:
            raise BadInput(f"{field}: {path / 'config.json'}: draft_vocab_size {ckpt.dims.draft_vocab_size} but "
                           f"vocab.draft_vocab_size is {draft_vocab_size}; "
                           f"set vocab.draft_vocab_size: {ckpt.dims.draft_vocab_size}")
        if "d2t" not in ckpt.tensor_files or "t2d" not in ckpt.tensor_files:
            raise BadInput(f"{field}: {path}: d2t: missing; a drafter without a draft vocabulary has none to adopt")
        files = ckpt.tensor_files
    else:
        drafter = read_flat_drafter(path, field)
        check_against_target(drafter, hidden_size=hidden_size, vocab_size=vocab_size)
        if "d2t" not in drafter.tensor_files:
            raise BadInput(f"{field}: {drafter.weights_path}: d2t: missing; a full-vocabulary drafter has no draft "
                           f"vocabulary to adopt: leave {field} out (stage 03 counts one, train.init_from maps it)")
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
            raise drafter.fail(drafter.config_path,
                               f"eagle_aux_hidden_state_layer_ids {list(top)} and "
                               f"eagle_config.eagle_aux_hidden_state_layer_ids {list(nested)} differ; "
                               f"keep the ones the drafter was trained on")
        if configured == "sglang":
            raise BadInput(f"train.init_from_convention: sglang, but {drafter.config_path} has a top-level "
                           f"eagle_aux_hidden_state_layer_ids, which only vLLM-convention folders carry; "
                           f"set vllm or leave it out")
        return "vllm"
    if nested is None:
        raise drafter.fail(drafter.config_path, "eagle_config.eagle_aux_hidden_state_layer_ids: missing; the "
                                                "drafter's aux layers are unknown, so it cannot be fine-tuned")
    if configured is None and drafter.layer_shape == MLA:
        return "vllm"  # folder.engine_layer_ids: vLLM, the one engine of this architecture, reads them as they stand
    if configured is None:
        raise BadInput(f"train.init_from_convention: not set, and {drafter.config_path} gives its aux layer ids "
                       f"{list(nested)} only in eagle_config, which SGLang (output of layer k) and vLLM (input of "
                       f"layer k) read differently; set sglang (SpecForge, AQ-MedAI) or vllm")
    return configured


def hf_layer_ids(drafter: FlatDrafter, convention: str) -> list[int]:
    """The drafter's aux ids in the pipeline's convention (HF hidden_states indices)."""
    return from_convention(drafter.written_layer_ids or [], convention)


def mapped_to_draft_vocab(config: dict[str, Any], tensors: dict, d2t: np.ndarray,
                          t2d: np.ndarray) -> tuple[dict[str, Any], dict]:
    """A full-vocabulary drafter's config and tensors with its lm_head cut to the rows of a draft vocabulary
    (target id `k + d2t[k]` for draft id k) and that vocabulary's d2t/t2d added."""
    import torch

    ids = np.arange(len(d2t)) + d2t
    lm_head = tensors["lm_head.weight"]
    mapped = dict(tensors) | {"lm_head.weight": lm_head[torch.from_numpy(ids)].contiguous(),
                              "d2t": torch.from_numpy(np.asarray(d2t, dtype=np.int64)),
                              "t2d": torch.from_numpy(np.asarray(t2d, dtype=bool))}
    return config | {"draft_vocab_size": len(d2t)}, mapped


def write_speculators_folder(drafter: FlatDrafter, out_dir: Path, *, verifier_dir: Path, layer_ids: list[int],
                             ttt_steps: int, vocab_map: tuple[np.ndarray, np.ndarray] | None = None) -> dict[str, Any]:
    """The drafter in speculators' layout for fine-tuning, written atomically; `layer_ids` are HF indices.
    `vocab_map` (stage 03's d2t, t2d) maps a full-vocabulary drafter to that draft vocabulary when it is smaller.
    Returns what was written, for the manifest."""
    tensors = read_flat_tensors(drafter.path, drafter.dims)
    tensors.pop(EMBED_KEY, None)  # the target's embedding is used (docs/released_drafters.md)
    config, note, vocab_size = drafter.config, {}, drafter.dims.vocab_size
    if full_vocabulary(drafter) and vocab_map is not None and len(vocab_map[0]) < vocab_size:
        config, tensors = mapped_to_draft_vocab(config, tensors, *vocab_map)
        note = {"lm_head": f"the rows of stage 03's {len(vocab_map[0])} draft tokens of {vocab_size}"}
    written = write_folder(out_dir, config, tensors, embedding=target_embedding(verifier_dir),
                           verifier_dir=verifier_dir, layer_ids=layer_ids, flags=drafter.flags,
                           speculative_tokens=ttt_steps)
    return written | {"embed_tokens": "the target's, copied"} | note


def read_dflash_release(path: Path, *, verifier_dir: Path, layer_ids: list[int], hidden_size: int, vocab_size: int,
                        convention: str | None = None) -> tuple[DrafterFolder, dict[str, Any]]:
    """A flat DFlash release in z-lab's layout (z-lab/Kimi-K2.5-DFlash: `DFlashDraftModel`, the Qwen3 fields at the
    top level, `dflash_config` {mask_token_id, target_layer_ids}), refused unless its aux layers (the sglang
    convention, docs/drafter_families.md), width, vocabulary and tensors (from their headers, speculators'
    DFlashDraftModel's for its config) fit this run. Returns the folder and the layer-id record for the manifest."""
    from speculators.convert.dflash.converter import DFlashConverter

    config_path = path / "config.json"
    config = read_json_object(config_path, "point train.init_from at the release's own folder")
    written = (config.get("dflash_config") or {}).get("target_layer_ids") if is_dflash_config(config) else None
    if written is None or convention == "vllm":
        raise BadInput(f"train.init_from: {config_path} is not a DFlash release in z-lab's layout "
                       f"(DFlashDraftModel with dflash_config.target_layer_ids, ids in the sglang convention); "
                       f"point it at one, or at a speculators DFlash folder")
    ids = from_convention(written, "sglang")
    if ids != list(layer_ids):
        raise BadInput(f"train.init_from: {config_path}: dflash_config.target_layer_ids {written} are HF layers {ids} "
                       f"(z-lab counts the output of layer i), but this run captured {list(layer_ids)}; set "
                       f"hidden_states.layer_ids: {ids} and rerun stage 02")
    for key, ours in (("hidden_size", hidden_size), ("vocab_size", vocab_size)):
        if config.get(key) != ours:
            raise BadInput(f"train.init_from: {config_path}: {key} {config.get(key)} differs from the target's {ours}; "
                           f"the drafter was built for another target model")
    try:  # speculators' own reading of the folder (`speculators convert`), with the ids converted here
        spec_config = DFlashConverter()._build_config(config, str(verifier_dir), ids)
    except (ValueError, KeyError, TypeError) as error:
        raise BadInput(f"train.init_from: {config_path}: speculators cannot read it ({error})") from None
    folder = DrafterFolder(path, config)
    problems = dflash_tensor_problems(spec_config, read_tensor_specs(path))
    if problems:
        raise BadInput(f"train.init_from: {path}: {problems[0]} ({len(problems)} problem(s) in all); the weights "
                       f"and config.json disagree")
    return folder, {"convention": "sglang", "written": list(written), "hf": ids}


def write_dflash_release(release: DrafterFolder, out_dir: Path, *, verifier_dir: Path,
                         layer_ids: list[int]) -> dict[str, Any]:
    """A checked DFlash release (read_dflash_release) in speculators' layout, written atomically by speculators' own
    converter with the run's ids: the embedding and head the verifier's, as vLLM serves a release with the
    target's."""
    from speculators.convert.dflash.converter import DFlashConverter

    with atomic_dir(out_dir) as tmp:
        DFlashConverter().convert(release.path, tmp, base_model=str(verifier_dir), validate=False,
                                  aux_hidden_state_layer_ids=list(layer_ids))
    return {"dir": str(out_dir), "embed_tokens": "the target's, copied"}
