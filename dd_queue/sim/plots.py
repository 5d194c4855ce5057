"""PNG plots of simulation results; matplotlib is optional (``pip install 'dd_queue[plots]'``).

- ``plot_goodput_vs_chips`` — goodput against chips (log scale), one line per regime and M,
  with the paper's published points (``dd_queue.sim.published``) as hollow markers in the
  colour of their line, and their source under the plot.
- ``plot_timeline`` — a short window of one simulation: per group, when it trains, stalls or
  loses work, and when its slices fail (ticks). Plain and elastic DP are one row each; Decoupled
  DiLoCo has one row per learner.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dd_queue.errors import ConfigError
from dd_queue.plotting import matplotlib_available, pyplot
from dd_queue.sim.published import PUBLISHED, SOURCE
from dd_queue.sim.regimes import RegimeResult
from dd_queue.sim.timeline import KIND_TRAINING, KIND_WAITING, GroupTimeline

__all__ = ["matplotlib_available", "plot_goodput_vs_chips", "plot_timeline"]

_COLOURS = {
    "training": "#2e7d32",
    "stalled": "#ef6c00",
    "lost": "#c62828",
    "checkpoint": "#1565c0",
    "down": "#9e9e9e",
}


def plot_goodput_vs_chips(rows: Sequence[tuple[int, RegimeResult]], path: Path) -> Path:
    """Goodput vs chips per regime and M; writes ``path`` (PNG) and returns it.

    Raises:
        ConfigError: If matplotlib is missing.
    """
    plt = pyplot("leave out --plot")
    fig, ax = plt.subplots(figsize=(7, 4.6), dpi=120)
    labels = list(dict.fromkeys(r.label for _, r in rows))
    for label in labels:
        pts = sorted((c, r.goodput) for c, r in rows if r.label == label)
        (line,) = ax.plot([c for c, _ in pts], [100 * g for _, g in pts], marker="o", label=label)
        paper = [p for p in PUBLISHED if p.label == label]
        if paper:
            ax.scatter(
                [p.chips for p in paper],
                [100 * p.goodput for p in paper],
                s=70,
                facecolors="none",
                edgecolors=line.get_color(),
                linewidths=1.5,
                label=f"{label} (paper)",
            )
    fig.text(0.01, 0.01, f"hollow: published, {SOURCE}", fontsize=6)
    ax.set_xscale("log")
    ax.set_ylim(0, 100)
    ax.set_xlabel("chips")
    ax.set_ylabel("goodput (%)")
    ax.set_title("Goodput vs chips")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_timeline(
    results: Sequence[RegimeResult], path: Path, *, window_s: tuple[float, float]
) -> Path:
    """Timeline of ``window_s`` for every regime's groups; writes ``path`` (PNG).

    Raises:
        ConfigError: If matplotlib is missing or no result kept its timelines.
    """
    rows = [(r.label, tl) for r in results for tl in r.timelines]
    if not rows:
        raise ConfigError("no timelines to plot: simulate with keep_timelines=True")
    plt = pyplot("leave out --plot")
    fig, ax = plt.subplots(figsize=(9, 0.32 * len(rows) + 1.4), dpi=120)
    for y, (_, tl) in enumerate(reversed(rows)):
        _draw_group(ax, y, tl, window_s)
    names = [
        f"{label}:{tl.name}" if label.startswith("decoupled") else label
        for label, tl in reversed(rows)
    ]
    ax.set_yticks(range(len(rows)), names, fontsize=7)
    ax.set_xlim(*window_s)
    ax.set_xlabel("time (s)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLOURS.values()]
    ax.legend(
        handles,
        ["training", "stalled", "lost work", "checkpoint", "some chips down"],
        fontsize=7,
        loc="upper right",
        ncol=4,
    )
    ax.set_title("Who is training (failures as black ticks)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _draw_group(ax: Any, y: int, tl: GroupTimeline, window_s: tuple[float, float]) -> None:
    lo, hi = window_s
    keep = (tl.end_s > lo) & (tl.start_s < hi)
    s = np.clip(tl.start_s[keep], lo, hi)
    e = np.clip(tl.end_s[keep], lo, hi)
    training = (tl.kind[keep] == KIND_TRAINING) & (tl.active_chips[keep] > 0)
    stalled = tl.stalled[keep]
    pause = tl.kind[keep] == KIND_WAITING
    for mask, colour in (
        (training, "training"),
        (stalled, "stalled"),
        (~training & ~stalled & ~pause, "lost"),
        (pause, "checkpoint"),
    ):
        spans = list(zip(s[mask], (e - s)[mask], strict=True))
        ax.broken_barh(spans, (y - 0.35, 0.7), color=_COLOURS[colour], linewidth=0)
    down = tl.down_chips[keep] > 0
    spans = list(zip(s[down], (e - s)[down], strict=True))
    ax.broken_barh(spans, (y - 0.45, 0.1), color=_COLOURS["down"], linewidth=0)
    ticks = tl.failures_s[(tl.failures_s >= lo) & (tl.failures_s < hi)]
    ax.vlines(ticks, y - 0.45, y + 0.45, color="black", linewidth=0.8)
