"""Prompt sources for generation: a JSONL file, or a local `datasets` folder (records and their topics:
docs/formats.md, "Prompts and their topics"). Every problem is refused with the file and the line (or record) it
is on, before any engine starts (what is refused: docs/contracts.md, "What is refused as bad input"); a named pipe
or a device is never opened, since reading one could block or never end.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import unicodedata
from pathlib import Path

from eagle_pipeline.errors import BadInput
from eagle_pipeline.fingerprint import value_fingerprint

# Far above any real prompt file (ShareGPT-style dumps of a million conversations are a few GB) and below
# what would exhaust a host's memory when read.
MAX_PROMPT_FILE_BYTES = 8 << 30
MAX_LINE_BYTES = 1 << 20  # a prompt of 1 MiB is ~250k tokens, beyond any verifier.max_model_len
FILE_SUFFIXES = (".jsonl", ".json")
_FILE_KINDS = ((stat.S_ISFIFO, "a named pipe"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
               (stat.S_ISSOCK, "a socket"))


def _size(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def _decode_line(path: Path, lineno: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
    except UnicodeDecodeError as e:
        raise BadInput(f"{path}:{lineno}: byte 0x{raw[e.start]:02x} is not UTF-8; save the file as UTF-8") from None


def _parse_line(path: Path, lineno: int, text: str) -> object:
    where = f"{path}:{lineno}"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadInput(f"{where}: not valid JSON ({e.msg}); fix or remove the line") from None
    except RecursionError:
        raise BadInput(f"{where}: JSON nested too deeply to read; flatten or remove the line") from None
    try:  # JSON may spell half of a surrogate pair ("\ud800"), which no tokenizer or file can take
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadInput(f"{where}: holds a lone surrogate (U+{ord(e.object[e.start]):04X}, an escape without its pair), "
                       f"which is not valid Unicode; fix or remove the line") from None
    return row


def _jsonl_rows(path: Path) -> list[tuple[str, object]]:
    """(where, row) for each non-blank line of a JSONL file; `where` is `path:line`. Lines end at a line feed only
    (not at the other line breaks Unicode knows, which a JSON string may hold); each is read with a bounded
    readline, so a file without line breaks is refused after MAX_LINE_BYTES instead of read whole."""
    rows = []
    try:
        with open(path, "rb") as f:
            lineno = 0
            while raw := f.readline(MAX_LINE_BYTES + 2):
                lineno += 1
                content = raw.rstrip(b"\r\n") if raw.endswith(b"\n") else raw
                if len(content) > MAX_LINE_BYTES:
                    raise BadInput(f"{path}:{lineno}: line longer than {_size(MAX_LINE_BYTES)} "
                                   "(the limit for one prompt); shorten or remove it")
                text = _decode_line(path, lineno, content)
                if text.strip():
                    rows.append((f"{path}:{lineno}", _parse_line(path, lineno, text)))
    except OSError as e:
        raise BadInput(f"{path}: cannot read the prompts ({e.strerror}); check the path and its permissions") from None
    return rows


def _check_file_kind(path: Path, config_key: str) -> bool:
    """True for a folder (a saved datasets folder), False for a regular file; BadInput for anything else.
    Uses stat only: nothing is opened."""
    try:
        st = path.stat()
    except OSError as e:
        raise BadInput(f"{config_key}: cannot stat {path} ({e.strerror}); check the path and its permissions") from None
    if stat.S_ISDIR(st.st_mode):
        if path.suffix in FILE_SUFFIXES:
            raise BadInput(f"{config_key}: {path} is a folder, not a JSONL file; point it at the file (or at a saved "
                           f"datasets folder)")
        return True
    for test, kind in _FILE_KINDS:
        if test(st.st_mode):
            raise BadInput(f"{config_key}: {path} is {kind}, not a regular file; point it at a JSONL file or a saved "
                           f"datasets folder (copy the data into a file first)")
    if st.st_size > MAX_PROMPT_FILE_BYTES:
        raise BadInput(f"{config_key}: {path} is {_size(st.st_size)}, above the {_size(MAX_PROMPT_FILE_BYTES)} "
                       "a prompt file may hold; split it, or save it as a datasets folder")
    return False


def _messages_problem(messages: object) -> str | None:
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects"
    for k, message in enumerate(messages):
        if not isinstance(message, dict) or not {"role", "content"} <= set(message):
            return f"messages[{k}] must be an object with 'role' and 'content', got {json.dumps(message)[:60]}"
        if not isinstance(message["role"], str) or not isinstance(message["content"], str):
            return f"messages[{k}]: 'role' and 'content' must be strings"
    if messages[-1]["role"] != "user":
        return "'messages' must end with a user turn"
    return None


TOPIC_FIELD = "topic"


def _why_missing(path: Path) -> str:
    """Why `path`, which Path.exists() calls missing, cannot be read: exists() says False for a symlink loop too."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "is a symbolic link loop (following its links leads back to them)"
        if path.is_symlink():
            return f"is a symbolic link to {os.readlink(path)}, which does not exist"
    return "does not exist"


def read_prompts(path: Path, field: str, config_key: str) -> list[tuple[str, dict]]:
    """(where, prompt) for each prompt of a file or folder: `where` is `path:line` (or `path record n`), a
    prompt is {"id": str, "topic": str, "messages": [...]}; each record gives `field` (a string) or `messages`."""
    if not path.exists():
        raise BadInput(f"{config_key}: {path} {_why_missing(path)}; point "
                       "it at a JSONL file or a saved datasets folder")
    if _check_file_kind(path, config_key):
        from datasets import load_from_disk

        try:
            rows = [(f"{path} record {i + 1}", row) for i, row in enumerate(load_from_disk(str(path)))]
        except Exception as e:  # noqa: BLE001
            raise BadInput(f"{config_key}: {path} is not a saved datasets folder "
                           f"({e}); save it with Dataset.save_to_disk") from None
    else:
        rows = _jsonl_rows(path)
    prompts = []
    first_seen: dict[str, str] = {}
    for i, (where, row) in enumerate(rows):
        if not isinstance(row, dict):
            raise BadInput(f"{where}: expected a JSON object with {field!r} or "
                           f"'messages', got {type(row).__name__}; fix or remove the line")
        if "messages" in row:
            messages = row["messages"]
            problem = _messages_problem(messages)
            if problem:
                raise BadInput(f"{where}: {problem}")
        elif isinstance(row.get(field), str) and row[field].strip():
            messages = [{"role": "user", "content": row[field]}]
        else:
            raise BadInput(f"{where}: no non-empty {field!r} string and no "
                           "'messages'; set data.prompt_field to the right column")
        prompt_id = str(row.get("id", i))
        if prompt_id in first_seen:
            raise BadInput(f"{where}: id {prompt_id!r} was already used at "
                           f"{first_seen[prompt_id]}; give every prompt a unique id")
        first_seen[prompt_id] = where
        topic = row.get(TOPIC_FIELD)
        if topic is not None and not (isinstance(topic, str) and topic.strip()):
            raise BadInput(f"{where}: {TOPIC_FIELD!r} must be a non-empty "
                           f"string, got {topic!r:.60}; fix it or remove the key")
        prompts.append((where, {"id": prompt_id, "topic": topic.strip() if topic else prompt_id, "messages": messages}))
    if not prompts:
        raise BadInput(f"{config_key}: {path} holds no prompts; add at least one")
    return prompts


def load_prompts(path: Path, field: str, config_key: str) -> list[dict]:
    """[{"id": str, "topic": str, "messages": [...]}] of a prompt file or folder (`read_prompts`)."""
    return [prompt for _, prompt in read_prompts(path, field, config_key)]


def match_key(text: str) -> str:
    """A prompt's text as compared with the held-out prompts: case folded, whitespace collapsed, punctuation
    at either end stripped ("  What is  RUST? " and "what is rust" match)."""
    text = " ".join(text.casefold().split())
    start, end = 0, len(text)
    while start < end and (text[start].isspace() or unicodedata.category(text[start]).startswith("P")):
        start += 1
    while end > start and (text[end - 1].isspace() or unicodedata.category(text[end - 1]).startswith("P")):
        end -= 1
    return text[start:end]


def _asked(prompt: dict) -> str:
    """The turn a prompt's answer answers: its last user turn."""
    return prompt["messages"][-1]["content"]


def load_training_and_eval_prompts(train_path: Path, eval_path: Path, field: str) -> tuple[list[dict], list[dict]]:
    """Both prompt sets, checked up front: held-out prompts must exist, must not be the training set, and no
    training prompt may ask what a held-out one asks (`match_key` of the last user turn)."""
    train = read_prompts(train_path, field, "data.prompts")
    held_out = read_prompts(eval_path, field, "data.eval_prompts")
    same_file = train_path.resolve() == eval_path.resolve()
    if same_file or value_fingerprint([p["messages"] for _, p in train]) == value_fingerprint([p["messages"] for _,
                                                                                               p in held_out]):
        how = "is the same file as" if same_file else "holds the same prompts as"
        raise BadInput(f"data.eval_prompts: {eval_path} {how} data.prompts; held-out prompts must never be trained on: "
                       f"point data.eval_prompts at a separate file")
    held_out_keys: dict[str, tuple[str, str]] = {}
    for where, prompt in held_out:
        held_out_keys.setdefault(match_key(_asked(prompt)), (where, prompt["id"]))
    held_out_keys.pop("", None)  # a prompt of punctuation alone matches nothing
    overlap = [(where, prompt["id"], held_out_keys[key]) for where, prompt in train
               if (key := match_key(_asked(prompt))) in held_out_keys]
    if overlap:
        where, prompt_id, (eval_where, eval_id) = overlap[0]
        raise BadInput(f"data.prompts: {len(overlap)} training prompt(s) ask what a held-out prompt of "
                       "data.eval_prompts asks (same text once case, spacing and end punctuation are "
                       f"ignored), the first at {where} (id {prompt_id!r}) = {eval_where} (id {eval_id!r}); "
                       "held-out prompts must never be trained on: remove them from one file")
    return [p for _, p in train], [p for _, p in held_out]
