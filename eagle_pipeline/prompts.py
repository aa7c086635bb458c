"""Prompt sources for generation: a JSONL file, or a local `datasets` folder."""

from __future__ import annotations

import json
from pathlib import Path

from eagle_pipeline.errors import BadInput


def load_prompts(path: Path, field: str, config_key: str) -> list[dict]:
    """Return [{"id": str, "messages": [...]}]; each record gives `field` (a string) or `messages`."""
    if not path.exists():
        raise BadInput(f"{config_key}: {path} does not exist; point it at a JSONL file or a saved datasets folder")
    if path.is_dir():
        from datasets import load_from_disk

        try:
            rows = list(load_from_disk(str(path)))
        except Exception as e:  # noqa: BLE001
            raise BadInput(f"{config_key}: {path} is not a saved datasets folder ({e}); save it with Dataset.save_to_disk") from None
    else:
        rows = []
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise BadInput(f"{path}:{lineno}: not valid JSON ({e.msg}); fix or remove the line") from None
    prompts = []
    for i, row in enumerate(rows):
        where = f"{path} record {i + 1}"
        if not isinstance(row, dict):
            raise BadInput(f"{where}: expected an object with {field!r} or 'messages'")
        if "messages" in row:
            messages = row["messages"]
            if not isinstance(messages, list) or not messages or messages[-1].get("role") != "user":
                raise BadInput(f"{where}: 'messages' must be a non-empty list ending with a user turn")
        elif isinstance(row.get(field), str) and row[field].strip():
            messages = [{"role": "user", "content": row[field]}]
        else:
            raise BadInput(f"{where}: no non-empty {field!r} string and no 'messages'; set data.prompt_field to the right column")
        prompts.append({"id": str(row.get("id", i)), "messages": messages})
    if not prompts:
        raise BadInput(f"{config_key}: {path} holds no prompts; add at least one")
    ids = [p["id"] for p in prompts]
    if len(set(ids)) != len(ids):
        raise BadInput(f"{config_key}: {path} has duplicate ids; give every prompt a unique id")
    return prompts
