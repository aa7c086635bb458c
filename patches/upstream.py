"""The two checks each patch module here makes before it changes a third-party library, so that no patch runs
against code it was not written for (README.md in this folder):

- the installed release is the one the module targets (`require_version`);
- every upstream function it replaces, wraps or relies on still has the source it was written against
  (`require_unchanged_sources`): a fingerprint is the sha256 of `inspect.getsource`, and the modules key
  their fingerprints "module:qualified.name" in a dict named `UPSTREAM_SOURCE_SHA256`.

The tests compare every module's fingerprints with the installed libraries through the same helpers.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from collections.abc import Callable
from typing import Any


def require_version(patch_file: str, library: str, installed: str, target: str, recheck: str) -> None:
    """Raise unless the installed release of `library` is `target`; `recheck` says what to re-check first."""
    if installed != target:
        raise RuntimeError(f"{patch_file} targets {library} {target} but {installed} is installed; {recheck}")


def lookup(qualified: str) -> Any:
    """The object named "module:qualified.name", imported."""
    module_name, _, attr_path = qualified.partition(":")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


def object_source_sha256(obj: Any) -> str:
    """Fingerprint of an object's source (wrappers made with functools.wraps are unwrapped)."""
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()


def source_sha256(qualified: str) -> str:
    """Fingerprint of the upstream function named "module:qualified.name"."""
    return object_source_sha256(lookup(qualified))


def changed_sources(fingerprints: dict[str, str], sha256: Callable[[str], str] = source_sha256) -> list[str]:
    """Names of the fingerprinted upstream functions whose source differs from the one fingerprinted."""
    return [name for name, digest in fingerprints.items() if sha256(name) != digest]


def require_unchanged_sources(fingerprints: dict[str, str], patch_file: str, target: str,
                              sha256: Callable[[str], str] = source_sha256) -> None:
    """Raise unless every fingerprinted function still has its source; `target` names the release
    (e.g. "speculators 0.9.0")."""
    changed = changed_sources(fingerprints, sha256)
    if changed:
        raise RuntimeError(
            f"{patch_file} targets {target}, but these functions differ from that release: "
            f"{', '.join(changed)}; re-check the patches that depend on them"
        )
