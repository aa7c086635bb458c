"""Requests to a running OpenAI-compatible server: every prompt through /v1/chat/completions, timed."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from eagle_pipeline.errors import BadInput


@dataclass
class RequestResult:
    text: str
    output_tokens: int
    prompt_tokens: int
    latency_s: float
    finish_reason: str | None
    # The ids the server rendered and generated (vLLM's `return_token_ids`): what an offline replay needs.
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None
    # vLLM's per-request acceptance (`--per-request-spec-decode-metrics summary`: the response's
    # `metrics.speculative_decoding`), None where the server does not speculate or report it.
    spec_decode: dict | None = None


@dataclass
class PromptRun:
    requests: list[RequestResult]
    wall_s: float

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.requests)

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.requests]


def run_prompts(
    base_url: str,
    model: str,
    prompts: Sequence[list[dict]],
    *,
    max_tokens: int,
    temperature: float = 0.0,
    concurrency: int = 1,
    seed: int | None = 0,
    request_timeout_s: float = 1800.0,
    chat_template_kwargs: dict | None = None,
) -> PromptRun:
    """Send every prompt (a chat message list) to /v1/chat/completions, `concurrency` at a time.

    Results keep the prompts' order. A failed request raises: a measurement with holes is not one.
    `chat_template_kwargs` go to the server's chat template (eagle_pipeline.chat_template), as stage 01 used them.
    """
    from openai import BadRequestError, OpenAI

    # No retries: a retried request would count its tokens once but its time twice.
    client = OpenAI(base_url=f"{base_url}/v1", api_key="EMPTY", max_retries=0, timeout=request_timeout_s)

    stop = threading.Event()  # set on the first failure (or Ctrl-C): no new request goes out after it

    def one(index: int) -> RequestResult | None:
        if stop.is_set():
            return None
        sent = time.perf_counter()
        try:
            response = client.chat.completions.create(
                model=model, messages=prompts[index], max_tokens=max_tokens, temperature=temperature, seed=seed,
                extra_body={"return_token_ids": True,
                            **({"chat_template_kwargs": chat_template_kwargs} if chat_template_kwargs else {})},
            )
        except BadRequestError as exc:
            stop.set()
            # vLLM answers 400 for prompts it cannot take (too long for max_model_len, bad messages).
            detail = " ".join(str(exc).split())
            raise BadInput(f"prompt {index}: the server rejected it ({detail}); shorten or fix the prompt, "
                           f"or raise max_model_len") from None
        except BaseException:
            stop.set()
            raise
        latency = time.perf_counter() - sent
        choice = response.choices[0]
        return RequestResult(
            text=choice.message.content or "",
            output_tokens=response.usage.completion_tokens,
            prompt_tokens=response.usage.prompt_tokens,
            latency_s=latency,
            finish_reason=choice.finish_reason,
            prompt_token_ids=getattr(response, "prompt_token_ids", None),
            token_ids=getattr(choice, "token_ids", None),
            # The openai client keeps vLLM's extra `metrics` as the JSON object it was sent.
            spec_decode=(getattr(response, "metrics", None) or {}).get("speculative_decoding"),
        )

    started = time.perf_counter()
    pool = ThreadPoolExecutor(max_workers=max(1, concurrency))
    try:
        results = list(pool.map(one, range(len(prompts))))
    finally:
        # On a failure or Ctrl-C, drop the queued prompts instead of running them all (what leaving a
        # `with ThreadPoolExecutor` block would do); requests in flight end when the server stops.
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
    return PromptRun(requests=results, wall_s=time.perf_counter() - started)
