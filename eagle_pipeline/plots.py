"""PNG plots of the results people would rather look at than read (matplotlib, no display needed)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from eagle_pipeline import atomic


def _figure(title: str, xlabel: str, ylabel: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    return plt, fig, ax


def _save(plt, fig, path: Path) -> None:
    fig.tight_layout()
    atomic.write_with(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)


def histogram(values: Sequence[float], path: Path, title: str, xlabel: str, bins: int = 30) -> None:
    plt, fig, ax = _figure(title, xlabel, "count")
    ax.hist(values, bins=bins, color="tab:blue", alpha=0.8)
    _save(plt, fig, path)


def curve(x: Sequence[float], ys: dict[str, Sequence[float]], path: Path, title: str, xlabel: str, ylabel: str,
          marks: dict[str, tuple[float, float]] | None = None) -> None:
    plt, fig, ax = _figure(title, xlabel, ylabel)
    for label, y in ys.items():
        ax.plot(x[: len(y)], y, label=label)
    for label, (mx, my) in (marks or {}).items():
        ax.plot([mx], [my], "o", label=label)
    ax.grid(alpha=0.3)
    ax.legend()
    _save(plt, fig, path)
