"""The names the installed vLLM accepts (engine arguments, attention backends, KV-cache dtypes), which every config
load checks: read from vLLM's source files, not imported, since importing vLLM takes seconds and writes platform
notices to stderr, which every config load (dry runs included) would pay for."""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import importlib.util
import re
from pathlib import Path


@functools.lru_cache(maxsize=1)
def vllm_engine_arg_names() -> frozenset[str] | None:
    """The field names of vllm.engine.arg_utils.EngineArgs, or None where vLLM is not installed.

    Read from the module's source rather than by importing it: importing vLLM takes seconds and writes
    platform notices to stderr, which every config load (dry runs included) would pay for.
    """
    if importlib.util.find_spec("vllm") is None:
        return None
    source = _vllm_source("engine/arg_utils.py")
    try:
        tree = ast.parse(source) if source is not None else None
    except SyntaxError:
        tree = None
    for node in tree.body if tree else ():
        if isinstance(node, ast.ClassDef) and node.name == "EngineArgs" and not node.bases:
            return frozenset(
                stmt.target.id for stmt in node.body
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and "ClassVar" not in ast.unparse(stmt.annotation)
                and not (stmt.value is not None and "init=False" in ast.unparse(stmt.value).replace(" ", ""))
            )
    # A layout this reader does not know (the class moved or inherits fields): ask the dataclass itself.
    from vllm.engine.arg_utils import EngineArgs

    return frozenset(f.name for f in dataclasses.fields(EngineArgs) if f.init)


def _vllm_source(relative: str) -> str | None:
    """One of vLLM's source files as text, None where vLLM is not installed. Read, not imported: importing
    vLLM takes seconds, which every config load (dry runs included) would pay for."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        return (Path(next(iter(spec.submodule_search_locations))) / relative).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


@functools.lru_cache(maxsize=1)
def vllm_attention_backends() -> frozenset[str] | None:
    """The members of vLLM's AttentionBackendEnum (v1/attention/backends/registry.py)."""
    text = _vllm_source("v1/attention/backends/registry.py")
    body = re.search(r"^class AttentionBackendEnum\b.*?(?=^class |\Z)", text or "", flags=re.MULTILINE | re.DOTALL)
    if body is None:
        return None
    return frozenset(re.findall(r"^    ([A-Z][A-Z0-9_]*) = ", body.group(0), flags=re.MULTILINE)) or None


@functools.lru_cache(maxsize=1)
def vllm_cache_dtypes() -> frozenset[str] | None:
    """The values of vLLM's CacheDType (config/cache.py)."""
    block = re.search(r"^CacheDType = Literal\[(.*?)\]", _vllm_source("config/cache.py") or "",
                      flags=re.MULTILINE | re.DOTALL)
    return frozenset(re.findall(r'"([^"]+)"', block.group(1))) or None if block else None


def _check_name(value: str, known: frozenset[str] | None, what: str) -> str:
    if known is not None and value not in known:
        close = difflib.get_close_matches(value, sorted(known), n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"one of {', '.join(sorted(known))}"
        raise ValueError(f"{value!r} is not {what}; {hint}")
    return value


def check_attention_backend(name: str | None) -> str | None:
    return None if name is None else _check_name(name, vllm_attention_backends(), "a vLLM attention backend")


def check_kv_cache_dtype(dtype: str) -> str:
    return _check_name(dtype, vllm_cache_dtypes(), "a vLLM KV-cache dtype")
