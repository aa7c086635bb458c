"""Each capture server checked before training starts, as docs/online.md says (stage 04's step 3), with one
`error:` line naming it and what differs."""

from __future__ import annotations

import json
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from eagle_pipeline.config.base import redact_url
from eagle_pipeline.errors import BadInput
from eagle_pipeline.online.servers import parse_label, run_label, served_model_name

KEY = "hidden_states.capture_endpoints"
FIX = ("start it with this run's config "
       "(scripts/remote.sh capture CONFIG, or python -m eagle_pipeline.online.serve_capture)")
# Label fields, with the config key a mismatch points at.
LABEL_FIELDS = {"target": "verifier.path", "layers": "hidden_states.layer_ids", "transfer": "hidden_states.transfer",
                "hidden": "verifier.path", "engine": "verifier.dtype / verifier.engine_args and the engine keys"}


@dataclass(frozen=True)
class ExpectedCapture:
    """What this run needs a capture server to be."""

    served_model: str  # the name speculators' dataset asks for: the verifier's path on the trainer's host
    label: dict[str, str]  # parse_label(capture_label(...)) of this run
    longest_sequence: int  # tokens of the longest sample the server must take (plus the one it samples)

    @classmethod
    def for_run(cls, cfg, verifier, layout, longest_sequence: int) -> "ExpectedCapture":
        return cls(served_model=served_model_name(verifier), label=parse_label(run_label(cfg, verifier, layout)),
                   longest_sequence=longest_sequence)


def check_endpoint(endpoint: str, expected: ExpectedCapture, timeout: float = 10.0) -> dict[str, Any]:
    """Raise BadInput unless the server at `endpoint` (its /v1 base URL) captures what this run trains on; return
    what it said about itself."""
    shown = redact_url(endpoint)  # what error lines and the manifest say: never a password
    try:
        with urllib.request.urlopen(endpoint.rstrip("/") + "/models", timeout=timeout) as response:
            models = json.loads(response.read().decode())["data"]
    except (OSError, ValueError, KeyError, TypeError) as e:  # urllib's URLError is an OSError
        raise BadInput(f"{KEY}: {shown} does not answer as a vLLM server ({type(e).__name__}: {e}); {FIX}, or "
                       f"remove it") from None
    names = [str(card.get("id")) for card in models if isinstance(card, dict)]
    if not names or names[0] != expected.served_model:
        raise BadInput(f"{KEY}: {shown} serves {names[0] if names else 'nothing'!r} first, but the trainer asks for "
                       f"{expected.served_model!r} (speculators requests the verifier's path); start it with "
                       f"--served-model-name {expected.served_model} first, or {FIX}")
    labels = [parsed for parsed in map(parse_label, names) if parsed is not None]
    if not labels:
        raise BadInput(f"{KEY}: {shown} has no capture label among its served names {names[1:]}: it was not started "
                       f"as a capture server of this pipeline; {FIX}")
    label = labels[0]
    for field, key in LABEL_FIELDS.items():
        if label.get(field) != expected.label[field]:
            raise BadInput(f"{KEY}: {shown} captures {field} {label.get(field)!r} but this run needs "
                           f"{expected.label[field]!r} ({key}); {FIX}")
    context = models[0].get("max_model_len")
    if isinstance(context, int) and context <= expected.longest_sequence:
        raise BadInput(f"{KEY}: {shown} takes sequences of up to {context - 1} tokens but this run's longest has "
                       f"{expected.longest_sequence} (hidden_states.max_seq_len); {FIX}")
    return {"endpoint": shown, "served": names[0], "label": label, "max_model_len": context}


def probe_endpoint(client, input_ids: list[int], *, num_states: int, hidden_size: int,
                   transfer: str) -> tuple[float, dict[str, Any]]:
    """Capture one sample through `client` (a CaptureClient of the run's transfer) and check what arrives; return
    the seconds the round trip took and the server's transfer parameters."""
    started = time.monotonic()
    try:
        sample, params = client.capture(input_ids)
    except Exception as e:  # noqa: BLE001 - any failure of the round trip is this server's to name
        raise BadInput(f"{KEY}: {redact_url(client.endpoint)} did not deliver a sample through transfer {transfer} "
                       f"({type(e).__name__}: {e}); check that the trainer reaches what the server writes to "
                       f"(a shared folder, or the Mooncake master), or {FIX}") from None
    by_manifest = isinstance(params, dict) and "tensors" in params and "version" in params
    if by_manifest != (transfer == "mooncake"):
        answered = "a Mooncake manifest" if by_manifest else "a file path"
        raise BadInput(f"{KEY}: {redact_url(client.endpoint)} answered with {answered}, "
                       f"but this run's transfer is {transfer}; {FIX}")
    shape = tuple(sample["hidden_states"].shape)
    if shape != (len(input_ids), num_states, hidden_size):
        raise BadInput(f"{KEY}: {redact_url(client.endpoint)} captured states of shape {list(shape)}, expected "
                       f"[{len(input_ids)}, {num_states}, {hidden_size}] (aux ids + final layer); {FIX}")
    return time.monotonic() - started, params
