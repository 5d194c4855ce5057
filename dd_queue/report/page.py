"""A run's report as one HTML page (pure): inline CSS and SVG, no script, nothing fetched.

Its Content-Security-Policy forbids every load (``default-src 'none'``), so opening the file
makes no request at all, on any machine, online or not.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Sequence

from dd_queue.report.data import RunReport

__all__ = ["OUTCOME_COLUMNS", "render"]

OUTCOME_COLUMNS = (
    "merged", "superseded", "duplicate", "late", "stale", "invalid", "dropped", "dead_lettered"
)  # fmt: skip
"""Every way a contribution is settled, as the per-learner table lists them."""

TOKEN_FATE_COLUMNS = (*OUTCOME_COLUMNS, "dropped_at_learner", "unsent", "in_flight")
"""Every fate of a token (``TokenFate.parts``), as the token-fate table lists those that occur."""

_CSS = """
body{margin:0;font:13px/1.45 system-ui,sans-serif;background:#0f1419;color:#d8dee6}
header,main{padding:10px 20px} header{background:#171e26;border-bottom:1px solid #26313d}
h1{font-size:18px;margin:0} h2{font-size:13px;text-transform:uppercase;letter-spacing:.05em;
color:#8a96a3;margin:18px 0 6px} .muted{color:#8a96a3}
.cards{display:flex;flex-wrap:wrap;gap:8px} .card{background:#171e26;border:1px solid #26313d;
border-radius:6px;padding:6px 10px;min-width:130px} .card b{display:block;font-size:16px}
table{border-collapse:collapse;background:#171e26;width:100%}
th,td{text-align:left;padding:3px 8px;border-bottom:1px solid #26313d;white-space:nowrap}
td.wrap{white-space:normal} td.num,th.num{text-align:right}
svg{background:#171e26;display:block;width:100%;height:auto}
svg text{fill:#8a96a3;font-size:11px} .axis{stroke:#26313d}
.loss{fill:none;stroke:#58a6ff;stroke-width:2} .dot{fill:#58a6ff}
.quorum{fill:#388bfd} .merge{fill:#2ea043} .abandon{fill:#f85149}
.fault{stroke:#d29922;stroke-dasharray:3 3} .fault-label{fill:#d29922}
"""


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _pct(value: object) -> str:
    return f"{value:.1%}" if isinstance(value, int | float) else "n/a"


def _clock(at_s: float) -> str:
    return time.strftime("%H:%M:%S", time.gmtime(at_s))


def _cards(report: RunReport) -> str:
    s = report.summary
    first = report.evals[0].loss if report.evals else None
    last = report.evals[-1].loss if report.evals else None
    merged = sum(1 for r in report.rounds if r.decision == "merge")
    abandoned = len(report.rounds) - merged
    loss = "n/a" if first is None or last is None else f"{first:.3f} → {last:.3f}"
    cards = [
        ("rounds merged", f"{merged} (abandoned {abandoned})"),
        ("global versions", " ".join(f"f{p}:v{v}" for p, v in sorted(report.versions.items()))),
        ("held-out loss", loss),
        ("goodput", _pct(s.get("goodput"))),
        ("uptime", _pct(s.get("uptime"))),
        ("merged-token share", _pct(report.merged_token_share)),
        ("tokens trained", f"{s['tokens_trained']:,}" if "tokens_trained" in s else "n/a"),
        ("faults", str(len(report.faults))),
        ("dead letters", str(sum(report.dead_letters.values()))),
    ]
    body = "".join(f'<div class="card"><b>{_e(v)}</b>{_e(k)}</div>' for k, v in cards)
    return f'<section class="cards" id="cards">{body}</section>'


def _scale(lo: float, hi: float, a: float, b: float) -> tuple[float, float]:
    """The affine map [lo, hi] → [a, b] as (slope, offset); a flat range maps to the middle."""
    if hi <= lo:
        return 0.0, (a + b) / 2
    slope = (b - a) / (hi - lo)
    return slope, a - lo * slope


_W, _H, _L, _R, _T, _B = 960, 240, 50, 10, 10, 24


def _loss_chart(report: RunReport) -> str:
    points = [(p.at_s, p.loss) for p in report.evals if math.isfinite(p.loss)]
    if not points:
        return '<p class="muted" id="loss">no evaluation recorded</p>'
    t0 = points[0][0]
    xs = [t - t0 for t, _ in points]
    ys = [v for _, v in points]
    sx, ox = _scale(min(xs), max(xs), _L, _W - _R)
    sy, oy = _scale(min(ys), max(ys), _H - _B, _T)
    coords = [(x * sx + ox, y * sy + oy) for x, y in zip(xs, ys, strict=True)]
    line = " ".join(f"{x:.1f},{y:.1f}" for x, y in coords)
    dots = "".join(f'<circle class="dot" cx="{x:.1f}" cy="{y:.1f}" r="2.5"/>' for x, y in coords)
    labels = (
        f'<text x="4" y="{_T + 10}">{max(ys):.3f}</text>'
        f'<text x="4" y="{_H - _B}">{min(ys):.3f}</text>'
        f'<text x="{_L}" y="{_H - 6}">0 s</text>'
        f'<text x="{_W - _R - 60}" y="{_H - 6}">{max(xs):.0f} s</text>'
    )
    axis = f'<line class="axis" x1="{_L}" y1="{_H - _B}" x2="{_W - _R}" y2="{_H - _B}"/>'
    return (
        f'<svg id="loss" viewBox="0 0 {_W} {_H}" role="img" aria-label="held-out loss">'
        f'{axis}<polyline class="loss" points="{line}"/>{dots}{labels}</svg>'
    )


def _timeline(report: RunReport) -> str:
    rounds = report.rounds
    if not rounds:
        return '<p class="muted" id="timeline">no round recorded</p>'
    fragments = sorted({r.fragment_id for r in rounds})
    t0 = min(r.opened_at_s for r in rounds)
    t1 = max(r.closed_at_s for r in rounds)
    row, top = 18, 8
    height = top + row * len(fragments) + 30
    sx, ox = _scale(t0, t1, _L, _W - _R)
    parts = []
    for i, p in enumerate(fragments):
        y = top + i * row
        parts.append(f'<text x="4" y="{y + 12}">f{p}</text>')
    for r in rounds:
        y = top + fragments.index(r.fragment_id) * row + 2
        spans: list[tuple[str, float, float]] = []
        if r.decision == "abandon":
            spans.append(("abandon", r.opened_at_s, r.closed_at_s))
        else:
            quorum = r.quorum_at_s if r.quorum_at_s is not None else r.opened_at_s
            spans += [("quorum", r.opened_at_s, quorum), ("merge", quorum, r.closed_at_s)]
        for cls, a, b in spans:
            x, w = a * sx + ox, max(1.0, (b - a) * sx)
            parts.append(
                f'<rect class="{cls}" x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row - 4}">'
                f"<title>f{r.fragment_id} round {r.round_id} {r.decision}: {_e(r.reason)}"
                "</title></rect>"
            )
    for f in report.faults:
        if t0 <= f.issued_at_s <= t1:
            x = f.issued_at_s * sx + ox
            parts.append(
                f'<line class="fault" x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{height - 24}"/>'
                f'<text class="fault-label" x="{x + 2:.1f}" y="{height - 12}">'
                f"{_e(f.kind)} {_e(f.target)}</text>"
            )
    parts.append(f'<text x="{_L}" y="{height - 2}">{_clock(t0)}</text>')
    parts.append(f'<text x="{_W - _R - 60}" y="{height - 2}">{_clock(t1)}</text>')
    return (
        f'<svg id="timeline" viewBox="0 0 {_W} {height}" role="img" aria-label="rounds">'
        + "".join(parts)
        + "</svg>"
    )


def _table(table_id: str, head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    if not rows:
        return f'<p class="muted" id="{table_id}">none</p>'
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="{"num" if isinstance(c, int | float) else "wrap"}">{_e(c)}</td>'
            for c in row
        )
        + "</tr>"
        for row in rows
    )
    return f'<table id="{table_id}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _faults(report: RunReport) -> str:
    rows = [
        (
            _clock(f.issued_at_s),
            f.kind,
            f.target,
            f.by,
            "effective" if f.effective else ("closed" if f.final else "watching"),
            "; ".join(e.note for e in f.effects) or "no effect observed",
        )
        for f in report.faults
    ]
    return _table("faults", ("time", "kind", "target", "by", "status", "effects"), rows)


def _learners(report: RunReport) -> str:
    rows = []
    for learner, counts in sorted(report.learners.items()):
        settled = [counts.get(k, 0) for k in OUTCOME_COLUMNS]
        rows.append((learner, *settled, sum(settled), counts.get("tokens_merged", 0)))
    head = ("learner", *OUTCOME_COLUMNS, "settled", "tokens merged")
    return _table("learners", head, rows)


def _token_fates(report: RunReport) -> str:
    n = max(1, len(report.versions))
    fates = report.token_fates
    shown = [k for k in TOKEN_FATE_COLUMNS if any(f.parts().get(k) for f in fates.values())]
    rows = []
    for learner, fate in sorted(fates.items()):
        parts = fate.parts()
        rows.append(
            (
                learner,
                round(fate.computed / n),
                *(round(parts.get(k, 0) / n) for k in shown),
                ("✓ " if fate.balanced else "✗ ") + fate.verdict(n),
            )
        )
    head = ("learner", "computed", *(k.replace("_", " ") for k in shown), "balance")
    return _table("token-fates", head, rows)


def render(report: RunReport, *, generated_at_s: float | None = None) -> str:
    """The report as one HTML document."""
    when = _clock(generated_at_s if generated_at_s is not None else time.time())
    notes = "".join(f'<p class="muted note">{_e(n)}</p>' for n in report.notes)
    dead = _table("dead-letters", ("reason", "dead letters"), sorted(report.dead_letters.items()))
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta http-equiv="Content-Security-Policy" '
        "content=\"default-src 'none'; style-src 'unsafe-inline'\">"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>dd_queue report · {_e(report.run_id)}</title><style>{_CSS}</style></head>"
        f"<body><header><h1>dd_queue run {_e(report.run_id)}</h1>"
        f'<span class="muted">report written {when} UTC · '
        f"{len(report.rounds)} rounds, {len(report.evals)} evaluations, "
        f"{len(report.faults)} faults</span>{notes}</header><main>"
        f"{_cards(report)}"
        "<h2>Held-out loss</h2>" + _loss_chart(report) + "<h2>Rounds: to quorum (blue), grace "
        "and merge (green), abandoned (red); faults dashed</h2>" + _timeline(report) + "<h2>"
        "Faults and their observed effects</h2>" + _faults(report) + "<h2>Contributions per "
        "learner, by how they were settled (all fragments)</h2>" + _learners(report) + "<h2>"
        "Token fate: each learner's tokens computed, by the fate of the contribution that "
        "first carried them</h2>" + _token_fates(report) + "<h2>"
        "Dead letters by reason</h2>" + dead + "</main></body></html>\n"
    )
