"""Atomic file writes: write to a temporary name in the same folder, fsync, then rename.

A reader (or a rerun after a crash) sees either the old file or the complete new one, never a torn one.
Temporary names start with ".tmp-" so that a rerun can sweep leftovers. The temporaries are created with
`os.open` / `os.mkdir` rather than `tempfile`, whose private 0600 / 0700 modes would be renamed into place: files
get the umask's modes (docs/contracts.md, "Run folder layout").
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
from pathlib import Path
from typing import Any, Callable, Iterator

TMP_PREFIX = ".tmp-"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _new_temporary(final: Path, make: Callable[[Path], None]) -> Path:
    """A fresh temporary name beside `final`, created by `make` (which must fail if the name exists)."""
    for _ in range(100):
        tmp = final.with_name(f"{TMP_PREFIX}{final.name}.{secrets.token_hex(4)}")
        try:
            make(tmp)
        except FileExistsError:
            continue
        return tmp
    raise FileExistsError(f"no free temporary name beside {final}")


def _create_file(path: Path) -> None:
    # 0o666 less the umask, as open() gives a new file.
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666))


@contextlib.contextmanager
def atomic_path(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path beside `final`; on success rename it over `final`, on error delete it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_temporary(final, _create_file)
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
    tmp = _new_temporary(final, lambda path: os.mkdir(path, 0o777))  # 0o777 less the umask, as mkdir gives
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


def nearest_existing(path: str | os.PathLike) -> Path:
    """`path` itself, or the nearest folder above it that exists: where a write to `path` would first land."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
