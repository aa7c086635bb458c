"""Judges a draft vocabulary map (d2t, t2d): would it send every draft id to the right target id? The one place
with the rules (what the two arrays mean: docs/formats.md, "Draft vocabulary"). The maps come as tensors (a
checkpoint being converted), as a drafter's safetensors files, or as stage 03's .npy files.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from eagle_pipeline.errors import BadInput

if TYPE_CHECKING:
    import torch


def vocab_map_problems(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int, draft_vocab_size: int) -> list[str]:
    """What is wrong with the pair, each message ending in what to do; empty when it is sound.

    Stops at the first problem: each rule needs the ones before it to hold (shapes before indexing)."""
    import torch

    if d2t.dtype != torch.int64:
        return [f"d2t has dtype {d2t.dtype}, expected int64; rebuild the vocab map (stage 03)"]
    if t2d.dtype != torch.bool:
        return [f"t2d has dtype {t2d.dtype}, expected bool; rebuild the vocab map (stage 03)"]
    if tuple(d2t.shape) != (draft_vocab_size,) or tuple(t2d.shape) != (vocab_size,):
        return [f"d2t {tuple(d2t.shape)} / t2d {tuple(t2d.shape)} do not match draft_vocab_size "
                f"{draft_vocab_size} / vocab_size {vocab_size}"]
    if int(t2d.sum()) != draft_vocab_size:
        return [f"t2d marks {int(t2d.sum())} tokens but d2t has {draft_vocab_size}: the two come from different "
                f"vocab maps; rebuild the vocab map (stage 03) and retrain"]
    target_ids = torch.arange(draft_vocab_size) + d2t
    if int(target_ids.min()) < 0 or int(target_ids.max()) >= vocab_size:
        problem = "d2t points outside the target vocabulary"
    elif bool((target_ids[1:] <= target_ids[:-1]).any()):
        problem = "draft ids do not map to strictly ascending target ids"
    elif not bool(t2d[target_ids].all()):
        problem = "t2d does not mark exactly the target ids that d2t maps to"
    else:
        return []
    return [f"{problem}; rebuild the vocab map (stage 03) and retrain"]


def check_vocab_map(d2t: torch.Tensor, t2d: torch.Tensor, vocab_size: int, draft_vocab_size: int, where: str) -> None:
    """Raise BadInput, naming `where`, for a pair that would map draft ids to the wrong target ids."""
    problems = vocab_map_problems(d2t, t2d, vocab_size, draft_vocab_size)
    if problems:
        raise BadInput(f"{where}: {problems[0]}")


def safetensors_vocab_map_problems(d2t_file: Path, t2d_file: Path, vocab_size: int, draft_vocab_size: int,
                                   where: str = "d2t/t2d") -> list[str]:
    """The problems of the d2t and t2d tensors stored in a drafter's safetensors file(s), each naming `where`."""
    from safetensors import safe_open

    tensors = {}
    for name, path in (("d2t", d2t_file), ("t2d", t2d_file)):
        with safe_open(path, framework="pt") as f:
            tensors[name] = f.get_tensor(name)
    problems = vocab_map_problems(tensors["d2t"], tensors["t2d"], vocab_size, draft_vocab_size)
    return [f"{where}: {problem}" for problem in problems]


def _read_npy(path: str | Path) -> np.ndarray:
    try:
        array = np.load(path, allow_pickle=False)
    except OSError as e:
        raise BadInput(f"{path}: cannot be read ({e.strerror}); fix its "
                       "permissions or rebuild the vocab map (stage 03)") from None
    except (ValueError, EOFError) as e:  # numpy's reader says ValueError for a bad header, EOFError for a torn one
        raise BadInput(f"{path}: not a whole .npy array ({e}); rebuild the vocab map (stage 03, --force)") from None
    if not isinstance(array, np.ndarray):
        raise BadInput(f"{path}: holds several arrays, not one; rebuild the vocab map (stage 03, --force)")
    return array


def load_vocab_map(d2t_path: str | Path, t2d_path: str | Path,
                   vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Stage 03's d2t.npy and t2d.npy, checked against each other and, when given, against the verifier's
    `vocab_size`; BadInput names the file."""
    for path in (d2t_path, t2d_path):
        if not Path(path).is_file():
            raise BadInput(f"{path}: vocab map file is missing; run stage 03 (build_vocab_map) first")
    d2t, t2d = (_read_npy(path) for path in (d2t_path, t2d_path))
    if d2t.ndim != 1 or d2t.dtype != np.int64:
        raise BadInput(f"{d2t_path}: expected a 1-D int64 array (offsets), got {d2t.dtype} {d2t.shape}")
    if t2d.ndim != 1 or t2d.dtype != np.bool_:
        raise BadInput(f"{t2d_path}: expected a 1-D bool array, got {t2d.dtype} {t2d.shape}")
    import torch

    # The pair is judged at its own sizes first, so that a map built for another verifier is named as such.
    check_vocab_map(torch.from_numpy(d2t), torch.from_numpy(t2d), t2d.shape[0], d2t.shape[0], str(d2t_path))
    if vocab_size is not None and t2d.shape[0] != vocab_size:
        raise BadInput(f"{t2d_path}: has {t2d.shape[0]} entries but the verifier's vocabulary has {vocab_size}; "
                       "rebuild the vocab map for this verifier")
    return d2t, t2d
