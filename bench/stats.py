"""Summaries of repeated measurements, the interleaving schedule, and figures a machine cannot measure."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and the values themselves (the median is the figure to quote)."""
    values = [float(v) for v in values]
    if not values:
        raise ValueError("no values to summarise")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values),
            "values": values}


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """a[i] / b[i] for each repetition i: the two sides of a pair ran back to back, so drift cancels."""
    if len(numerators) != len(denominators):
        raise ValueError(f"unpaired measurements: {len(numerators)} against {len(denominators)}")
    return [a / b for a, b in zip(numerators, denominators)]


def ratio_or_none(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def interleaved_order(names: Sequence[str], repetition: int) -> list[str]:
    """The order to run the sides in on a repetition: rotated by one each time, so each side leads in turn."""
    names = list(names)
    shift = repetition % len(names)
    return names[shift:] + names[:shift]


def split_rounds(items: Sequence[Any], rounds: int) -> list[list[Any]]:
    """`rounds` contiguous chunks of nearly equal size (the first ones one longer), none empty."""
    rounds = max(1, min(rounds, len(items)))
    size, extra = divmod(len(items), rounds)
    bounds = [r * size + min(r, extra) for r in range(rounds + 1)]
    return [list(items[start:end]) for start, end in zip(bounds, bounds[1:])]


def acceptance_length_stderr(per_position: Sequence[float], num_drafts: int) -> float | None:
    """Standard error of the mean acceptance length from per-position acceptance rates.

    vLLM accepts a draft's tokens up to the first rejection, so per_position[k] = P(A > k) for the number A
    of accepted draft tokens in one verification step: E[A] = sum p_k and E[A^2] = sum (2k + 1) p_k
    (k from 0). Steps of one request are not independent, so this is a lower bound on the true error.
    """
    if not num_drafts or not per_position:
        return None
    mean = sum(per_position)
    second = sum((2 * k + 1) * p for k, p in enumerate(per_position))
    variance = max(second - mean * mean, 0.0)
    return math.sqrt(variance / num_drafts)


# A figure this machine cannot produce (a kernel it lacks) is the string "n/a (<reason>)" in place of the
# number or spread, in the JSON as in the markdown, so that the reason travels with it.
NOT_AVAILABLE = "n/a"


def not_available(reason: str) -> str:
    return f"{NOT_AVAILABLE} ({reason})"


def is_available(figure: Any) -> bool:
    return not (isinstance(figure, str) and figure.startswith(NOT_AVAILABLE))


def reason_of(figure: str) -> str:
    """The reason inside an "n/a (<reason>)" figure."""
    return figure[len(NOT_AVAILABLE) + 2:-1]
