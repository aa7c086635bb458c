"""vLLM's spec-decode counters on /metrics: parse, scrape, difference over a run, and acceptance figures, also per
request (which counters and response fields, and the figures made of them: docs/engines.md, "Spec-decode metrics").

`read_prometheus` and `sample_sums` are the product's one reader of Prometheus text, also for the online capture
servers' prefill counters (eagle_pipeline/online/servers.py) and the Mooncake master's gauges
(eagle_pipeline/online/mooncake.py).
"""

from __future__ import annotations

import time
import urllib.request
from typing import Any

# Asks a speculating server for each request's own acceptance (vLLM refuses it on one that does not speculate).
PER_REQUEST_FLAGS = ("--per-request-spec-decode-metrics", "summary")
COUNTERS = {
    "num_drafts": "vllm:spec_decode_num_drafts_total",
    "num_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
    # Server-side counters and histogram sums used as cross-checks and for latency per output token.
    "generation_tokens": "vllm:generation_tokens_total",
    "tpot_sum_s": "vllm:request_time_per_output_token_seconds_sum",
    "tpot_count": "vllm:request_time_per_output_token_seconds_count",
    "ttft_sum_s": "vllm:time_to_first_token_seconds_sum",
    "ttft_count": "vllm:time_to_first_token_seconds_count",
}
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def read_prometheus(url: str, timeout_s: float = 30.0) -> str:
    """The Prometheus text a /metrics endpoint answers."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return response.read().decode()


def prometheus_samples(text: str):
    """(name, labels, value) of every sample in Prometheus text, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, sample.labels, sample.value


def sample_sums(text: str) -> dict[str, float]:
    """Each sample name's value summed over its label sets (one per engine when data-parallel)."""
    sums: dict[str, float] = {}
    for name, _, value in prometheus_samples(text):
        sums[name] = sums.get(name, 0.0) + value
    return sums


def parse_spec_metrics(text: str) -> dict:
    """Pick the spec-decode counters (and a few server-side cross-checks) out of Prometheus text.

    Values are summed over label sets other than `position` (one per engine when data-parallel).
    Counters vLLM does not export (no speculation configured) read as 0 and an empty per-position list.
    """
    wanted = {name: key for key, name in COUNTERS.items()}
    out: dict[str, Any] = dict.fromkeys(COUNTERS, 0.0)
    per_pos: dict[int, float] = {}
    for name, labels, value in prometheus_samples(text):
        if name in wanted:
            out[wanted[name]] += value
        elif name == ACCEPTED_PER_POS:
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
    out["accepted_per_pos"] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)] if per_pos else []
    return out


def scrape_spec_metrics(base_url: str, timeout_s: float = 30.0) -> dict:
    return parse_spec_metrics(read_prometheus(f"{base_url}/metrics", timeout_s))


def metrics_delta(before: dict, after: dict) -> dict:
    """after - before, field by field; per-position lists are aligned by position."""
    delta: dict[str, Any] = {key: after[key] - before.get(key, 0.0) for key in after if key != "accepted_per_pos"}
    old = before.get("accepted_per_pos", [])
    delta["accepted_per_pos"] = [
        value - (old[i] if i < len(old) else 0.0) for i, value in enumerate(after["accepted_per_pos"])
    ]
    return delta


def wait_for_counted_tokens(base_url: str, before: dict, expected_tokens: int, timeout_s: float = 10.0) -> dict:
    """Scrape until the server's generation-token counter has caught up with the responses.

    The API server updates its Prometheus counters in its output loop, which can run just after a
    response has been sent; scraping at once could miss the last step's counts.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        after = scrape_spec_metrics(base_url)
        if after["generation_tokens"] - before["generation_tokens"] >= expected_tokens or time.monotonic() > deadline:
            return after
        time.sleep(0.2)


def ratio(numerator: float, denominator: float) -> float | None:
    """numerator / denominator, or None when nothing was counted below the line."""
    return numerator / denominator if denominator else None


def acceptance_stats(metrics: dict) -> dict:
    drafts = metrics["num_drafts"]
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(metrics["num_draft_tokens"]),
        "num_accepted_tokens": int(metrics["num_accepted_tokens"]),
        "acceptance_rate": ratio(metrics["num_accepted_tokens"], metrics["num_draft_tokens"]),
        "mean_acceptance_length": (1.0 + metrics["num_accepted_tokens"] / drafts) if drafts else None,
        "per_position_acceptance": [a / drafts for a in metrics["accepted_per_pos"]] if drafts else [],
    }


def acceptance_problem(figures: dict, num_speculative_tokens: int) -> str | None:
    """What makes a recorded acceptance impossible (None when nothing does): a mean acceptance length outside
    [1, k + 1], a per-position figure outside [0, 1] or past position k - 1, or a mean length that is not 1 + the
    sum of the per-position figures (both are counts of the same accepted tokens over the same drafts)."""
    length, per_position = figures.get("mean_acceptance_length"), figures.get("per_position_acceptance") or []
    if length is None:
        return None
    if (isinstance(length, bool) or not isinstance(length, (int, float))
            or not 1 <= length <= num_speculative_tokens + 1):
        return (f"mean acceptance length {length!r} is impossible with {num_speculative_tokens} draft tokens "
                f"(between 1 and {num_speculative_tokens + 1})")
    if (not isinstance(per_position, list) or len(per_position) > num_speculative_tokens
            or any(isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= 1 for p in per_position)):
        return (f"per-position acceptance {per_position!r} is impossible with {num_speculative_tokens} draft tokens "
                f"(at most {num_speculative_tokens} figures, each between 0 and 1)")
    if per_position and abs(1 + sum(per_position) - length) > 1e-6 * length:
        return (f"mean acceptance length {length:.4g} is not 1 + the sum of its per-position acceptance "
                f"({1 + sum(per_position):.4g})")
    return None


def request_acceptance(spec: dict | None) -> dict | None:
    """One request's acceptance from its `metrics.speculative_decoding`: {mean_acceptance_length, num_drafts,
    per_position_acceptance}, or None without metrics or drafts."""
    if not spec or not spec.get("num_spec_steps"):
        return None
    histogram = [int(n) for n in spec.get("acceptance_histogram") or []]
    drafts = int(spec["num_spec_steps"])
    # A step that accepted j drafts accepted positions 0..j-1.
    per_pos = [sum(histogram[j] for j in range(i + 1, len(histogram))) / drafts for i in range(len(histogram) - 1)]
    return {"mean_acceptance_length": 1.0 + int(spec.get("num_accepted_draft_tokens", 0)) / drafts,
            "num_drafts": drafts, "per_position_acceptance": per_pos}
