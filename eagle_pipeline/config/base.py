"""What every config section shares: the value bounds, what the operating system passes (one argument, the
environment, a path), the `Section` base that refuses unknown keys, booleans for numbers and NUL bytes, and the
names of vLLM's attention backends and KV-cache dtypes (vllm_names.py)."""

from __future__ import annotations

import json
import os
import types
import typing
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    field_validator,
)
from pydantic_core import PydanticCustomError

from eagle_pipeline.config.vllm_names import check_attention_backend, check_kv_cache_dtype

REPO_ROOT = Path(__file__).resolve().parent.parent.parent

# Upper bounds are far beyond any real run; they exist so that a slipped digit (1e10 epochs, a tensor
# parallel size of 80000) is refused up front instead of failing deep inside an engine or an allocator.
MAX_PARALLEL = 1024
MAX_TOKENS = 1 << 24  # 16M tokens: longer than any model's context; lengths inside a context stay below it
MAX_COUNT = 10**9
MAX_WIDTH = 1 << 20  # hidden / intermediate sizes
MAX_VOCAB = 1 << 24
MAX_SEED = 2**32 - 1  # numpy's limit; torch and vLLM take any of these

# What the OS refuses to carry, checked when the config loads, so that a value no process can be started with is
# not found by the first exec after `--force` has deleted a stage's output. Config values travel as command-line
# arguments (`--set`, the `vllm serve` flags engine_args become, JSON arguments of the engine jobs) and as
# environment entries (`env`); Linux refuses any single one above MAX_ARG_STRLEN (32 pages, with its NUL) with
# E2BIG, and every string with a NUL inside.
MAX_ARG_BYTES = 32 * 4096 - 1
# All of `env` together: a quarter of the usual 2 MiB ARG_MAX, leaving the rest to the inherited environment and
# the command line of the process it is passed to.
MAX_ENV_BYTES = 512 * 1024
# A file name (one path component) and a whole path, as Linux file systems take them (NAME_MAX, PATH_MAX).
MAX_NAME_BYTES = 255
MAX_PATH_BYTES = 4095
# How much of one argument an engine-argument dict may fill: the JSON argument it travels in also holds the
# settings the pipeline adds (target_engine_settings, the drafter's folder).
ARG_HEADROOM_BYTES = 8 * 1024


def os_bytes(text: str) -> int | None:
    """`text`'s size as the OS gets it (file-system encoding), None where it cannot be encoded (a lone surrogate)."""
    try:
        return len(os.fsencode(text))
    except UnicodeEncodeError:
        return None


def argument_problem(text: str, limit: int = MAX_ARG_BYTES) -> str | None:
    """Why `text` cannot be one command-line argument or environment entry, or None."""
    if "\x00" in text:
        return "contains a NUL character, which no command line, environment or file name can carry; remove it"
    size = os_bytes(text)
    if size is None:
        return "holds a character the OS cannot encode (a lone surrogate such as \\ud800); remove it"
    if size > limit:
        room = (f"the {limit} bytes one command-line argument or environment entry may hold" if limit == MAX_ARG_BYTES
                else f"the {limit} bytes left for it in the one command-line argument it travels in")
        return f"is {size} bytes, above {room} (Linux refuses more with E2BIG when a process starts); shorten it"
    return None


def _unpassable_inside(value: Any, where: str = "") -> tuple[str, str] | None:
    """(where, why) for the first string in a value read from YAML (itself, or a name or value of a mapping or list
    inside) that no process can be given, or None: `where` is "" for the value itself, else a path such as "'A'"
    or "'kwargs'[0]"."""
    if isinstance(value, str):
        problem = argument_problem(value)
        return (where, problem) if problem else None
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and argument_problem(key):
                return f"the name {key[:40]!r}", argument_problem(key)
            found = _unpassable_inside(item, f"{where}[{key!r}]" if where else repr(key))
            if found is not None:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _unpassable_inside(item, f"{where}[{index}]")
            if found is not None:
                return found
    return None


def env_problem(env: dict[str, str]) -> str | None:
    """Why the OS would refuse these environment variables (in `env`, or a serve.engine_variants entry's), or None."""
    total = 0
    for name, value in env.items():
        if not name:
            return "a variable with an empty name, which no environment can hold; name it or remove it"
        if "=" in name:
            return f"variable name {name!r} holds '=', which ends a name in the environment; rename it"
        problem = argument_problem(f"{name}={value}")
        if problem:
            return f"{name}: {problem}"
        total += os_bytes(f"{name}={value}") + 1
    if total > MAX_ENV_BYTES:
        return (f"{len(env)} variables of {total} bytes in all, above the {MAX_ENV_BYTES} bytes the run passes on to "
                f"every process it starts (the OS caps environment and command line together); shorten them")
    return None


def json_argument_problem(value: dict[str, Any]) -> str | None:
    """Why this mapping cannot travel as one JSON command-line argument (with room for what the pipeline adds)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        return None  # not JSON at all: the engine's own argument check names it
    return argument_problem(text, MAX_ARG_BYTES - ARG_HEADROOM_BYTES)


def path_problem(path: str) -> str | None:
    """Why the OS would refuse `path` as a file or folder name, or None."""
    size = os_bytes(path)
    if size is not None and size > MAX_PATH_BYTES:
        return f"is {size} bytes long, above the {MAX_PATH_BYTES} a path may have (PATH_MAX); shorten it"
    for part in Path(path).parts:
        size = os_bytes(part)
        if size is not None and size > MAX_NAME_BYTES:
            return (f"has a component of {size} bytes ({part[:24]}...), above the {MAX_NAME_BYTES} a file name may "
                    f"have (NAME_MAX); shorten it")
    return None


def _checked_path(path: str) -> str:
    problem = path_problem(path)
    if problem:
        raise ValueError(problem)
    return path


# A file or folder the run reads or writes: its length is checked against what the file system takes.
PathStr = Annotated[str, AfterValidator(_checked_path)]


def redact_url(url: str) -> str:
    """`url` with the password of its user part replaced by ***: how a URL is printed and recorded (dry runs,
    manifests, a stage folder's config.yaml, error lines)."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
        password = parts.password
    except ValueError:
        return url
    if password is None:
        return url
    userinfo, _, host = parts.netloc.rpartition("@")
    return urlunsplit(parts._replace(netloc=f"{userinfo.split(':', 1)[0]}:***@{host}"))


def cross_field(field: str, message: str) -> PydanticCustomError:
    """A rule that ties fields together; `field` (relative to the model raising it) is the one blamed."""
    return PydanticCustomError("cross_field", "{message}", {"field": field, "message": message})


def _is_section(annotation: Any) -> bool:
    """A config section, or an Optional of one: it checks its own values."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union,
                                                                               types.UnionType) else (annotation,)
    return any(isinstance(a, type) and issubclass(a, BaseModel) for a in options)


def _is_number(annotation: Any) -> bool:
    """int, float, or an Optional of one."""
    if annotation in (int, float):
        return True
    return typing.get_origin(annotation) in (typing.Union,
                                             types.UnionType) and any(a in (int,
                                                                            float) for a in typing.get_args(annotation))


class Section(BaseModel):
    # allow_inf_nan=False: YAML reads .inf and .nan as floats, and neither is a usable setting anywhere.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bools_for_numbers_no_nul(cls, value, info):
        # pydantic reads true as 1; `seed: true` or `epochs: yes` is a mistake, not a number.
        if isinstance(value, bool) and _is_number(cls.model_fields[info.field_name].annotation):
            raise ValueError(f"expected a number, got {str(value).lower()}")
        # A NUL byte makes every file-system call and every process start fail with a traceback, and every value
        # must fit one command-line argument (`--set key=value` and the detached runner pass it as one; env and
        # engine_args reach processes as entries and flags): refused inside mappings and lists too.
        found = None if _is_section(cls.model_fields[info.field_name].annotation) else _unpassable_inside(value)
        if found is not None:
            where, problem = found
            raise ValueError(f"{where} {problem}" if where else problem)
        return value


# vLLM's names, checked against the installed vLLM when the config loads (eagle_pipeline/vllm_config.py).
AttentionBackend = Annotated[str, AfterValidator(lambda name: check_attention_backend(name))]
KvCacheDtype = Annotated[str, AfterValidator(lambda dtype: check_kv_cache_dtype(dtype))]


def resolve_path(value: str) -> Path:
    if value.startswith("embedded:"):
        return Path(value)
    path = Path(value).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path
