"""The one reader of the pipeline's own JSON object files (manifests, reports, model configs).

Every way such a file can be unreadable is a BadInput naming the file and `fix`; callers keep the checks
that differ between file types (a missing manifest means "not run yet", required fields).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle_pipeline.errors import BadInput


def read_json_object(path: str | Path, fix: str, what: str = "") -> dict[str, Any]:
    """The JSON object in `path`; `what` ("manifest", "report") names the file in the error line."""
    subject = f"{what} " if what else ""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise BadInput(f"{path}: {subject}is missing; {fix}") from None
    except OSError as e:
        reading = f"cannot read the {what}" if what else "cannot be read"
        raise BadInput(f"{path}: {reading} ({e.strerror}); fix its permissions or {fix}") from None
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise BadInput(f"{path}: {subject}is not UTF-8 text; {fix}") from None
    except json.JSONDecodeError as e:
        raise BadInput(f"{path}: {subject}is not valid JSON (line {e.lineno}: {e.msg}); {fix}") from None
    if not isinstance(value, dict):
        raise BadInput(f"{path}: {subject}is a JSON {type(value).__name__}, not an object; {fix}")
    return value
