"""Each epoch's checkpoint scored as the engine would score it: the acceptance length that greedy speculative
decoding would reach on held-out conversations, the figure `train.select_by: predicted_acceptance` picks the
best checkpoint by.

Validation loss is speculators' teacher-forced loss over every position; what decides the speed-up is how
long a chain of drafts the target accepts, which weighs the first positions most and is not a monotone
function of the loss. So after each validation the checkpoint just saved is replayed (eagle_pipeline.predict,
the replay stage 06 compares with vLLM's counters; docs/measurements.md, "Served vs predicted") over the first
`train.predict_conversations` validation rows: their prompt, the target's answer, and the hidden states stage 02
captured for them. How far the figure is a served one (exact at temperature 0):
docs/formats.md, "speculators checkpoint".
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from eagle_pipeline.online.kept import stored_sample_path
from eagle_pipeline.samples import read_sample
from eagle_pipeline.train.topic_split import read_split

PREDICTED_LENGTH = "predicted_acceptance_length"
PREDICTED_PER_POSITION = "predicted_per_position_acceptance"


def selection_rule(states: dict[int, dict[str, Any]], select_by: str) -> str:
    """The rule that picks the best of these checkpoints: predicted acceptance only if all were predicted."""
    if (select_by == "predicted_acceptance" and states
            and all(s.get(PREDICTED_LENGTH) is not None for s in states.values())):
        return "predicted_acceptance"
    return "val_loss"


def selection_key(val_loss: float, predicted_length: float | None, rule: str) -> tuple[float, ...]:
    """Smaller is better: the highest predicted acceptance length, then the lowest validation loss."""
    return (-predicted_length, val_loss) if rule == "predicted_acceptance" else (val_loss,)


def prompt_length(loss_mask) -> int:
    """Tokens before the first trained one: the prompt the engine prefills before it starts drafting."""
    for index, value in enumerate(loss_mask):
        if value:
            return index
    return len(loss_mask)


def validation_conversations(data_dir: Path, out_dir: Path, limit: int) -> list[tuple[Any, Any, int]]:
    """The first `limit` validation rows (split.json's order) as (token ids, hidden states, prompt length): the
    states stage 02 stored, or in an online run those stage 04 kept (eagle_pipeline/online/kept.py)."""
    from datasets import load_from_disk

    rows = read_split(out_dir)["val_rows"][:limit]
    data = load_from_disk(str(data_dir)).with_format(None)
    conversations = []
    for row in rows:
        sample = read_sample(stored_sample_path(data_dir, out_dir, row))
        start = prompt_length(data[row]["loss_mask"])
        if start < len(sample["token_ids"]) - 1:  # an answer to draft
            conversations.append((sample["token_ids"], sample["hidden_states"].float(), start))
    return conversations


class CheckpointPredictor:
    """Predicted acceptance per epoch checkpoint, computed once per process and kept for the handlers that
    ask (the metrics recorder and early stopping)."""

    def __init__(self, data_dir: Path, out_dir: Path, checkpoint_dir: Path, conversations: int, draft_tokens: int,
                 family: str = "eagle3"):
        self.data_dir, self.out_dir, self.checkpoint_dir = data_dir, out_dir, checkpoint_dir
        self.limit, self.draft_tokens, self.family = conversations, draft_tokens, family
        self._conversations: list | None = None
        self._by_epoch: dict[int, dict[str, Any]] = {}

    def predict(self, epoch: int) -> dict[str, Any]:
        if epoch not in self._by_epoch:
            from eagle_pipeline.predict.acceptance import predict_acceptance
            from eagle_pipeline.predict.blocks import predict_block_acceptance

            if self._conversations is None:
                self._conversations = validation_conversations(self.data_dir, self.out_dir, self.limit)
            started = time.monotonic()
            if self._conversations:
                replay = predict_block_acceptance if self.family == "dflash" else predict_acceptance
                result = replay(self.checkpoint_dir / str(epoch), self._conversations, self.draft_tokens)
                length = round(float(result["predicted_mean_acceptance_length"]), 4)
                per_position = [round(float(p), 4) for p in result["predicted_per_position_acceptance"]]
            else:  # no validation row with an answer: nothing to rank by
                length, per_position = None, None
            self._by_epoch[epoch] = {PREDICTED_LENGTH: length, PREDICTED_PER_POSITION: per_position,
                                     "predicted_conversations": len(self._conversations),
                                     "prediction_s": round(time.monotonic() - started, 1)}
        return self._by_epoch[epoch]
