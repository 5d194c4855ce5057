"""PNG plot of an experiment: held-out loss of the global model vs tokens and vs virtual time.

matplotlib is optional (``pip install 'dd_queue[plots]'``); without it ``plot_experiment``
raises a ``ConfigError`` that says so.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path

from dd_queue.plotting import matplotlib_available, pyplot
from dd_queue.runner.result import RunResult

__all__ = ["matplotlib_available", "plot_experiment"]


def plot_experiment(runs: Sequence[RunResult], path: Path, *, title: str = "") -> Path:
    """Write ``path`` (PNG): eval loss (or accuracy for image models) vs tokens and vs virtual
    seconds, one line per run; returns ``path``.

    Raises:
        ConfigError: matplotlib is missing.
    """
    plt = pyplot("pass --no-plot")
    vision = any(r.final.accuracy is not None for r in runs)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=110, sharey=True)
    for run in runs:
        ys = [e.accuracy if vision else e.loss for e in run.evals]
        tokens = [e.tokens for e in run.evals]
        times = [e.virtual_s for e in run.evals]
        label = f"{run.name} ({run.final.accuracy if vision else run.final.loss:.3f})"
        axes[0].plot(tokens, ys, marker=".", label=label)
        axes[1].plot(times, ys, marker=".", label=label)
    metric = "held-out accuracy" if vision else "held-out loss (nats/token)"
    axes[0].set_xlabel("tokens trained (all learners)")
    axes[1].set_xlabel("virtual wall time (s)")
    axes[0].set_ylabel(metric)
    if not vision:  # zoom on the last four fifths of each curve (the start is off the chart)
        tail = [e.loss for r in runs for e in r.evals[max(1, len(r.evals) // 5) :]]
        if tail:
            low, high = min(tail), max(tail)
            pad = 0.05 * (high - low) + 0.01
            axes[0].set_ylim(low - pad, high + pad)
    for ax in axes:
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    if title:
        fig.suptitle(textwrap.fill(title, 120), fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
