"""Atomic file writes: write to a temporary name in the same folder, fsync, then rename.

A reader (or a rerun after a crash) sees either the old file or the complete new one, never a torn one.
Temporary names start with ".tmp-" so that a rerun can sweep leftovers.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

TMP_PREFIX = ".tmp-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `final`; on success rename it over `final`, on error delete it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX + final.name + ".", dir=final.parent)
    os.close(fd)
    tmp = Path(tmp)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
        _fsync_dir(final.parent)
    except OSError as e:
        # A failed write() names no file; the stage's "disk full" message should name the one it was writing.
        if e.filename is None:
            e.filename = str(final)
        raise
    finally:
        if tmp.exists():
            tmp.unlink()


def write_bytes(final: str | os.PathLike, data: bytes) -> None:
    with atomic_path(final) as tmp:
        tmp.write_bytes(data)


def write_text(final: str | os.PathLike, text: str) -> None:
    write_bytes(final, text.encode())


def write_json(final: str | os.PathLike, obj: Any) -> None:
    write_text(final, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def write_with(final: str | os.PathLike, writer: Callable[[Path], None]) -> None:
    """Call writer(tmp_path) to produce the file (e.g. safetensors.save_file), then rename it into place."""
    with atomic_path(final) as tmp:
        writer(tmp)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder beside `final`; on success swap it in for `final` (old one removed)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=TMP_PREFIX + final.name + ".", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            trash = final.with_name(TMP_PREFIX + final.name + ".old")
            shutil.rmtree(trash, ignore_errors=True)
            os.replace(final, trash)
            os.replace(tmp, final)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def sweep_temporaries(folder: str | os.PathLike) -> int:
    """Remove leftovers of writes torn by a crash; returns how many were removed."""
    folder = Path(folder)
    removed = 0
    if not folder.exists():
        return 0
    for p in folder.rglob(TMP_PREFIX + "*"):
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)
        removed += 1
    return removed
