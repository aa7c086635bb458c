"""A stage folder's manifest (`read_manifest`), the files a finished stage made as it records them, and the check
that they are still whole. What is recorded, who checks it, and how much of a file each check reads (so that it
stays cheap at any scale): docs/contracts.md, "The recorded outputs".
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from eagle_pipeline import atomic
from eagle_pipeline.config import STAGES
from eagle_pipeline.errors import BadInput
from eagle_pipeline.json_files import read_json_object
from eagle_pipeline.samples import read_header

HASH_LIMIT = 1 << 20
ENDS = 64 << 10
NOT_RECORDED = ("manifest.json", "config.yaml")
NOT_RECORDED_DIRS = ("logs",)
CHECKS = ("sha256", "safetensors", "ends")


def _recorded(stage_dir: Path, path: Path) -> bool:
    rel = path.relative_to(stage_dir)
    if rel.parts[0] in NOT_RECORDED_DIRS or (len(rel.parts) == 1 and rel.name in NOT_RECORDED):
        return False
    return (not any(part.startswith(atomic.TMP_PREFIX) for part in rel.parts)
            and path.is_file() and not path.is_symlink())


def _check_of(path: Path, size: int) -> str:
    if size <= HASH_LIMIT:
        return "sha256"
    return "safetensors" if path.suffix == ".safetensors" else "ends"


def _digest(path: Path, check: str, size: int) -> str | None:
    """The content part of a file's record; raises ValueError when a safetensors header is not whole."""
    if check == "safetensors":
        _check_safetensors_header(path, size)
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        if check == "sha256":
            while block := f.read(1 << 20):
                h.update(block)
        else:
            h.update(f.read(ENDS))
            f.seek(max(size - ENDS, 0))
            h.update(f.read(ENDS))
    return h.hexdigest()


def _check_safetensors_header(path: Path, size: int) -> None:
    try:
        header, offset = read_header(path)
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError) as e:
        raise ValueError(f"not a whole safetensors file ({e})") from None
    if offset + end != size:
        raise ValueError(f"safetensors header describes {offset + end} bytes, the file has {size}")


def record_outputs(stage_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The record of every output file under stage_dir, sorted by path."""
    stage_dir = Path(stage_dir)
    entries = []
    for path in sorted(p for p in stage_dir.rglob("*") if _recorded(stage_dir, p)):
        size = path.stat().st_size
        check = _check_of(path, size)
        entries.append({"path": path.relative_to(stage_dir).as_posix(), "size": size, "check": check,
                        "digest": _digest(path, check, size)})
    return entries


def malformed_record(outputs: Any) -> str | None:
    """What is wrong with a manifest's `outputs` field, or None when it is a list of whole entries."""
    if not isinstance(outputs, list):
        return f"`outputs` is a {type(outputs).__name__}, not a list"
    for i, entry in enumerate(outputs):
        if not (isinstance(entry, dict) and isinstance(entry.get("path"), str) and entry["path"]
                and not Path(entry["path"]).is_absolute() and ".." not in Path(entry["path"]).parts
                and isinstance(entry.get("size"), int) and entry.get("check") in CHECKS
                and (entry.get("digest") is None) == (entry.get("check") == "safetensors")):
            return f"`outputs[{i}]` is not a {{path, size, check, digest}} entry"
    return None


def damaged_outputs(stage_dir: str | os.PathLike, outputs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """(path relative to stage_dir, what is wrong) for every recorded file that is no longer as recorded."""
    stage_dir = Path(stage_dir)
    damaged = []
    for entry in outputs:
        path = stage_dir / entry["path"]
        problem = _problem(path, entry)
        if problem:
            damaged.append((entry["path"], problem))
    return damaged


def _problem(path: Path, entry: dict[str, Any]) -> str | None:
    if not path.exists() and not path.is_symlink():
        return f"missing (recorded {entry['size']} bytes)"
    if not path.is_file():
        return "is not a file"
    size = path.stat().st_size
    if size != entry["size"]:
        return f"{size} bytes, recorded {entry['size']}"
    try:
        digest = _digest(path, entry["check"], size)
    except ValueError as e:
        return str(e)
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if digest != entry["digest"]:
        return "content differs from what was recorded (sha256)"
    return None


def describe(stage_dir: Path, damaged: list[tuple[str, str]]) -> str:
    """One line naming the first damaged file, and how many more there are."""
    rel, problem = damaged[0]
    more = f" (and {len(damaged) - 1} more recorded file(s))" if len(damaged) > 1 else ""
    return f"{stage_dir / rel}: {problem}{more}"


def remove_damaged(stage_dir: Path, damaged: list[tuple[str, str]]) -> None:
    """Delete damaged files so that a stage's resume logic treats them as not yet made."""
    for rel, _ in damaged:
        path = stage_dir / rel
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


MANIFEST_FIELDS = {"status": str, "inputs": dict, "counts": dict}


def read_manifest(stage_dir: Path) -> dict[str, Any] | None:
    """A stage folder's manifest, None when there is none; a damaged one is refused (BadInput) naming the fix."""
    path = Path(stage_dir) / "manifest.json"
    if not path.exists():
        return None
    name = Path(stage_dir).name
    fix = (f"rerun that stage ({name}.py) with --force to rebuild it" if name in STAGES.values()
           else "rerun that stage with --force to rebuild it")
    if path.is_dir():
        raise BadInput(f"{path}: is a folder, not a manifest file; {fix}")
    manifest = read_json_object(path, fix, what="manifest")
    for key, kind in MANIFEST_FIELDS.items():
        if not isinstance(manifest.get(key), kind):
            what = "lacks" if key not in manifest else f"has a {type(manifest[key]).__name__} for"
            raise BadInput(f"{path}: manifest {what} {key!r} (a {kind.__name__}); {fix}")
    if "outputs" in manifest:
        problem = malformed_record(manifest["outputs"])
        if problem:
            raise BadInput(f"{path}: manifest {problem}; {fix}")
    return manifest


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under `folder` (links not followed); 0 when it does not exist."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # removed while walking
                pass
    return total
