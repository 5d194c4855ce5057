"""Token fate, both sides: a learner's ``TokenBook`` and the synchronizer's settled fates
(``core.tallies``) balance exactly, checked against a simulation that tracks every token."""

from __future__ import annotations

import sys
import threading
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from dd_queue.core.tallies import Observed, round_increments, summed, token_fate, token_fates
from dd_queue.learner.tokens import TokenBook

OUTCOMES = ("merged", "late", "stale", "superseded", "dropped", "duplicate", "invalid")

# one learner's life: steps, snapshots (each sent with an outcome, dropped, or sent after a
# failed try), receipts of a fragment (a new span), and sends left unsettled (in flight)
actions = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(0, 3), st.integers(1, 500)),
        st.tuples(st.just("send"), st.integers(0, 3), st.sampled_from(OUTCOMES)),
        st.tuples(st.just("drop"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("retry"), st.integers(0, 3), st.sampled_from(OUTCOMES)),
        st.tuples(st.just("receive"), st.integers(0, 3), st.just(0)),
        st.tuples(st.just("unsettled"), st.integers(0, 3), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=300)
@given(actions)
def test_every_token_has_exactly_one_fate(script: list[tuple[str, int, object]]):
    P = 4
    book = TokenBook(P)
    trained = [0] * P  # tokens of the fragment's current span
    base = [0] * P
    carried = [0] * P  # the span's tokens some sent or dropped snapshot carried
    fates: list[tuple[str, str, int]] = []
    expected: Counter[str] = Counter()
    unsent = in_flight = dropped = 0
    for kind, p, arg in script:
        if kind == "step":
            book.trained(int(arg))  # type: ignore[call-overload]
            trained = [t + int(arg) for t in trained]  # type: ignore[call-overload]
            continue
        if kind == "receive":  # the span closes: what no snapshot carried is never sent
            unsent += trained[p] - carried[p]
            trained[p], carried[p], base[p] = 0, 0, base[p] + 1
            continue
        span = (p, base[p], trained[p])
        new = book.new_tokens(*span)
        assert new == trained[p] - carried[p]  # exactly what no earlier send carried
        if kind == "drop":
            book.dropped(*span)
            dropped += new
        else:
            if kind == "retry":  # counted, the send failed, then sent again
                book.sending(*span)
            book.sending(*span)
            assert book.new_tokens(*span) == new  # counting alone moves nothing on the wire
            book.sent(*span)
            if kind == "unsettled":
                in_flight += new
            else:
                fates.append(("L0", str(arg), new))
                expected[str(arg)] += new
        carried[p] = trained[p]
    unsent += sum(t - c for t, c in zip(trained, carried, strict=True))
    counters = summed(round_increments(Observed(fates=(f,))) for f in fates)
    settled = token_fates(counters).get("L0", {})
    assert settled == {k: n for k, n in expected.items() if n}
    totals = book.totals()
    fate = token_fate(totals["computed"], totals["published"], totals["dropped"], settled)
    assert fate.balanced, fate.reason
    assert fate.computed == P * sum(int(a) for k, _, a in script if k == "step")  # type: ignore[call-overload]
    assert (fate.dropped, fate.unsent, fate.in_flight) == (dropped, unsent, in_flight)
    assert sum(fate.parts().values()) == fate.computed


def test_the_fate_says_why_it_does_not_balance():
    fate = token_fate(100, 60, 10, {"merged": 70})
    assert not fate.balanced and fate.in_flight == -10
    assert fate.reason == "10 more tokens settled than published"
    fate = token_fate(50, 60, 10, {"merged": 60})
    assert not fate.balanced and "20 more tokens published or dropped than computed" in (
        fate.reason or ""
    )
    ok = token_fate(100, 60, 10, {"merged": 50, "late": 10})
    assert ok.balanced and ok.reason is None and ok.unsent == 30 and ok.in_flight == 0


def test_reports_carry_each_increment_once_across_threads():
    """The heartbeat and the sender both report while the training thread counts; some reports
    fail and are given back. Every increment reaches the counters once, and none is negative
    (the bug this pins: two reporters read the same increment before either marked it)."""
    book = TokenBook(2)
    reported: Counter[str] = Counter()
    negative: list[dict[str, int]] = []
    lock = threading.Lock()
    training = threading.Event()
    training.set()

    def train() -> None:
        for _ in range(5000):
            book.trained(3)
        training.clear()

    def report(fail_every: int) -> None:
        n = 0
        while training.is_set():
            due = book.claim()
            n += 1
            if any(v < 0 for v in due.values()):
                negative.append(due)
            if n % fail_every == 0:
                book.unclaim(due)  # the bus failed: report it later
                continue
            with lock:
                reported.update(due)

    threads = [threading.Thread(target=train)]
    threads += [threading.Thread(target=report, args=(k,)) for k in (3, 5)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often, so a race has its chance
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    reported.update(book.claim())
    assert not negative
    assert reported["computed"] == 2 * 3 * 5000 == book.totals()["computed"]
    assert not any(book.claim().values())
