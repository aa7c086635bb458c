"""Checks that stage 02's dataset and its hidden-state files are in step before training reads them.

Every file: present, a readable safetensors header, data size equal to what the header promises (a torn
copy is shorter), shape [seq, n_aux+1, H], token ids equal to the dataset row. Values (NaN/inf) are read
in full when the data is small and for a fixed sample of files when it is not: reading 0.8 TB to start a
training run would cost longer than the run's first epoch.
"""

from __future__ import annotations

import json
import random
import struct
from pathlib import Path

from eagle_pipeline.errors import BadInput

FULL_VALUE_CHECK_BYTES = 4 * 10**9
SAMPLED_FILES = 64


def _header(path: Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise ValueError("shorter than a safetensors header")
        (size,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(size))
    return header, 8 + size


def check_sample_file(path: Path, input_ids: list[int], num_states: int, hidden_size: int, values: bool) -> None:
    import torch
    from safetensors import safe_open

    if not path.exists():
        raise BadInput(f"{path}: hidden-state file missing for its dataset row; rerun stage 02 to capture it")
    try:
        header, offset = _header(path)
        end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        raise BadInput(f"{path}: not a readable safetensors file ({e}); delete it and rerun stage 02") from None
    if path.stat().st_size != offset + end:
        raise BadInput(f"{path}: truncated ({path.stat().st_size} of {offset + end} bytes); delete it and rerun stage 02")
    shape = header.get("hidden_states", {}).get("shape")
    if shape != [len(input_ids), num_states, hidden_size]:
        raise BadInput(f"{path}: hidden_states shape {shape}, expected {[len(input_ids), num_states, hidden_size]}: "
                       f"dataset and hidden-state files are out of step; rerun stage 02")
    with safe_open(str(path), framework="pt") as f:  # token ids only: a few KB, not the hidden states
        token_ids = f.get_tensor("token_ids")
        hidden = f.get_tensor("hidden_states") if values else None
    if token_ids.tolist() != list(input_ids):
        raise BadInput(f"{path}: token ids differ from its dataset row: dataset and hidden-state files are out of step; rerun stage 02")
    if hidden is not None and not torch.isfinite(hidden.float()).all():
        raise BadInput(f"{path}: hidden states contain NaN or infinite values; delete the file and rerun stage 02")


def check_training_data(data_dir: Path, num_states: int, hidden_size: int, seed: int = 0) -> int:
    """Check the stage 02 output under data_dir; returns the number of rows."""
    from datasets import load_from_disk

    data = load_from_disk(str(data_dir)).with_format(None)
    hs_dir = data_dir / "hidden_states"
    files = sorted(hs_dir.glob("hs_*.safetensors"))
    if len(files) != len(data):
        raise BadInput(f"{hs_dir}: {len(files)} hidden-state files for {len(data)} dataset rows: "
                       f"dataset and hidden-state files are out of step; rerun stage 02")
    total = sum(f.stat().st_size for f in files)
    full = total <= FULL_VALUE_CHECK_BYTES
    sampled = set(range(len(data))) if full else set(random.Random(seed).sample(range(len(data)), min(SAMPLED_FILES, len(data))))
    from tqdm import tqdm

    for row, ids in enumerate(tqdm(data["input_ids"], desc="check training data", unit="file", leave=False)):
        check_sample_file(hs_dir / f"hs_{row}.safetensors", ids, num_states, hidden_size, values=row in sampled)
    return len(data)
