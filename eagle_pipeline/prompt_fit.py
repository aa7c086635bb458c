"""Which prompts stage 01 can answer and train on: each is rendered with the chat template the engine uses
and measured once, in file order, until data.num_samples of them fit. When a prompt is dropped, and why sample i
answers the i-th prompt that fits: docs/contracts.md, "Stage 01's prompts".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from eagle_pipeline.config import RunConfig
from eagle_pipeline.errors import BadInput

DROPPED_FILE = "dropped_prompts.jsonl"
TOO_LONG_FOR_MODEL = "too_long_for_model"
NO_ROOM_TO_TRAIN = "no_room_to_train"
TEMPLATE_REFUSED = "template_refused"


@dataclass(frozen=True)
class LengthLimits:
    max_model_len: int
    max_seq_len: int
    min_answer_tokens: int

    @classmethod
    def from_config(cls, cfg: RunConfig) -> "LengthLimits":
        return cls(max_model_len=cfg.verifier.max_model_len, max_seq_len=cfg.hidden_states.max_seq_len,
                   min_answer_tokens=min(cfg.generation.min_answer_tokens, cfg.generation.max_tokens))

    def problem(self, prompt_tokens: int) -> str | None:
        """Why a prompt of this many tokens is dropped, or None when it fits."""
        if prompt_tokens + self.min_answer_tokens > self.max_model_len:
            return TOO_LONG_FOR_MODEL
        if prompt_tokens >= self.max_seq_len:
            return NO_ROOM_TO_TRAIN
        return None

    def describe(self, reason: str) -> str:
        return {
            TOO_LONG_FOR_MODEL: f"leave less than {self.min_answer_tokens} answer tokens within verifier.max_model_len "
                                f"({self.max_model_len})",
            NO_ROOM_TO_TRAIN: f"fill hidden_states.max_seq_len ({self.max_seq_len}), "
                              "leaving no answer token to train on",
            TEMPLATE_REFUSED: "are refused by the chat template",
        }[reason]


@dataclass
class Selection:
    """The prompts that fit, in order (sample i answers kept[i]), and those dropped on the way to them."""

    kept: list[dict] = field(default_factory=list)
    # each {"id", "prompt_tokens" (None: not rendered), "reason", "detail"}
    dropped: list[dict] = field(default_factory=list)
    measured: int = 0

    def reasons(self) -> dict[str, int]:
        return dict(sorted(Counter(d["reason"] for d in self.dropped).items()))


# Prompts rendered and tokenized at a time: one tokenizer call per batch is much faster than one per prompt.
MEASURE_BATCH = 256


@dataclass(frozen=True)
class Refused:
    """A conversation the chat template refused, and what it said."""

    detail: str


def template_counter(tokenizer: Any, system_prompt: str | None,
                     template_kwargs: dict[str, Any]) -> Callable[[list[list[dict]]], list[int | Refused]]:
    """How many tokens the engine's prompt for each conversation has: the chat template with the generation
    prompt, the run's system prompt and template arguments, then the tokenizer without added special tokens,
    which is how vLLM's `LLM.chat` turns a conversation into prompt ids."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []

    def count(batch: list[list[dict]]) -> list[int | Refused]:
        rendered: list[str | Refused] = []
        for messages in batch:
            try:
                rendered.append(tokenizer.apply_chat_template(system + messages, add_generation_prompt=True,
                                                              tokenize=False, **template_kwargs))
            except Exception as e:  # noqa: BLE001 - a template raises whatever its author chose
                rendered.append(Refused(f"{type(e).__name__}: {e}"[:200]))
        texts = [r for r in rendered if isinstance(r, str)]
        lengths = iter([len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else [])
        return [next(lengths) if isinstance(r, str) else r for r in rendered]

    return count


def select_prompts(prompts: Sequence[dict], wanted: int,
                   count_tokens: Callable[[list[list[dict]]], list[int | Refused]],
                   limits: LengthLimits) -> Selection:
    """The first `wanted` prompts that fit `limits`, each measured at most once; prompts after the last one
    kept are measured only as far as the batch it is in."""
    selection = Selection()
    for start in range(0, len(prompts), MEASURE_BATCH):
        if len(selection.kept) >= wanted:
            break
        batch = prompts[start:start + MEASURE_BATCH]
        for prompt, tokens in zip(batch, count_tokens([p["messages"] for p in batch])):
            if len(selection.kept) == wanted:
                break
            selection.measured += 1
            if isinstance(tokens, Refused):
                selection.dropped.append({"id": prompt["id"], "prompt_tokens": None, "reason": TEMPLATE_REFUSED,
                                          "detail": tokens.detail})
                continue
            reason = limits.problem(tokens)
            if reason is None:
                selection.kept.append(prompt)
            else:
                selection.dropped.append({"id": prompt["id"], "prompt_tokens": tokens, "reason": reason,
                                          "detail": limits.describe(reason)})
    return selection


def describe_dropped(selection: Selection, limits: LengthLimits) -> str:
    """One phrase: how many were dropped and why, e.g. "3 prompts dropped (2 leave less than ...; 1 ...)"."""
    reasons = "; ".join(f"{n} {limits.describe(reason)}" for reason, n in selection.reasons().items())
    return f"{len(selection.dropped)} prompt(s) dropped ({reasons})"


def require_enough(selection: Selection, wanted: int, source: str, limits: LengthLimits) -> None:
    """Refuse (BadInput) a selection short of `wanted` prompts, saying how many were short and why."""
    if len(selection.kept) >= wanted:
        return
    first = selection.dropped[0] if selection.dropped else None
    why = (f"; {describe_dropped(selection, limits)}, the first id {first['id']!r}"
           + (f" with {first['prompt_tokens']} tokens" if first and first["prompt_tokens"] is not None else "")
           if first else "")
    raise BadInput(
        f"data.num_samples: {wanted} conversations wanted but only {len(selection.kept)} of the {selection.measured} "
        f"prompts in {source} fit, {wanted - len(selection.kept)} short{why}; lower data.num_samples to "
        f"{len(selection.kept)}, add prompts, or raise verifier.max_model_len / hidden_states.max_seq_len"
    )


def check_resumed_samples(done: dict[str, dict], sample_ids: Sequence[str], kept: Sequence[dict],
                          parts_dir: Any) -> None:
    """Refuse to resume when a finished sample answered another prompt than the one it is tied to now (the
    prompt file or the length limits changed what fits, and the sample ids would mix two selections)."""
    for sample_id, prompt in zip(sample_ids, kept):
        record = done.get(sample_id)
        if record is not None and record.get("prompt_id") != prompt["id"]:
            raise BadInput(
                f"{parts_dir}: sample {sample_id} answered prompt {record.get('prompt_id')!r}, but the prompts that "
                f"fit now tie it to {prompt['id']!r} (verifier.max_model_len, hidden_states.max_seq_len or "
                "generation.min_answer_tokens changed which prompts are dropped); restore them, or rerun with --force"
            )
