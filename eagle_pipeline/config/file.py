"""Reading a run config file into plain data, before the schema (config.py) types it.

- A key given twice in one mapping is refused (plain YAML keeps the last one silently).
- `extends: other.yaml` (relative to the file) loads another config first and overlays this one on it.
- `--set a.b=value` overrides any key; the value is parsed as YAML.
- Every key remembers the file (or `--set`) that set it last, so that a schema error can name it.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from eagle_pipeline.errors import BadInput

# Where each key of a merged config came from: key path -> the file (or --set) that set it last.
Origins = dict[tuple[str, ...], str]


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first_line: int):
        super().__init__(key)
        self.key, self.line, self.first_line = key, line, first_line


class _Unreadable(Exception):
    """(line, why): a value that would take the loader hours, or end in a traceback; `why` says the fix."""


MAX_VALUES = 100_000  # a config holds hundreds; an alias bomb (anchors repeated inside anchors) billions


def _expanded(node: yaml.Node, sizes: dict[int, int]) -> int:
    """How many values the node holds once every alias in it is expanded (composed YAML shares aliased nodes)."""
    if id(node) not in sizes:
        sizes[id(node)] = MAX_VALUES + 1  # an anchor that holds itself never ends
        inside = node.value if isinstance(node, yaml.SequenceNode) else (
            [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else [])
        sizes[id(node)] = 1 + sum(_expanded(n, sizes) for n in inside)
        if node.tag == "tag:yaml.org,2002:int" and len(node.value) > 100:  # int() refuses 4,300 digits
            raise _Unreadable(node.start_mark.line + 1, f"an integer of {len(node.value)} characters, longer than "
                                                        f"any setting needs; shorten it, or quote it if it is text")
    if sizes[id(node)] > MAX_VALUES:
        raise _Unreadable(node.start_mark.line + 1, f"aliases expand to more than {MAX_VALUES} values here (an "
                                                    f"anchor repeated inside anchors, or inside itself); write "
                                                    f"the values out")
    return sizes[id(node)]


class UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last one silently), and
    (`_expanded`) aliases that expand past MAX_VALUES values and integers no setting needs."""

    def construct_document(self, node):
        _expanded(node, {})
        return super().construct_document(node)

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` may override on purpose
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise _DuplicateKey(key, line, seen[key])
                    seen[key] = line
                except TypeError:  # an unhashable key; SafeLoader reports it itself
                    continue
        return super().construct_mapping(node, deep=deep)


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _parse_yaml(path: Path) -> Any:
    try:
        raw = path.read_bytes()
    except IsADirectoryError:
        raise BadInput(f"{path}: is a folder, not a config file; name a .yaml "
                       "file inside it, e.g. configs/tiny.yaml") from None
    except OSError as e:
        raise BadInput(f"{path}: cannot read the config ({e.strerror}); check the path and its permissions") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise BadInput(f"{path} line {line}: byte 0x{raw[e.start]:02x} is not UTF-8; save the file as UTF-8") from None
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)
    except _DuplicateKey as e:
        raise BadInput(f"{path} line {e.line}: key {e.key!r} appears again (first at line {e.first_line}) and would "
                       f"silently replace the first; merge the two into one") from None
    except _Unreadable as e:
        raise BadInput(f"{path} line {e.args[0]}: {e.args[1]}") from None
    except RecursionError:
        raise BadInput(f"{path}: values nested deeper than the YAML reader's stack allows; flatten them") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark else ""
        raise BadInput(f"{path}{at}: not valid YAML "
                       f"({_one_line(getattr(e, 'problem', None) or e)}); fix the syntax") from None


def _resolve(path: Path, what: str) -> Path:
    try:
        return path.resolve()
    except (RuntimeError, OSError) as e:  # Python 3.11 raises RuntimeError for a symlink loop
        raise BadInput(f"{path}: {what} cannot be resolved ({_one_line(e)}); point it at a real file") from None


def _origins(data: dict, source: str, prefix: tuple[str, ...] = ()) -> Origins:
    found: Origins = {}
    for key, value in data.items():
        found[prefix + (key,)] = source
        if isinstance(value, dict):
            found.update(_origins(value, source, prefix + (key,)))
    return found


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> tuple[dict[str, Any], Origins]:
    if path in chain:
        raise BadInput(f"{path}: 'extends' forms a cycle ({' -> '.join(map(str, chain + (path,)))}); remove one link")
    if len(chain) == 100:  # each link is a frame of this reader's recursion
        raise BadInput(f"{chain[0]}: its 'extends' chain is more than 100 files long; extend the base directly")
    if not path.exists():
        where = f" (extended by {chain[-1]})" if chain else ""
        raise BadInput(f"{path}: config file not found{where}; check the path")
    data = _parse_yaml(path)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise BadInput(f"{path}: a config must be a YAML mapping of keys to values, not a {type(data).__name__}; "
                       f"start from configs/tiny.yaml")
    parent = data.pop("extends", None)
    origins = _origins(data, str(path))
    if parent is None:
        return data, origins
    if not isinstance(parent, str) or not parent.strip():
        raise BadInput(f"{path}: extends: expected one base file name, got {parent!r}; a config extends a single "
                       f"base (the base may extend another)")
    base_path = _resolve(path.parent / parent, "extends")
    if base_path.is_dir():
        raise BadInput(f"{path}: extends: {base_path} is a folder; name a .yaml file")
    base, base_origins = _read_yaml(base_path, chain + (path,))
    return deep_merge(base, data), {**base_origins, **origins}


def deep_merge(base: dict, overlay: dict) -> dict:
    merged = copy.deepcopy(base)
    for key, value in overlay.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def apply_override(data: dict, assignment: str, origins: Origins | None = None) -> None:
    """Apply one `a.b.c=value` override; the value is parsed as YAML (so 3 is an int, [1,2] a list)."""
    if "=" not in assignment:
        raise BadInput(f"--set {assignment!r}: expected dotted.key=value, e.g. --set data.num_samples=10")
    dotted, raw = assignment.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise BadInput(f"--set {assignment!r}: empty key segment; use dotted.key=value")
    try:
        value = yaml.load(raw, Loader=UniqueKeyLoader)
    except (yaml.YAMLError, _DuplicateKey):
        value = raw
    except _Unreadable as e:
        raise BadInput(f"--set {dotted}: {e.args[1]}") from None
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise BadInput(f"--set {dotted}: {key!r} is a value, not a section")
        node = child
    node[keys[-1]] = value
    if origins is not None:
        origins[tuple(keys)] = f"--set {assignment}"


def read_config_file(given: Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[Path, dict[str, Any], Origins]:
    """The file's resolved path, its merged keys (bases and overrides applied) and where each key came from."""
    path = _resolve(given, "--config")
    if path.is_dir():
        raise BadInput(f"{given}: --config names a folder; name a .yaml file, e.g. configs/tiny.yaml")
    data, origins = _read_yaml(path)
    for assignment in overrides:
        apply_override(data, assignment, origins)
    return path, data, origins
