"""``ddq simulate --sensitivity``: which modelling choice or parameter moves which regime.

The points are the paper's published ones (``dd_queue.sim.published``): 150k chips with
M = 16, 1.2M chips (plain DP, elastic DP, M = 8) and 2.4M chips (plain DP, elastic DP). Each
*variant* changes one thing against the configured baseline: an ``accounting`` / ``spmd``
option flipped, or one physical parameter at the low or the high end of its plausible range
(the reason for each range is in ``VARIANTS``). Two more rows combine the options the paper's
simulator may have made (``COMBINED``), so the table shows what it takes, in documented choices
and defensible parameters, to reach each published point. Nothing is fitted.

Every variant of a point runs on the same seed, so each difference is the change's effect, not
sampling noise (common random numbers within a point).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dd_queue.sim.config import Regime, SimConfig, validate_sim_config
from dd_queue.sim.published import PUBLISHED, PublishedPoint
from dd_queue.sim.regimes import simulate

__all__ = [
    "COMBINED",
    "POINTS",
    "VARIANTS",
    "Point",
    "SensitivityRow",
    "Variant",
    "run_sensitivity",
    "sensitivity_payload",
    "sensitivity_table",
]


@dataclass(frozen=True, slots=True)
class Point:
    """One chip count and the regimes (and M) published for it."""

    chips: int
    regimes: tuple[Regime, ...]
    learners: int

    def labels(self) -> list[str]:
        """``RegimeResult.label`` of every published figure of this point."""
        return [f"decoupled_M{self.learners}" if r == "decoupled" else r for r in self.regimes]


POINTS: tuple[Point, ...] = (
    Point(150_000, ("decoupled",), 16),
    Point(1_200_000, ("plain_dp", "elastic_dp", "decoupled"), 8),
    Point(2_400_000, ("plain_dp", "elastic_dp"), 8),
)


@dataclass(frozen=True, slots=True)
class Variant:
    """One change against the baseline: ``section.field`` → value, and why it is plausible."""

    name: str
    changes: Mapping[str, Any]
    why: str


VARIANTS: tuple[Variant, ...] = (
    Variant("barrier wait counted as goodput", {"accounting.barrier_wait": "goodput"},
            "option: the paper may not charge waiting for the slowest chip"),
    Variant("failure during a stall absorbed", {"accounting.failure_during_stall": "absorbed"},
            "option: a restart under way may cover a second failure"),
    Variant("Daly checkpoint interval", {"spmd.checkpoint_rule": "daly"},
            "option: higher-order optimum instead of Young's"),
    Variant("no hot spare (wait for repair)", {"spmd.waits_for_repair": True},
            "option: plain DP restarts only once the failed slice is back"),
    Variant("chip speed σ 0", {"cluster.speed_sigma": 0.0}, "identical chips"),
    Variant("chip speed σ 3%", {"cluster.speed_sigma": 0.03}, "older or mixed bins"),
    Variant("step 0.5 s", {"cluster.step_s": 0.5}, "small models"),
    Variant("step 10 s", {"cluster.step_s": 10.0}, "frontier batch sizes"),
    Variant("slice 64 chips", {"cluster.chips_per_slice": 64}, "8 hosts × 8 GPUs"),
    Variant("slice 1024 chips", {"cluster.chips_per_slice": 1024}, "a full TPU pod"),
    Variant("repair median 2 min", {"repair.median_s": 120.0}, "automated reset"),
    Variant("repair median 30 min", {"repair.median_s": 1800.0}, "drain and swap"),
    Variant("detection 1 s", {"elastic.detection_s": 1.0}, "aggressive heartbeats"),
    Variant("detection 30 s", {"elastic.detection_s": 30.0}, "collective timeouts"),
    Variant("reconfiguration 1 s", {"elastic.downscale_s": 1.0, "elastic.upscale_s": 1.0},
            "pre-built communicators"),
    Variant("reconfiguration 30 s", {"elastic.downscale_s": 30.0, "elastic.upscale_s": 30.0},
            "NCCL re-init at scale"),
    Variant("restart 10 s", {"spmd.restart_s": 10.0}, "in-memory state, warm processes"),
    Variant("restart 60 s", {"spmd.restart_s": 60.0}, "cold restart (ft-diloco: 54–57 s)"),
    Variant("checkpoint cost 0.1 s", {"spmd.checkpoint_cost_s": 0.1}, "async snapshot"),
    Variant("checkpoint cost 5 s", {"spmd.checkpoint_cost_s": 5.0}, "blocking host copy"),
    Variant("sync 0.1 s, transfer 0.1 s",
            {"decoupled.sync_s": 0.1, "decoupled.transfer_s": 0.1}, "small fragments"),
    Variant("sync 2 s, transfer 2 s",
            {"decoupled.sync_s": 2.0, "decoupled.transfer_s": 2.0}, "slow links"),
)  # fmt: skip

COMBINED: tuple[Variant, ...] = (
    Variant("both options (barrier, absorbed)",
            {"accounting.barrier_wait": "goodput", "accounting.failure_during_stall": "absorbed"},
            "the two accounting choices together"),
    Variant("both options, restart 40 s",
            {"accounting.barrier_wait": "goodput", "accounting.failure_during_stall": "absorbed",
             "spmd.restart_s": 40.0},
            "the two choices, and a restart between hot (30 s) and cold (55 s)"),
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class SensitivityRow:
    """Goodput of every published figure under one variant (``baseline``: no change)."""

    name: str
    why: str
    goodput: dict[tuple[int, str], float]


def _variant_config(base: SimConfig, point: Point, changes: Mapping[str, Any]) -> SimConfig:
    raw: dict[str, Any] = base.model_dump()
    raw["cluster"]["chips"] = point.chips
    raw["run"]["duration_days"] = base.sweep.duration_days
    raw["run"]["regimes"] = list(point.regimes)
    raw["decoupled"]["learners"] = point.learners
    for key, value in changes.items():
        section, _, field = key.partition(".")
        raw[section][field] = value
    return validate_sim_config(raw, source=f"sensitivity {dict(changes)}")


def run_sensitivity(
    base: SimConfig,
    *,
    points: Sequence[Point] = POINTS,
    variants: Sequence[Variant] = VARIANTS + COMBINED,
) -> list[SensitivityRow]:
    """Simulate every point under the baseline and every variant.

    Args:
        base: The baseline (its ``sweep.duration_days``, seed and repetitions are used).
        points: Chip counts and regimes.
        variants: The changes.

    Returns:
        The baseline row first, then one row per variant.
    """
    rows = []
    for variant in (Variant("baseline", {}, "the configured defaults"), *variants):
        goodput: dict[tuple[int, str], float] = {}
        for point in points:
            for result in simulate(_variant_config(base, point, variant.changes)):
                goodput[(point.chips, result.label)] = result.goodput
        rows.append(SensitivityRow(variant.name, variant.why, goodput))
    return rows


def _columns(rows: Sequence[SensitivityRow]) -> list[tuple[int, str]]:
    return list(rows[0].goodput)


def _published(chips: int, label: str) -> PublishedPoint | None:
    return next((p for p in PUBLISHED if (p.chips, p.label) == (chips, label)), None)


def sensitivity_table(rows: Sequence[SensitivityRow]) -> str:
    """Markdown: goodput (and change against the baseline, points) per variant and figure,
    the published values, and the three variants that move each figure most."""
    cols = _columns(rows)
    base = rows[0].goodput
    head = " | ".join(f"{c / 1e6:g}M {label}" for c, label in cols)
    lines = [f"| variant | {head} |", "|---|" + "---:|" * len(cols)]
    for row in rows:
        cells = []
        for col in cols:
            g = row.goodput[col]
            delta = "" if row is rows[0] else f" ({100 * (g - base[col]):+.1f})"
            cells.append(f"{100 * g:.1f}%{delta}")
        lines.append(f"| {row.name} | " + " | ".join(cells) + " |")
    published = [
        f"{100 * p.goodput:.0f}% ({p.how})" if (p := _published(*col)) else "–" for col in cols
    ]
    lines.append("| **published** | " + " | ".join(published) + " |")
    lines.append("")
    lines.append("Most moving (change in points against the baseline):")
    lines.append("")
    for col in cols:
        moved = sorted(rows[1:], key=lambda r: -abs(r.goodput[col] - base[col]))[:3]
        top = "; ".join(f"{r.name} {100 * (r.goodput[col] - base[col]):+.1f}" for r in moved)
        lines.append(f"- {col[0] / 1e6:g}M {col[1]}: {top}")
    return "\n".join(lines) + "\n"


def sensitivity_payload(rows: Sequence[SensitivityRow]) -> dict[str, Any]:
    """The ``--json`` object of a sensitivity run."""
    return {
        "command": "simulate",
        "kind": "sensitivity",
        "rows": [
            {
                "variant": r.name,
                "why": r.why,
                "goodput": {f"{c}:{label}": g for (c, label), g in r.goodput.items()},
            }
            for r in rows
        ],
        "published": [
            {"chips": p.chips, "label": p.label, "goodput": p.goodput, "how": p.how}
            for p in PUBLISHED
        ],
    }
