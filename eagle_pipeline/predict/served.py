"""Stage 06's prediction: the drafter replayed offline on the very answers the no-speculation server gave.

The served run at temperature 0 returns, with `return_token_ids`, each prompt's ids and the target's greedy
answer ids. Their hidden states are captured through stage 02's path (`HiddenStateCapture`, the run's
resolved layer ids) and the trained checkpoint is replayed on them (eagle_pipeline.predict), so the
predicted figures and the served ones count the same drafts of the same conversations.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from eagle_pipeline.config import RunConfig
from eagle_pipeline.samples import SampleLayout


def served_checkpoint(cfg: RunConfig, trained: dict[str, Any]) -> Path:
    """The stage 04 checkpoint stage 05 converted: the best one, else the last."""
    best = trained["counts"].get("best") or {}
    return cfg.stage_dir("04_train") / (best.get("checkpoint") or trained["counts"]["last_checkpoint"])


def predict_served(cfg: RunConfig, verifier_dir: Path, layout: SampleLayout, checkpoint: Path,
                   token_ids: Sequence[tuple[Sequence[int] | None, Sequence[int] | None]], num_speculative_tokens: int,
                   scratch_dir: Path) -> dict[str, Any]:
    """Predicted acceptance of `checkpoint` on (prompt ids, answer ids) pairs; the replay's wall time included."""
    from eagle_pipeline.capture import HiddenStateCapture
    from eagle_pipeline.engine import apply_engine_env, capture_engine_kwargs
    from eagle_pipeline.predict import predict_acceptance

    pairs = [(list(p), list(c)) for p, c in token_ids if p is not None and c is not None]
    if not pairs:
        return {"predicted_mean_acceptance_length": None, "prediction_note": "the server returned no token ids"}
    started = time.monotonic()
    sequences = [p + c for p, c in pairs]
    apply_engine_env(cfg)
    with HiddenStateCapture(verifier_dir, list(layout.layer_ids), num_layers=layout.num_layers,
                            max_model_len=cfg.verifier.max_model_len, storage_path=scratch_dir,
                            **capture_engine_kwargs(cfg)) as capture:
        captured = capture.capture(sequences)
    capture_s = time.monotonic() - started
    samples = [(sample["token_ids"], sample["hidden_states"].float(), len(prompt))
               for sample, (prompt, _) in zip(captured, pairs)]
    result = predict_acceptance(str(checkpoint), samples, num_speculative_tokens)
    result["prediction_capture_s"] = round(capture_s, 1)
    result["prediction_s"] = round(time.monotonic() - started, 1)
    return result
