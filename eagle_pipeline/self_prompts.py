"""Prompts the target writes itself (Magpie, Xu et al. 2024): its chat template rendered up to and including the
user header, so that sampling from there writes a user turn; any number of prompts without a download, in the
target's own distribution of requests. Each attempt's seed, and its record with the filter's verdict (a rerun
continues after the last one recorded): docs/formats.md, "Prompts and their topics".
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from eagle_pipeline import atomic
from eagle_pipeline.config.data import SelfWrittenPrompts
from eagle_pipeline.prompt_filter import PromptFilter, topic_key

SELF_WRITTEN_DIR = "self_written"
# Written in the user's place and cut off: where the template puts a user's words.
_SENTINEL = "\u2063USER-TURN\u2063"
# A model that stops writing usable turns must not sample forever: this many attempts per prompt at most.
MAX_ATTEMPTS_PER_PROMPT = 20


def user_turn_prefix(tokenizer: Any, system_prompt: str | None,
                     template_kwargs: dict[str, Any]) -> tuple[str, str | None]:
    """The rendered template up to and including the user header, and the text that ends a user turn."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [{"role": "user",
                                                                                             "content": _SENTINEL}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, **template_kwargs)
    if rendered.count(_SENTINEL) != 1:
        raise RuntimeError("the chat template does not place the user's words once; it cannot write user turns")
    prefix, suffix = rendered.split(_SENTINEL)
    return prefix, (suffix.strip() or None)


def attempt_seed(run_seed: int, attempt: int) -> int:
    digest = hashlib.sha256(f"self-written:{run_seed}:{attempt}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def prompt_record(attempt: int, text: str) -> dict:
    """A kept turn as load_prompts returns a prompt."""
    return {"id": f"self-{attempt:06d}", "topic": topic_key(text), "messages": [{"role": "user", "content": text}]}


def read_attempts(folder: Path) -> list[dict]:
    attempts = []
    for part in sorted(folder.glob("part-*.jsonl")):
        attempts += [json.loads(line) for line in part.read_text().splitlines() if line.strip()]
    return sorted(attempts, key=lambda a: a["attempt"])


def kept_prompts(folder: Path, prompt_filter: PromptFilter) -> tuple[list[dict], int]:
    """The prompts kept so far (the filter remembers them) and the next attempt's number."""
    attempts = read_attempts(folder)
    kept = []
    for a in attempts:
        if a["verdict"] is None:
            prompt_filter.verdict(a["text"])  # remembered for the duplicate checks of later attempts
            kept.append(prompt_record(a["attempt"], a["text"]))
    return kept, (attempts[-1]["attempt"] + 1 if attempts else 0)


def write_prompts(llm: Any, tokenizer: Any, settings: SelfWrittenPrompts, *, wanted: int, run_seed: int,
                  batch_size: int,
                  system_prompt: str | None, template_kwargs: dict[str, Any], prompt_filter: PromptFilter,
                  folder: Path) -> dict[str, Any]:
    """Sample user turns until `wanted` are kept; returns {"prompts": [...], "stats": {...}}."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    folder.mkdir(parents=True, exist_ok=True)
    kept, attempt = kept_prompts(folder, prompt_filter)
    prefix, stop = user_turn_prefix(tokenizer, system_prompt, template_kwargs)
    # The template's own special tokens are in the text already: the tokenizer must not add more.
    prefix_ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    t0, written_now = time.monotonic(), 0
    while len(kept) < wanted:
        if attempt >= MAX_ATTEMPTS_PER_PROMPT * wanted + 64:
            raise RuntimeError(f"only {len(kept)} of {attempt} self-written user turns passed the filter ({folder}); "
                               "raise data.self_written.temperature or max_tokens, or use prompt_source file")
        # Sample a little more than is missing: some turns will be dropped.
        count = min(batch_size, max(1, 2 * (wanted - len(kept))))
        numbers = list(range(attempt, attempt + count))
        params = [SamplingParams(temperature=settings.temperature, top_p=settings.top_p, max_tokens=settings.max_tokens,
                                 seed=attempt_seed(run_seed, k), stop=[stop] if stop else None) for k in numbers]
        outputs = llm.generate([TokensPrompt(prompt_token_ids=prefix_ids) for _ in numbers], params, use_tqdm=False)
        records = []
        for k, out in zip(numbers, outputs):
            completion = out.outputs[0]
            text = completion.text.strip()
            verdict = prompt_filter.verdict(text, finished=completion.finish_reason == "stop")
            records.append({"attempt": k, "text": text, "finish_reason": completion.finish_reason, "verdict": verdict})
            if verdict is None:
                kept.append(prompt_record(k, text))
        atomic.write_text(folder / f"part-{numbers[0]:07d}.jsonl", "".join(json.dumps(r) + "\n" for r in records))
        attempt += count
        written_now += count
    seconds = time.monotonic() - t0
    return {"prompts": kept[:wanted], "stats": attempt_stats(folder, written_now, seconds)}


def attempt_stats(folder: Path, written_now: int = 0, seconds: float = 0.0) -> dict[str, Any]:
    attempts = read_attempts(folder)
    verdicts = Counter(a["verdict"] or "kept" for a in attempts)
    return {
        "attempts": len(attempts),
        "kept": verdicts.get("kept", 0),
        "verdicts": dict(sorted(verdicts.items())),
        "attempts_now": written_now,
        "attempts_per_s": round(written_now / seconds, 2) if written_now and seconds else None,
    }
