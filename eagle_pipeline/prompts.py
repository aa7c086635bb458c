"""Prompt sources for generation: a JSONL file, or a local `datasets` folder.

A record may name its `topic` (a short string: "chess", "the water cycle"); stage 04 keeps whole topics
out of training to validate on. A record without one is its own topic (its id), so the split is then by
prompt.

Every problem is refused with the file and the line (or record) it is on, before any engine starts.
"""

from __future__ import annotations

import json
from pathlib import Path

from eagle_pipeline.errors import BadInput
from eagle_pipeline.fingerprint import value_fingerprint


def _jsonl_rows(path: Path) -> list[tuple[str, object]]:
    """(where, row) for each non-blank line of a JSONL file; `where` is `path:line`."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise BadInput(f"{path}: cannot read the prompts ({e.strerror}); check the path and its permissions") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise BadInput(f"{path}:{line}: byte 0x{raw[e.start]:02x} is not UTF-8; save the file as UTF-8") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((f"{path}:{lineno}", json.loads(line)))
        except json.JSONDecodeError as e:
            raise BadInput(f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove the line") from None
    return rows


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


def load_prompts(path: Path, field: str, config_key: str) -> list[dict]:
    """Return [{"id": str, "topic": str, "messages": [...]}]; each record gives `field` (a string) or `messages`."""
    if not path.exists():
        raise BadInput(f"{config_key}: {path} does not exist; point it at a JSONL file or a saved datasets folder")
    if path.is_dir():
        from datasets import load_from_disk

        try:
            rows = [(f"{path} record {i + 1}", row) for i, row in enumerate(load_from_disk(str(path)))]
        except Exception as e:  # noqa: BLE001
            raise BadInput(f"{config_key}: {path} is not a saved datasets folder ({e}); save it with Dataset.save_to_disk") from None
    else:
        rows = _jsonl_rows(path)
    prompts = []
    first_seen: dict[str, str] = {}
    for i, (where, row) in enumerate(rows):
        if not isinstance(row, dict):
            raise BadInput(f"{where}: expected a JSON object with {field!r} or 'messages', got {type(row).__name__}; fix or remove the line")
        if "messages" in row:
            messages = row["messages"]
            problem = _messages_problem(messages)
            if problem:
                raise BadInput(f"{where}: {problem}")
        elif isinstance(row.get(field), str) and row[field].strip():
            messages = [{"role": "user", "content": row[field]}]
        else:
            raise BadInput(f"{where}: no non-empty {field!r} string and no 'messages'; set data.prompt_field to the right column")
        prompt_id = str(row.get("id", i))
        if prompt_id in first_seen:
            raise BadInput(f"{where}: id {prompt_id!r} was already used at {first_seen[prompt_id]}; give every prompt a unique id")
        first_seen[prompt_id] = where
        topic = row.get(TOPIC_FIELD)
        if topic is not None and not (isinstance(topic, str) and topic.strip()):
            raise BadInput(f"{where}: {TOPIC_FIELD!r} must be a non-empty string, got {topic!r:.60}; fix it or remove the key")
        prompts.append({"id": prompt_id, "topic": topic.strip() if topic else prompt_id, "messages": messages})
    if not prompts:
        raise BadInput(f"{config_key}: {path} holds no prompts; add at least one")
    return prompts


def load_training_and_eval_prompts(train_path: Path, eval_path: Path, field: str) -> tuple[list[dict], list[dict]]:
    """Both prompt sets, checked up front: held-out prompts must exist and must not be the training set."""
    train = load_prompts(train_path, field, "data.prompts")
    held_out = load_prompts(eval_path, field, "data.eval_prompts")
    same_file = train_path.resolve() == eval_path.resolve()
    if same_file or value_fingerprint([p["messages"] for p in train]) == value_fingerprint([p["messages"] for p in held_out]):
        how = "is the same file as" if same_file else "holds the same prompts as"
        raise BadInput(f"data.eval_prompts: {eval_path} {how} data.prompts; held-out prompts must never be trained on: "
                       f"point data.eval_prompts at a separate file")
    return train, held_out
