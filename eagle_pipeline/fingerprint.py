"""Content fingerprints of the inputs that shape an artifact (files, folders, values)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any


def file_fingerprint(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def value_fingerprint(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def text_fingerprint(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def model_dir_fingerprint(path: str | Path) -> str:
    """Fingerprint of a model directory from its config and weight index, not the weight bytes.

    Hashing hundreds of GB of weights on every stage start is too slow; config.json plus the size
    and modification time of each weight file identifies a checkpoint well enough to detect a swap.
    """
    path = Path(path)
    parts: dict[str, Any] = {}
    for name in ("config.json", "generation_config.json", "model.safetensors.index.json"):
        if (path / name).exists():
            parts[name] = file_fingerprint(path / name)
    for weight in sorted(list(path.glob("*.safetensors")) + list(path.glob("*.bin"))):
        stat = weight.stat()
        parts[weight.name] = [stat.st_size, int(stat.st_mtime)]
    return value_fingerprint(parts)
