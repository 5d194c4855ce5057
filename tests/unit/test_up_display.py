"""``ddq up``'s view of a run: RunWatch (rounds, tokens, goodput) and the Display's two forms."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from rich.console import Console

from dd_queue.up.display import Display
from dd_queue.up.progress import RunWatch
from dd_queue.up.summary import Summary, format_summary
from tests.unit.test_control_support import Run, heartbeat, make_run


@pytest.fixture
def run() -> Iterator[Run]:
    yield from make_run()  # a synchronizer that merged round 0 of fragment 0 (L0; L1's was NaN)


def _watch(run: Run) -> RunWatch:
    return RunWatch(
        run.cfg, run.bus, Summary(run.cfg.run.run_id, "/tmp/run", learners=["L0", "L1"])
    )


def test_the_watch_counts_merged_rounds_contributions_and_goodput(run: Run) -> None:
    watch = _watch(run)
    now = time.time()
    watch.poll(now)
    s = watch.summary
    assert s.rounds_merged >= 1 and s.versions[0] >= 1
    assert s.contributions.get("L0", 0) >= 1 and "L1" not in s.contributions  # L1's was invalid
    assert s.tokens_trained > 0
    assert s.goodput is None  # no time has passed yet
    watch.poll(now + 10.0)
    assert s.goodput == 1.0 and s.uptime == 1.0  # both learners reported training
    heartbeat(run.bus, run.cfg, "L1", state="stalled")
    watch.poll(now + 20.0)
    watch.poll(now + 30.0)
    assert s.goodput == pytest.approx(50 / 60)  # L1 waited for the last 10 of 30 s
    assert s.uptime == 1.0  # L0 trained throughout
    assert "goodput            83.3% (uptime 100.0%; merged-token share 62.5%)" in format_summary(s)


def test_without_a_terminal_the_display_prints_one_line_per_interval(
    run: Run, capsys: pytest.CaptureFixture[str]
) -> None:
    watch = _watch(run)
    now = time.time()
    watch.poll(now)
    watch.poll(now + 1.0)
    with Display(watch, duration_s=90, every_s=5, live=False) as display:
        display.update()
        display.update()  # not due yet
        watch.summary.wall_s = 6.0
        display.update()
        display.note("ddq up: L1 restarted")
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and lines[2] == "ddq up: L1 restarted"
    assert lines[0].startswith("[    0s] rounds ") and "goodput 100%" in lines[0]


def test_on_a_terminal_the_display_draws_the_learners_and_the_totals(run: Run) -> None:
    watch = _watch(run)
    now = time.time()
    watch.poll(now)
    watch.poll(now + 1.0)
    watch.summary.wall_s = 30.0
    console = Console(record=True, force_terminal=True, width=160)
    with Display(watch, duration_s=90, every_s=5, live=True, console=console) as display:
        display.update()
    text = console.export_text()
    assert f"run {run.cfg.run.run_id}" in text and "30 s / 90 s" in text
    assert "goodput 100.0%" in text and "sync up" in text
    for learner in ("L0", "L1"):
        assert learner in text
    assert "active" in text
