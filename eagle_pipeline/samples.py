"""The hidden-state sample: stage 02 writes it, stage 04 (through speculators) reads it. Its tensors and the two
storage dtypes (`hidden_states.storage_dtype`) are docs/formats.md's, "Hidden-state samples (stage 02)".

This module owns the file name, the encoding and every check of a sample file.
"""

from __future__ import annotations

import enum
import json
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from eagle_pipeline import atomic
from eagle_pipeline.errors import BadInput
from eagle_pipeline.layer_ids import resolve_layer_ids

if TYPE_CHECKING:
    import torch

SAMPLES_DIR = "hidden_states"
# Stage 01's folder of one-pass states (hidden_states.one_pass): hs_<i> holds sample i's whole conversation but its
# last token, in this format; stage 02 makes its row's file from it (`sample_from_stored`).
STATES_DIR = "states"
FP8_SCALES_KEY = "hidden_states_scales"  # = hs_connectors.fp8_utils.SCALES_KEY
# A safetensors header this size describes hundreds of thousands of tensors; a larger length field means the
# file is not a sample at all, and reading it would try to allocate that much memory.
MAX_HEADER_BYTES = 16 * 2**20


class StorageDtype(str, enum.Enum):
    """How stage 02 stores hidden states: the config's `hidden_states.storage_dtype` values."""

    BFLOAT16 = "bfloat16"
    FP8 = "fp8"

    def __str__(self) -> str:
        return self.value

    @property
    def bytes_per_value(self) -> int:
        return 2 if self is StorageDtype.BFLOAT16 else 1

    @property
    def speculators_backend(self) -> str:
        """The name speculators' `--hidden-states-backend` gives the reader of this storage."""
        return "file" if self is StorageDtype.BFLOAT16 else "fp8"


class BadSample(ValueError):
    """A captured or stored hidden-states sample failed its check; the message names the sample or file."""


def sample_filename(row: int) -> str:
    return f"hs_{row}.safetensors"


def sample_path(samples_dir: str | os.PathLike, row: int) -> Path:
    return Path(samples_dir) / sample_filename(row)


def sample_row(path: str | os.PathLike) -> int | None:
    """The dataset row a sample file belongs to, or None for a file that is not a sample."""
    stem = Path(path).name.removesuffix(".safetensors")
    prefix, _, row = stem.partition("_")
    return int(row) if prefix == "hs" and row.isdigit() and Path(path).name.endswith(".safetensors") else None


def sample_files(samples_dir: str | os.PathLike) -> dict[int, Path]:
    """Row -> file of every sample file in the folder (temporaries and strays left out)."""
    folder = Path(samples_dir)
    if not folder.is_dir():
        return {}
    found = {sample_row(p): p for p in folder.iterdir()}
    return {row: found[row] for row in sorted(r for r in found if r is not None)}


def estimate_bytes(num_tokens: int, num_states: int, hidden_size: int, storage_dtype: str | StorageDtype) -> int:
    """Disk for that many tokens' samples (the hidden states dominate; token ids and headers are ignored)."""
    return num_tokens * num_states * hidden_size * StorageDtype(storage_dtype).bytes_per_value


def check_sample(
    sample: dict[str, torch.Tensor],
    expected_token_ids: torch.Tensor | Sequence[int],
    *,
    num_states: int | None = None,
    hidden_size: int | None = None,
    where: str,
) -> None:
    """Raise BadSample (naming `where`) unless the sample's tokens equal the input and its states are sane."""
    import torch

    missing = {"hidden_states", "token_ids"} - sample.keys()
    if missing:
        raise BadSample(f"{where}: missing tensors {sorted(missing)}")
    hidden, tokens = sample["hidden_states"], sample["token_ids"]
    expected = torch.as_tensor(expected_token_ids, dtype=torch.long)
    if tokens.dim() != 1 or tokens.shape[0] != expected.shape[0]:
        raise BadSample(f"{where}: {tuple(tokens.shape)} token ids, expected {expected.shape[0]}")
    mismatch = (tokens.long() != expected).nonzero()
    if len(mismatch):
        pos = int(mismatch[0])
        raise BadSample(
            f"{where}: token ids differ from the input at position {pos} "
            f"({int(tokens[pos])} != {int(expected[pos])}, {len(mismatch)} positions in all)"
        )
    if hidden.dim() != 3 or hidden.shape[0] != expected.shape[0]:
        raise BadSample(f"{where}: hidden_states shape {tuple(hidden.shape)}, expected [{expected.shape[0]}, n, H]")
    if num_states is not None and hidden.shape[1] != num_states:
        raise BadSample(f"{where}: {hidden.shape[1]} hidden-state slots, expected {num_states} (aux ids + final)")
    if hidden_size is not None and hidden.shape[2] != hidden_size:
        raise BadSample(f"{where}: hidden size {hidden.shape[2]}, expected {hidden_size}")
    if not torch.isfinite(hidden.float()).all():
        raise BadSample(f"{where}: hidden_states contain NaN or infinite values")


def encode_sample(sample: dict[str, torch.Tensor],
                  storage_dtype: str | StorageDtype = StorageDtype.BFLOAT16) -> dict[str, torch.Tensor]:
    """The tensors to store: bf16 as speculators' file backend reads them, or hs_connectors' fp8 format."""
    import torch

    try:
        storage = StorageDtype(storage_dtype)
    except ValueError:
        raise BadInput(f"storage_dtype: {storage_dtype!r} is not one of {[s.value for s in StorageDtype]}") from None
    hidden = sample["hidden_states"].to(torch.bfloat16).contiguous()
    tokens = sample["token_ids"].to(torch.int64).contiguous()
    if storage is StorageDtype.BFLOAT16:
        return {"hidden_states": hidden, "token_ids": tokens}
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

    assert SCALES_KEY == FP8_SCALES_KEY
    fp8, scales = quantize_tensor_to_fp8(hidden)
    return {"hidden_states": fp8, SCALES_KEY: scales, "token_ids": tokens}


def decode_sample(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of encode_sample, as hs_connectors.FP8Transfer does it: fp8 files come back as bf16."""
    if FP8_SCALES_KEY not in tensors:
        return tensors
    from hs_connectors.fp8_utils import dequantize_fp8_tensor

    decoded = {k: v for k, v in tensors.items() if k != FP8_SCALES_KEY}
    decoded["hidden_states"] = dequantize_fp8_tensor(tensors["hidden_states"], tensors[FP8_SCALES_KEY])
    return decoded


def write_sample(
    samples_dir: str | os.PathLike,
    row: int,
    sample: dict[str, torch.Tensor],
    expected_token_ids: torch.Tensor | Sequence[int],
    *,
    num_states: int,
    hidden_size: int | None = None,
    storage_dtype: str | StorageDtype = StorageDtype.BFLOAT16,
) -> Path:
    """Check a captured sample and write it atomically to samples_dir/hs_<row>.safetensors; returns the path."""
    from safetensors.torch import save

    path = sample_path(samples_dir, row)
    check_sample(sample, expected_token_ids, num_states=num_states, hidden_size=hidden_size, where=str(path))
    # Serialized in memory and written by Python (the same bytes save_file writes): a full disk then raises
    # OSError(ENOSPC), which the stage reports as "disk full", where safetensors' own writer raises a
    # SafetensorError that says only "I/O error".
    atomic.write_bytes(path, save(encode_sample(sample, storage_dtype)))
    return path


def sample_from_stored(source: Path, samples_dir: str | os.PathLike, row: int,
                       expected_token_ids: torch.Tensor | Sequence[int], *, num_states: int, hidden_size: int,
                       storage_dtype: str | StorageDtype) -> Path:
    """Row `row`'s sample from a stored one that begins with the row's tokens (stage 01's one-pass states): after
    every check of its values, a hard link to it where it holds exactly those tokens (no bytes copied), else its
    first tokens written anew (a row cut at hidden_states.max_seq_len). BadSample names the file that fails."""
    sample, path = read_sample(source), sample_path(samples_dir, row)
    if len(sample["token_ids"]) != len(expected_token_ids):
        cut = {key: value[: len(expected_token_ids)] for key, value in sample.items()}
        return write_sample(samples_dir, row, cut, expected_token_ids, num_states=num_states, hidden_size=hidden_size,
                            storage_dtype=storage_dtype)
    check_sample(sample, expected_token_ids, num_states=num_states, hidden_size=hidden_size, where=str(source))
    try:
        os.link(source, path)
    except OSError:  # a file system without hard links
        atomic.write_bytes(path, Path(source).read_bytes())
    return path


def read_sample(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Load a stored sample (bf16 or fp8) as bf16 hidden_states and int64 token_ids."""
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise BadSample(f"{path}: missing")
    try:
        read_header(Path(path))
        tensors = load_file(str(path))
    except Exception as e:  # safetensors raises its own error types for torn or foreign files
        raise BadSample(f"{path}: unreadable safetensors file ({type(e).__name__}: {e}); delete it to recapture") from e
    return decode_sample(tensors)


def verify_sample_file(
    path: str | os.PathLike,
    expected_token_ids: torch.Tensor | Sequence[int],
    *,
    num_states: int,
    hidden_size: int | None = None,
) -> None:
    """Raise BadSample naming `path` unless the stored sample is readable and matches the input (values read)."""
    check_sample(read_sample(path), expected_token_ids, num_states=num_states, hidden_size=hidden_size, where=str(path))


def read_header(path: Path) -> tuple[dict, int]:
    """The safetensors header and its length in bytes (with the 8-byte size field); ValueError if not one."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", raw)
        if size > MAX_HEADER_BYTES or size > os.fstat(f.fileno()).st_size - 8:
            raise ValueError(f"header length field says {size} bytes, more than the file holds")
        header = json.loads(f.read(size))
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    return header, 8 + size


def flat_rows(hidden_states: torch.Tensor) -> tuple[int, int] | None:
    """The first (row, slot) whose values are all zero or all equal, or None."""
    states = hidden_states.float()
    constant = states.amax(dim=-1) == states.amin(dim=-1)  # [seq, slots]; all zero is constant too
    if not constant.any():
        return None
    row, slot = (int(v) for v in constant.nonzero()[0])
    return row, slot


# What a sample file that fails the flat-row test in stage 04 needs: stage 02 recaptures the files it lacks.
RECAPTURE_SAMPLE = ("delete that file and rerun stage 02 (it captures only the samples it lacks, with the same "
                    "settings), then rerun stage 04")


def flat_row_problem(hidden_states: torch.Tensor) -> str | None:
    """'slot S is all zero at token T' (or constant) for the first flat row of a [seq, slots, H] sample, or None.
    The test every sample stage 04 trains on gets (check_sample_file, patches/speculators_sample_check.py): a
    comparison per row, where eagle_pipeline/state_meaning.py's lm_head test runs on a spread of samples only."""
    flat = flat_rows(hidden_states)
    if flat is None:
        return None
    row, slot = flat
    what = "all zero" if not hidden_states[row, slot].float().any() else "constant"
    final = " (the final layer)" if slot == hidden_states.shape[1] - 1 else ""
    return f"slot {slot}{final} of its {hidden_states.shape[1]} is {what} at token {row}"


def check_sample_file(path: Path, input_ids: Sequence[int], num_states: int, hidden_size: int, values: bool) -> None:
    """BadInput unless the file is whole (header, size), shaped [seq, num_states, H] and holds the row's ids.

    Only the token ids are read unless `values`: the hidden states are the bulk of the file.
    """
    import torch
    from safetensors import safe_open

    if not path.exists():
        raise BadInput(f"{path}: hidden-state file missing for its dataset row; rerun stage 02 to capture it")
    try:
        header, offset = read_header(path)
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    except OSError as e:
        raise BadInput(f"{path}: cannot be read ({e.strerror}); fix its "
                       "permissions, or delete it and rerun stage 02") from None
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise BadInput(f"{path}: not a readable safetensors file ({e}); delete it and rerun stage 02") from None
    if path.stat().st_size != offset + end:
        raise BadInput(f"{path}: truncated ({path.stat().st_size} of "
                       f"{offset + end} bytes); delete it and rerun stage 02")
    shape = header.get("hidden_states", {}).get("shape")
    if shape != [len(input_ids), num_states, hidden_size]:
        raise BadInput(f"{path}: hidden_states shape {shape}, expected {[len(input_ids), num_states, hidden_size]}: "
                       f"dataset and hidden-state files are out of step; rerun stage 02")
    with safe_open(str(path), framework="pt") as f:  # token ids only: a few KB, not the hidden states
        token_ids = f.get_tensor("token_ids")
        hidden = f.get_tensor("hidden_states") if values else None
    if token_ids.tolist() != list(input_ids):
        raise BadInput(f"{path}: token ids differ from its dataset row: dataset "
                       "and hidden-state files are out of step; rerun stage 02")
    if hidden is not None and not torch.isfinite(hidden.float()).all():
        raise BadInput(f"{path}: hidden states contain NaN or infinite values; delete the file and rerun stage 02")
    if hidden is not None:
        problem = flat_row_problem(hidden)
        if problem:
            raise BadInput(f"{path}: {problem}: a real layer's states never are, so the file does not hold what "
                           f"the target computed; {RECAPTURE_SAMPLE}")


def sample_matches(path: Path, input_ids: Sequence[int], num_states: int, hidden_size: int) -> bool:
    """Cheap resume check: a whole file of the right shape whose token ids equal the row's."""
    try:
        check_sample_file(path, input_ids, num_states, hidden_size, values=False)
    except BadInput:
        return False
    return True


@dataclass(frozen=True)
class SampleLayout:
    """The shape of a run's samples, as stage 02 resolved it from the config and the target.

    Stored as the `resolved` block of stage 02's manifest; stages 04-06 read it from there (through
    eagle_pipeline.stage.require_sample_layout) instead of deriving it again.
    """

    layer_ids: tuple[int, ...]  # aux ids, HF hidden_states indices (eagle_pipeline.layer_ids)
    num_layers: int  # the target's decoder layers; its final layer fills the last slot
    hidden_size: int
    target_vocab_size: int
    storage_dtype: StorageDtype

    @property
    def num_hidden_states(self) -> int:
        return len(self.layer_ids) + 1

    def to_json(self) -> dict[str, Any]:
        return {"layer_ids": list(self.layer_ids), "num_layers": self.num_layers,
                "num_hidden_states": self.num_hidden_states,
                "hidden_size": self.hidden_size, "target_vocab_size": self.target_vocab_size,
                "storage_dtype": self.storage_dtype.value}

    @classmethod
    def from_json(cls, block: dict[str, Any], where: str) -> "SampleLayout":
        try:
            return cls(layer_ids=tuple(int(k) for k in block["layer_ids"]), num_layers=int(block["num_layers"]),
                       hidden_size=int(block["hidden_size"]), target_vocab_size=int(block["target_vocab_size"]),
                       storage_dtype=StorageDtype(block["storage_dtype"]))
        except (KeyError, TypeError, ValueError) as e:
            raise BadInput(f"{where}: its `resolved` block is incomplete ({type(e).__name__}: {e}); "
                           f"rerun stage 02 with --force") from None


def planned_sample_layout(cfg, num_layers: int, hidden_size: int, vocab_size: int) -> SampleLayout:
    """The sample layout stage 02 makes for this config and target (its `resolved` block, before it exists)."""
    layer_ids = resolve_layer_ids(cfg.hidden_states.layer_ids, num_layers)
    return SampleLayout(layer_ids=tuple(layer_ids), num_layers=num_layers, hidden_size=hidden_size,
                        target_vocab_size=vocab_size, storage_dtype=cfg.hidden_states.storage_dtype)
