"""Content fingerprints of the inputs that shape an artifact (files, folders, values)."""

from __future__ import annotations

import hashlib
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from eagle_pipeline import atomic

log = logging.getLogger("eagle_pipeline")

# Where the content hashes of large files are kept between runs (see cached_file_fingerprint).
HASH_CACHE = Path.home() / ".cache" / "eagle_pipeline" / "file_hashes.json"
# Files of a model folder that say what the model is; hashed whole on every call (they are small).
MODEL_METADATA_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json",
                        "pytorch_model.bin.index.json")
MODEL_WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
# Reading weight files is disk-bound; a few files at once keep an NVMe array busy (sha256 releases the GIL).
HASH_THREADS = 8


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


def _identity(path: Path) -> str:
    """What must stay the same for a cached hash of `path` to hold: the file (device, inode) and its state (why
    ctime: docs/contracts.md, "Fingerprints of model folders")."""
    st = path.stat()
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _read_cache(cache: Path) -> dict[str, dict[str, str]]:
    try:
        data = json.loads(cache.read_text())
    except (OSError, ValueError):  # none yet, unreadable or torn: hashing again is always correct
        return {}
    return data if isinstance(data, dict) else {}


def _write_cache(cache: Path, entries: dict[str, dict[str, str]]) -> None:
    try:
        atomic.write_json(cache, entries)
    except OSError as e:  # a read-only home only costs the next run the same hashing
        log.warning("cannot write the file hash cache %s (%s); the next run hashes these files again", cache,
                    e.strerror)


def cached_file_fingerprints(paths: list[Path], cache: Path | None = None) -> dict[Path, str]:
    """The sha256 of each file's bytes, taken from `cache` (default HASH_CACHE) where the file is still the one
    that was hashed (same path and `_identity`)."""
    cache = HASH_CACHE if cache is None else Path(cache)
    entries = _read_cache(cache)
    found: dict[Path, str] = {}
    todo: list[tuple[Path, str]] = []
    for path in paths:
        key, identity = str(Path(path).resolve()), _identity(Path(path))
        entry = entries.get(key)
        if isinstance(entry, dict) and entry.get("identity") == identity and isinstance(entry.get("sha256"), str):
            found[path] = entry["sha256"]
        else:
            todo.append((path, identity))
    if not todo:
        return found
    size = sum(Path(p).stat().st_size for p, _ in todo)
    if size > 1 << 30:
        log.info("hashing %d file(s), %.1f GB, once: the hashes are kept in %s until a file changes", len(todo),
                 size / 1e9, cache)
    with ThreadPoolExecutor(max_workers=min(HASH_THREADS, len(todo))) as pool:
        hashes = list(pool.map(lambda item: file_fingerprint(item[0], chunk=8 << 20), todo))
    entries = _read_cache(cache)  # another process may have added entries meanwhile
    for (path, identity), digest in zip(todo, hashes):
        found[path] = digest
        entries[str(Path(path).resolve())] = {"identity": identity, "sha256": digest}
    # Entries of files that are gone would otherwise pile up as checkpoints come and go.
    _write_cache(cache, {k: v for k, v in entries.items() if Path(k).is_file()})
    return found


def model_dir_fingerprint(path: str | Path, cache: Path | None = None) -> str:
    """Fingerprint of a model folder's content: its metadata files (config, generation config, weight index)
    and the bytes of every weight file, by name, the weights' hashes cached (`cached_file_fingerprints`). Why
    bytes, and why cached: docs/contracts.md, "Fingerprints of model folders"."""
    path = Path(path)
    parts: dict[str, Any] = {}
    for name in MODEL_METADATA_FILES:
        if (path / name).is_file():
            parts[name] = file_fingerprint(path / name)
    weights = sorted({w for pattern in MODEL_WEIGHT_PATTERNS for w in path.glob(pattern) if w.is_file()})
    for weight, digest in sorted(cached_file_fingerprints(weights, cache).items()):
        parts[weight.name] = digest
    return value_fingerprint(parts)
