"""Model-folder fingerprints depend on bytes only (a copy or a `touch` keeps them, other bytes change them) and
hash each weight file once per file identity; atomically written files and folders get the umask's modes."""

from __future__ import annotations

import json
import os
import shutil
import stat
from unittest import mock

import pytest

from eagle_pipeline import atomic, fingerprint
from eagle_pipeline.fingerprint import cached_file_fingerprints, model_dir_fingerprint


@pytest.fixture
def model(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (folder / "model-00001-of-00002.safetensors").write_bytes(b"a" * 4096)
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"b" * 4096)
    return folder


def hashes_read(call):
    """How many files `call()` hashed in full (the cache answered the others)."""
    with mock.patch.object(fingerprint, "file_fingerprint", wraps=fingerprint.file_fingerprint) as hashed:
        result = call()
    weights = [c for c in hashed.call_args_list if str(c.args[0]).endswith(".safetensors")]
    return result, len(weights)


def test_a_copy_or_a_touch_keeps_the_fingerprint_and_other_bytes_change_it(model, tmp_path):
    cache = tmp_path / "hashes.json"
    first = model_dir_fingerprint(model, cache)
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)  # new inodes, new modification times
    assert model_dir_fingerprint(copy, cache) == first
    for weight in model.glob("*.safetensors"):
        os.utime(weight, ns=(weight.stat().st_atime_ns, weight.stat().st_mtime_ns + 10**9))
    assert model_dir_fingerprint(model, cache) == first

    # The same size and the old modification time put back: the content still decides.
    weight = model / "model-00002-of-00002.safetensors"
    old = weight.stat()
    weight.write_bytes(b"c" * 4096)
    os.utime(weight, ns=(old.st_atime_ns, old.st_mtime_ns))
    assert model_dir_fingerprint(model, cache) != first
    (copy / "config.json").write_text(json.dumps({"hidden_size": 9}))
    assert model_dir_fingerprint(copy, cache) != first


def test_weights_are_hashed_once_per_file_identity(model, tmp_path):
    cache = tmp_path / "hashes.json"
    first, read = hashes_read(lambda: model_dir_fingerprint(model, cache))
    assert read == 2
    again, read = hashes_read(lambda: model_dir_fingerprint(model, cache))
    assert again == first and read == 0
    os.utime(model / "model-00001-of-00002.safetensors")  # touch: hashed once more, same bytes
    touched, read = hashes_read(lambda: model_dir_fingerprint(model, cache))
    assert touched == first and read == 1
    _, read = hashes_read(lambda: model_dir_fingerprint(model, cache))
    assert read == 0


def test_a_damaged_or_unwritable_cache_only_costs_hashing_again(model, tmp_path):
    cache = tmp_path / "hashes.json"
    cache.write_text("{torn")
    first, read = hashes_read(lambda: model_dir_fingerprint(model, cache))
    assert read == 2 and json.loads(cache.read_text())  # rewritten whole
    unwritable = tmp_path / "afile" / "hashes.json"
    (tmp_path / "afile").write_text("a file where a folder should be")
    assert model_dir_fingerprint(model, unwritable) == first


def test_cache_entries_of_removed_files_are_dropped(model, tmp_path):
    cache = tmp_path / "hashes.json"
    other = tmp_path / "other.bin"
    other.write_bytes(b"x")
    cached_file_fingerprints([other], cache)
    other.unlink()
    model_dir_fingerprint(model, cache)
    assert sorted(json.loads(cache.read_text())) == sorted(str(p.resolve()) for p in model.glob("*.safetensors"))


@pytest.fixture
def umask():
    previous = os.umask(0o022)
    yield lambda mask: os.umask(mask)
    os.umask(previous)


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_atomic_files_and_folders_honour_the_umask(tmp_path, umask):
    atomic.write_text(tmp_path / "a.txt", "hello")
    assert mode(tmp_path / "a.txt") == 0o644
    atomic.write_with(tmp_path / "b.bin", lambda tmp: tmp.write_bytes(b"x"))
    assert mode(tmp_path / "b.bin") == 0o644
    with atomic.atomic_dir(tmp_path / "folder") as tmp:
        (tmp / "inside.txt").write_text("x")
    assert mode(tmp_path / "folder") == 0o755 and mode(tmp_path / "folder" / "inside.txt") == 0o644
    umask(0o077)
    atomic.write_text(tmp_path / "private.txt", "secret")
    assert mode(tmp_path / "private.txt") == 0o600
    assert not list(tmp_path.glob(atomic.TMP_PREFIX + "*"))
