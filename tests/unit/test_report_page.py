"""``ddq report``'s page (pure): every panel, escaped text, and nothing it could load."""

from __future__ import annotations

import re
from html.parser import HTMLParser

import pytest

from dd_queue.control.faultbook import Effect, FaultRecord
from dd_queue.core.tallies import token_fate
from dd_queue.messages import ContributorRecord, RoundRecord
from dd_queue.report.data import EvalPoint, RunReport
from dd_queue.report.page import OUTCOME_COLUMNS, render

pytestmark = pytest.mark.unit


def _round(p: int, r: int, decision: str, at: float) -> RoundRecord:
    merged = decision == "merge"
    return RoundRecord(
        run_id="demo",
        fragment_id=p,
        round_id=r,
        version_before=r,
        version_after=r + 1 if merged else r,
        decision=decision,  # type: ignore[arg-type]
        reason="quorum 1 <script>alert(1)</script>",
        contributors=(
            (ContributorRecord(learner_id="L0", weight=1.0, n_tokens=64, n_steps=2, staleness=0),)
            if merged
            else ()
        ),
        entries=(),
        opened_at_s=at,
        quorum_at_s=at + 0.5 if merged else None,
        closed_at_s=at + 1.0,
        timings_s={},
    )


def _report(**kw: object) -> RunReport:
    base: dict[str, object] = {
        "run_id": "demo",
        "summary": {"goodput": 0.95, "uptime": 1.0, "tokens_trained": 1000},
        "versions": {0: 2, 1: 1},
        "rounds": [
            _round(0, 0, "merge", 100),
            _round(1, 1, "abandon", 101),
            _round(0, 2, "merge", 102),
        ],
        "evals": [EvalPoint(100, 5.5, 0), EvalPoint(110, 4.0, 1), EvalPoint(120, 3.25, 2)],
        "faults": [
            FaultRecord(
                fault_id="f1",
                target="L1",
                kind="kill",
                duration_s=None,
                params={},
                by="chaos <b>",
                issued_at_s=101.5,
                command_ids=["1-0"],
                effects=[Effect(102.0, "L1 went dead")],
                final=True,
                effective=True,
            )
        ],
        "learners": {"L0": {"merged": 2, "late": 1, "tokens_merged": 1200}, "L1": {"stale": 3}},
        "dead_letters": {"non_finite": 1},
        "tokens_merged": 1200,
        "token_fates": {  # token·fragments, P = 2
            "L0": token_fate(4000, 3000, 200, {"merged": 2400, "late": 600}),
            "L1": token_fate(1000, 1200, 0, {"stale": 1000}),
        },
    }
    return RunReport(**{**base, **kw})  # type: ignore[arg-type]


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.srcs: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append(tag)
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            if name in ("src", "href", "xlink:href", "action", "srcset") and value:
                self.srcs.append(value)


def test_every_panel_is_there_and_nothing_can_be_loaded() -> None:
    page = render(_report(), generated_at_s=0)
    tags = _Tags()
    tags.feed(page)
    panels = {"cards", "loss", "timeline", "faults", "learners", "dead-letters", "token-fates"}
    assert panels <= tags.ids
    assert tags.srcs == [] and "script" not in tags.tags and "link" not in tags.tags
    assert "default-src 'none'" in page  # the CSP forbids any load
    assert not re.search(r"url\(|@import|https?://", page)


def test_text_from_the_run_is_escaped() -> None:
    page = render(_report(), generated_at_s=0)
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;" in page
    assert "chaos &lt;b&gt;" in page


def test_the_numbers_shown() -> None:
    page = render(_report(), generated_at_s=0)
    assert "5.500 → 3.250" in page  # held-out loss
    assert "95.0%" in page and "100.0%" in page  # goodput, uptime
    assert "60.0%" in page  # merged-token share: 1200 / 2 fragments / 1000 trained
    assert "2 (abandoned 1)" in page
    assert page.count('class="merge"') == 2 and page.count('class="abandon"') == 1
    assert page.count('class="fault"') == 1 and "L1 went dead" in page
    row = re.search(r"<tr><td class=\"wrap\">L0</td>(.*?)</tr>", page)
    assert row is not None
    cells = re.findall(r">(\d+)<", row.group(1))
    assert [int(c) for c in cells] == [2, 0, 0, 1, 0, 0, 0, 0, 3, 1200]
    assert len(OUTCOME_COLUMNS) == 8


def test_the_token_fates_in_tokens_with_their_verdict() -> None:
    page = render(_report(), generated_at_s=0)
    table = re.search(r'<table id="token-fates">(.*?)</table>', page)
    assert table is not None
    head = re.findall(r"<th>(.*?)</th>", table.group(1))
    assert head == [  # only the fates that occur, in the fates' order
        "learner", "computed", "merged", "late", "stale", "dropped at learner", "unsent",
        "in flight", "balance",
    ]  # fmt: skip
    rows = re.findall(r"<tr><td class=\"wrap\">(L\d)</td>(.*?)</tr>", table.group(1))
    cells = {lid: re.findall(r"<td[^>]*>(.*?)</td>", rest) for lid, rest in rows}
    assert cells["L0"][:-1] == ["2000", "1200", "300", "0", "100", "400", "0"]
    assert cells["L0"][-1] == "✓ balanced: 2,000 tokens computed = the sum of their fates"
    assert cells["L1"][-1].startswith("✗ does not balance: ")  # published more than computed


def test_an_empty_run_says_so_instead_of_drawing_nothing() -> None:
    page = render(
        _report(
            rounds=[], evals=[], faults=[], learners={}, dead_letters={}, summary={}, token_fates={}
        ),
        generated_at_s=0,
    )
    assert "no evaluation recorded" in page and "no round recorded" in page
    assert page.count("n/a") >= 3  # goodput, uptime, share without a summary
