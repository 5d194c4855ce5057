"""The sweep of ``ddq simulate --sweep``: chips × regimes × learners on shared failure histories.

For each chip count the regimes (and every M) share one failure history per repetition, so the
columns of a row compare like with like. Each point simulates ``sweep.duration_days``.
"""

from __future__ import annotations

from typing import Any

from dd_queue.sim.config import SimConfig, validate_sim_config
from dd_queue.sim.regimes import RegimeResult, simulate

__all__ = ["point_config", "run_sweep"]


def point_config(cfg: SimConfig, chips: int) -> SimConfig:
    """``cfg`` at ``chips`` chips for the sweep's duration (validated again).

    Raises:
        ConfigError: If the point is invalid (e.g. fewer chips than one slice).
    """
    raw: dict[str, Any] = cfg.model_dump()
    raw["cluster"]["chips"] = chips
    raw["run"]["duration_days"] = cfg.sweep.duration_days
    raw["decoupled"]["learners"] = 1  # run_sweep passes the M values itself
    return validate_sim_config(raw, source=f"sweep point chips={chips}")


def run_sweep(cfg: SimConfig) -> list[tuple[int, RegimeResult]]:
    """Simulate every point of ``cfg.sweep``.

    Args:
        cfg: The configuration; ``sweep`` gives the grid, ``run`` the regimes, seed and
            repetitions.

    Returns:
        ``(chips, result)`` per chips × regime × M, M values that exceed a point's slices left
        out.
    """
    rows: list[tuple[int, RegimeResult]] = []
    for chips in cfg.sweep.chips:
        point = point_config(cfg, chips)
        counts = [m for m in cfg.sweep.learners if m <= point.cluster.n_slices]
        for result in simulate(point, learner_counts=counts or [1]):
            rows.append((result.chips, result))
    return rows
