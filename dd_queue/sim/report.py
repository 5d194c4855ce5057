"""Human tables, CSV rows and the JSON payload of simulation results (pure formatting)."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from typing import Any

from dd_queue.sim.config import SimConfig
from dd_queue.sim.regimes import RegimeResult, checkpoint_interval_s

__all__ = [
    "CSV_FIELDS",
    "csv_text",
    "describe",
    "json_payload",
    "results_table",
    "sweep_table",
]

CSV_FIELDS = (
    "chips",
    "regime",
    "learners",
    "goodput",
    "goodput_std",
    "uptime",
    "global_downtime_s",
    "merges_per_hour",
    "mean_quorum",
    "interruptions",
    "repetitions",
)


def _pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "–" if x is None else format(x, fmt)


def describe(cfg: SimConfig) -> str:
    """One paragraph stating the parameters a result depends on."""
    cl, rp = cfg.cluster, cfg.repair
    rate = cl.n_slices * cl.slice_failure_rate_per_s
    mtbf = f"one interruption every {1 / rate:.1f} s" if rate else "no interruptions"
    if rp.distribution == "lognormal":
        repair = f"lognormal return, median {rp.median_s:g} s, p99 {rp.p99_s:g} s"
    elif rp.distribution == "exp_weibull":
        repair = f"exp-Weibull return λ {rp.scale_s:g} s, k {rp.shape_k:g}, α {rp.shape_alpha:g}"
    elif rp.distribution == "fixed":
        repair = f"fixed return {rp.fixed_s:g} s"
    else:
        repair = f"empirical return ({len(rp.samples_s)} samples)"
    el, sp, dd = cfg.elastic, cfg.spmd, cfg.decoupled
    ckpt = checkpoint_interval_s(cfg)
    return (
        f"{cl.n_slices * cl.chips_per_slice:,} chips ({cl.n_slices:,} slices × "
        f"{cl.chips_per_slice}), MTBI {cl.chip_mtbi_days:g} d/chip → {mtbf}; {repair}; "
        f"step {cl.step_s:g} s, chip speed σ {cl.speed_sigma:g}; detection {el.detection_s:g} s, "
        f"downscale {el.downscale_s:g} s, upscale {el.upscale_s:g} s; restart {sp.restart_s:g} s, "
        f"checkpoint every {ckpt:.3g} s costing {sp.checkpoint_cost_s:g} s; K {dd.quorum}, "
        f"γ {dd.grace_gamma:g}, τ {dd.overlap_steps:g}, H {dd.inner_steps_h}; "
        f"{cfg.run.duration_days:g} days, seed {cfg.run.seed}, "
        f"{cfg.run.repetitions} repetition(s)"
    )


def results_table(results: Sequence[RegimeResult]) -> str:
    """Markdown table of one simulation's regimes."""
    lines = [
        "| regime | goodput | uptime | global downtime | merges/h | mean quorum | token share |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        good = _pct(r.goodput)
        if r.repetitions > 1:
            good += f" ± {100 * r.goodput_std:.1f}"
        down = f"{r.global_downtime_s / 3600:.1f} h ({_pct(r.global_downtime_s / r.wall_s)})"
        share = _token_share(r.token_share)
        lines.append(
            f"| {r.label} | {good} | {_pct(r.uptime)} | {down} | {_num(r.merges_per_hour, '.0f')}"
            f" | {_num(r.mean_quorum, '.2f')} | {share} |"
        )
    return "\n".join(lines) + "\n"


def _token_share(share: tuple[float, ...]) -> str:
    if len(share) <= 1:
        return "–"
    if len(share) <= 4:
        return " / ".join(f"{100 * s:.1f}%" for s in share)
    return f"{100 * min(share):.1f}–{100 * max(share):.1f}% (M={len(share)})"


def sweep_table(rows: Sequence[tuple[int, RegimeResult]], *, field: str = "goodput") -> str:
    """Markdown table: chips × regime (columns) of ``goodput`` or ``uptime``."""
    labels = list(dict.fromkeys(r.label for _, r in rows))
    chips = list(dict.fromkeys(c for c, _ in rows))
    cell = {(c, r.label): getattr(r, field) for c, r in rows}
    lines = [
        f"| chips ({field}) | " + " | ".join(labels) + " |",
        "|---:|" + "---:|" * len(labels),
    ]
    for c in chips:
        values = " | ".join(_pct(cell.get((c, label))) for label in labels)
        lines.append(f"| {c:,} | {values} |")
    return "\n".join(lines) + "\n"


def csv_text(rows: Sequence[tuple[int, RegimeResult]]) -> str:
    """CSV (header + one row per chips × regime × M) of ``CSV_FIELDS``."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_FIELDS)
    for chips, r in rows:
        data = r.public_dict() | {"chips": chips}
        writer.writerow([_csv_value(data[name]) for name in CSV_FIELDS])
    return out.getvalue()


def _csv_value(value: object) -> object:
    if isinstance(value, float):
        return "" if math.isnan(value) else f"{value:.6g}"
    return "" if value is None else value


def json_payload(
    cfg: SimConfig, rows: Sequence[tuple[int, RegimeResult]], *, kind: str
) -> dict[str, Any]:
    """The ``--json`` object: config, digest and every result."""
    return {
        "command": "simulate",
        "kind": kind,
        "digest": cfg.digest,
        "config": cfg.model_dump(mode="json"),
        "parameters": describe(cfg),
        "results": [r.public_dict() | {"chips": chips} for chips, r in rows],
    }
