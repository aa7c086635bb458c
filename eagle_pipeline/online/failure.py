"""A capture server that stays away stops training with one message naming it (docs/online.md, "A capture server
that goes away"). speculators' circuit breaker names neither the server nor what to do: each rank turns it into
CaptureUnavailable naming its endpoint, and writes the message into the run folder so that the stage, which only
sees torch.distributed.run's exit code on GPUs, can say it too."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

from eagle_pipeline import atomic
from eagle_pipeline.config.base import redact_url
from eagle_pipeline.online.settings import OnlineTraining

FAILURE_FILE = "capture_failed.txt"
# What speculators' BatchRecoveryCoordinator.synchronize raises when the samples' retries are spent
# (speculators/train/recovery.py); tests/test_online.py checks that it still says so.
CIRCUIT_BREAKER = "circuit breaker tripped"


class CaptureUnavailable(RuntimeError):
    """Training stopped because a capture server did not deliver hidden states."""


@contextlib.contextmanager
def online_rank(online: OnlineTraining | None, out_dir: Path, rank: int) -> Iterator[None]:
    """Around one rank's online training (a no-op offline): speculators' circuit breaker becomes
    CaptureUnavailable naming the endpoint; speculators' Mooncake client gets this host's address, which it reads
    from its environment; the HTTP client logs no line per capture request."""
    if online is None:
        yield
        return
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if online.mooncake and online.mooncake.get("local_hostname"):
        os.environ["MOONCAKE_LOCAL_HOSTNAME"] = online.mooncake["local_hostname"]
    (Path(out_dir) / FAILURE_FILE).unlink(missing_ok=True)
    try:
        yield
    except RuntimeError as error:
        if CIRCUIT_BREAKER not in str(error):
            raise
        detail = str(error).strip()
        last = detail.splitlines()[-1] if detail else ""
        message = (f"capture server {redact_url(online.endpoint_for(rank))} delivered no hidden states for a sample "
                   f"within its retries (hidden_states.capture_retry_s {online.retry_s:g} s): {last[:400]}; start it "
                   f"again (or fix hidden_states.capture_endpoints) and rerun stage 04: it resumes from the last "
                   f"complete checkpoint")
        with contextlib.suppress(OSError):
            atomic.write_text(Path(out_dir) / FAILURE_FILE, message + "\n")
        raise CaptureUnavailable(message) from error


def capture_failure(out_dir: Path) -> str | None:
    """The message a rank left when a capture server stopped its training, or None."""
    path = Path(out_dir) / FAILURE_FILE
    return path.read_text().strip() if path.is_file() else None
