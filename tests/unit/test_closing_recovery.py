"""Closing a round (merge / abandon commits) and rebuilding one after a (re)start, on MemoryBus.

What each commit writes is checked where operators and the next owner read it: the fragment's
state (counters, EMAs, last reason, committer), the round record, the run's events, the log,
the payload blobs left behind and the dead letters of a merge that overflows. The recovery
helpers (``dd_queue.synchronizer.recovery``) are called directly on a bus prepared by hand.
"""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

from dd_queue.bus import MemoryBus, ops
from dd_queue.clock import FakeClock
from dd_queue.core.tallies import histogram, learner_counts
from dd_queue.errors import ProtocolError
from dd_queue.faults import FaultInjector
from dd_queue.keys import SYNC_GROUP
from dd_queue.messages import Event, RoundOpen, RoundRecord
from dd_queue.synchronizer import recovery
from dd_queue.synchronizer.blobs import load_momentum
from dd_queue.synchronizer.context import Context
from tests.synchronizer_support import (
    beat,
    contribute,
    dead_letters,
    latest_global,
    make_config,
    pending_count,
    records,
    state_of,
)
from tests.unit.test_synchronizer import Killed, kill, new_sync, open_round, size_of

LOGGER = "dd_queue.synchronizer"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def bus(clock: FakeClock) -> MemoryBus:
    return MemoryBus("t", clock=clock)


def events(bus, cfg, kind: str) -> list[Event]:
    """The run's events of one kind, oldest first."""
    limits = cfg.wire.message_limits()
    found = [
        Event.from_fields(e.fields, run_id=cfg.run.run_id, limits=limits)
        for e in bus.read(bus.keys.events(), count=100_000)
    ]
    return [e for e in found if e.kind == kind]


def messages(caplog, prefix: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(prefix)]


def payload_bytes(bus, fragment: int) -> dict[str, int]:
    """Entry id → payload size of every contribution on a fragment's ``up`` stream."""
    return {e.id: ops.blob_ref(e).nbytes for e in bus.read(bus.keys.up(fragment), count=10_000)}


def taken_over(bus, clock, cfg, **kw):
    """A run created by ``sync-a``, which stopped; ``sync-b`` owns every fragment."""
    new_sync(bus, clock, cfg, sid="sync-a").close()
    sync = new_sync(bus, clock, cfg, sid="sync-b", **kw)
    assert state_of(bus, cfg, 0).committed_by == "sync-a"
    return sync


# ── merge_round: what the commit writes ────────────────────────────────────────────────────


def test_a_merge_commits_counters_estimates_reason_owner_record_and_event(bus, clock, caplog):
    cfg = make_config(quorum=2, weighting="uniform", grace_cap_s=1.0)
    beat(bus, cfg, "L0"), beat(bus, cfg, "L1")
    injector = FaultInjector("sync-b", clock=clock)
    sync = taken_over(bus, clock, cfg, injector=injector)
    created = state_of(bus, cfg, 0)
    r = open_round(sync, clock, 0)
    opened_at = sync.fragments[0].round.opened_at_s
    clock.advance(0.3)  # quorum reached 0.3 s after the opening
    delta = np.full(size_of(cfg, 0), 0.01, np.float32)
    a = contribute(
        bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=delta
    )
    dup = contribute(
        bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=delta
    )
    b = contribute(
        bus,
        cfg,
        learner_id="L1",
        fragment_id=0,
        round_id=r,
        base_version=0,
        delta=delta,
        n_tokens=800,
    )
    sizes = payload_bytes(bus, 0)
    keys = [bus.keys.up_blob(0, r, learner) for learner in ("L0", "L1")]
    assert all(bus.get(key) is not None for key in keys)
    injector.arm("stall", fault_id="s", params={"point": "after_merge", "seconds": 0.25})
    with caplog.at_level(logging.INFO, logger=LOGGER):
        sync.pump()
    assert clock.now() - opened_at == pytest.approx(0.55)
    assert sync.versions()[0] == 1
    [record] = records(bus, cfg, 0)
    state = state_of(bus, cfg, 0)
    # the state: version, last merged round, reason, committer
    assert (state.version, state.last_merged_round_id) == (1, r)
    assert state.last_reason == record.reason != created.last_reason
    assert state.committed_by == "sync-b"
    # the first round (version 0 → 1) waits for learners to join: it is no sample of ξ_quorum
    # (opening → quorum) or ξ_sync (decision → commit, here the 0.25 s stall)
    assert (state.quorum_ema_s, state.sync_ema_s) == (None, None)
    assert state.ema_samples == (0, 0)
    # counters: one merged round, its outcomes, bytes read (dup included) and written
    theta_bytes = created.counters["bytes_out"]
    assert {k: n for k, n in state.counters.items() if "/" not in k} == {
        "bytes_out": 2 * theta_bytes,
        "rounds_merged": 1,
        "merged": 2,
        "duplicate": 1,
        "bytes_in": sizes[a] + sizes[dup] + sizes[b],
    }
    # ... and the exact tallies: per learner, and the phase histograms (0.3 s to the quorum,
    # 0 s of grace, 0.25 s from the decision to the commit)
    assert learner_counts(state.counters) == {
        "L0": {"merged": 1, "duplicate": 1, "tokens_merged": record.contributors[0].n_tokens},
        "L1": {"merged": 1, "tokens_merged": record.contributors[1].n_tokens},
    }
    for name, total in (
        ("open_to_quorum_s", 0.3),
        ("quorum_to_merge_s", 0.0),
        ("merge_to_commit_s", 0.25),
        ("staleness_versions", 0.0),
    ):
        h = histogram(state.counters, name)
        assert h.total == pytest.approx(total) and h.count == (2 if "staleness" in name else 1)
    # the record: uniform weights, every timing (≥ 0, none padded), the grace window
    assert [(c.learner_id, c.weight) for c in record.contributors] == [("L0", 0.5), ("L1", 0.5)]
    assert {e.entry_id: e.outcome for e in record.entries} == {
        a: "merged",
        b: "merged",
        dup: "duplicate",
    }
    assert set(record.timings_s) == {"merge", "stage", "grace_window"}
    assert record.timings_s["merge"] == 0.0
    assert record.timings_s["stage"] == 0.0
    # the event and the log line
    [event] = events(bus, cfg, "round.merged")
    assert event.message == record.reason
    assert event.fields == {"fragment": 0, "round": r, "version": 1, "contributors": 2}
    assert messages(caplog, "round.merged") == [
        f"round.merged fragment 0 round {r} → version 1: {record.reason}"
    ]
    # the payloads are deleted after the commit
    assert [bus.get(key) for key in keys] == [None, None]
    assert pending_count(bus, 0) == 0


def test_the_grace_window_is_recorded_among_the_timings(bus, clock):
    cfg = make_config(quorum=1, grace_cap_s=1.0, round_timeout_s=5.0)
    beat(bus, cfg, "L0"), beat(bus, cfg, "L1")
    sync = new_sync(bus, clock, cfg)
    r = open_round(sync, clock, 0)
    delta = np.full(size_of(cfg, 0), 0.01, np.float32)
    contribute(bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=delta)
    sync.pump()
    window = sync.fragments[0].decision.grace_window_s
    assert window is not None and 0 < window <= 1.0
    while sync.versions()[0] == 0:
        beat(bus, cfg, "L0"), beat(bus, cfg, "L1")
        clock.advance(0.1)
        sync.pump()
    [record] = records(bus, cfg, 0)
    assert record.timings_s["grace_window"] == pytest.approx(window)
    assert record.timings_s["merge"] == 0.0


# ── merge_round: a merge that is not finite ────────────────────────────────────────────────


@pytest.mark.parametrize(
    ("codec", "value", "lr", "peak"),
    [("fp32", 3e38, 1.0, "max |Δ| 3e+38, "), ("int8", 8e37, 10.0, "")],
    ids=["fp32", "int8"],
)
def test_a_contribution_that_overflows_alone_is_dead_lettered_with_its_peak(
    bus, clock, caplog, codec, value, lr, peak
):
    """fp32 Δ are vectors (their peak is named); int8 Δ stay blockwise codes (no peak; int8
    refuses |x| ≥ 2^126, so a large outer learning rate makes the overflow)."""
    cfg = make_config(quorum=1, outer_lr=lr, outer_momentum=0.9, wire__codec=codec)
    beat(bus, cfg, "L0")
    sync = new_sync(bus, clock, cfg)
    r = open_round(sync, clock, 0)
    huge = np.full(size_of(cfg, 0), value, np.float32)
    bad = contribute(
        bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=huge
    )
    with caplog.at_level(logging.INFO, logger=LOGGER):
        sync.pump()
    reason = (
        f"overflow: merged alone it makes fragment 0's Θ or momentum non-finite ({peak}400 tokens)"
    )
    [letter] = dead_letters(bus, 0)
    assert letter.fields["ddq.dlq.id"].decode() == bad
    assert letter.fields["ddq.dlq.reason"].decode() == reason
    assert messages(caplog, "round.refused") == [f"round.refused fragment 0 round {r}: {reason}"]
    assert np.isfinite(sync.theta(0)).all()


def test_contributions_that_overflow_only_together_are_all_dead_lettered(bus, clock, caplog):
    """Each alone steps Θ to ±2.9e38 (finite); their RDA has a √2 larger element, whose
    outer step overflows: both are refused with one reason, the round names them both."""
    cfg = make_config(quorum=2, outer_lr=1.0, outer_momentum=0.9, merge_rule="rda")
    beat(bus, cfg, "L0"), beat(bus, cfg, "L1")
    sync = new_sync(bus, clock, cfg)
    r = open_round(sync, clock, 0)
    one = np.full(size_of(cfg, 0), 1.5e38, np.float32)
    two = one.copy()
    two[1::2] *= -1
    ids = [
        contribute(bus, cfg, learner_id=who, fragment_id=0, round_id=r, base_version=0, delta=d)
        for who, d in (("L0", one), ("L1", two))
    ]
    with caplog.at_level(logging.INFO, logger=LOGGER):
        sync.pump()
    reason = f"overflow: the 2 contributions of round {r} together make the merge non-finite"
    letters = dead_letters(bus, 0)
    assert [e.fields["ddq.dlq.id"].decode() for e in letters] == ids
    assert [e.fields["ddq.dlq.reason"].decode() for e in letters] == [reason, reason]
    assert messages(caplog, "round.refused") == [
        f"round.refused fragment 0 round {r}: {reason}; {reason}"
    ]
    assert np.isfinite(sync.theta(0)).all()


# ── abandon_round ──────────────────────────────────────────────────────────────────────────


def test_an_abandon_commits_counters_reason_owner_record_and_event(bus, clock, caplog):
    cfg = make_config(quorum=2, round_timeout_s=1.0)
    beat(bus, cfg, "L0"), beat(bus, cfg, "L1")
    sync = taken_over(bus, clock, cfg)
    created = state_of(bus, cfg, 0)
    r = open_round(sync, clock, 0)
    delta = np.full(size_of(cfg, 0), 0.01, np.float32)
    held = contribute(
        bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=delta
    )
    dup = contribute(  # settled as a duplicate; it names the held one's payload key
        bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=delta
    )
    sizes = payload_bytes(bus, 0)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        while not records(bus, cfg, 0):
            beat(bus, cfg, "L0"), beat(bus, cfg, "L1")
            clock.advance(0.1)
            sync.pump()
    [record] = records(bus, cfg, 0)
    assert record.decision == "abandon" and "round timeout" in record.reason
    assert [(e.entry_id, e.outcome, e.reason) for e in record.entries] == [
        (held, "carried", "held for the fragment's next round"),
        (dup, "duplicate", f"L0 round {r} is a duplicate; already received"),
    ]
    state = state_of(bus, cfg, 0)
    assert state.version == 0 and state.last_merged_round_id is None
    assert state.last_reason == record.reason != created.last_reason
    assert state.committed_by == "sync-b"
    assert {k: n for k, n in state.counters.items() if "/" not in k} == {
        "bytes_out": created.counters["bytes_out"],
        "rounds_abandoned": 1,
        "duplicate": 1,
        "bytes_in": sizes[dup],  # the carried one counts when it is merged
    }
    [event] = events(bus, cfg, "round.abandoned")
    assert event.message == record.reason
    assert event.fields == {"fragment": 0, "round": r, "version": 0}
    assert messages(caplog, "round.abandoned") == [
        f"round.abandoned fragment 0 round {r}: {record.reason}"
    ]
    # the duplicate is acked, the carried entry stays pending and keeps its payload
    assert pending_count(bus, 0) == 1
    assert bus.get(bus.keys.up_blob(0, r, "L0")) is not None
    sync.close()
    clock.advance(cfg.synchronizer.claim_idle_ms / 1000)  # idle: the next owner reclaims it
    again = new_sync(bus, clock, cfg, sid="sync-c")  # and reads its payload back
    assert {s.fragment_id: s.held for s in again.status()}[0] == ("L0",)
    assert dead_letters(bus, 0) == []


def test_the_round_record_stream_stays_capped_across_abandons(bus, clock):
    cfg = make_config(quorum=1, round_timeout_s=1.0, schedule="learner", redis__rounds_maxlen=16)
    sync = new_sync(bus, clock, cfg)
    while state_of(bus, cfg, 0).counters.get("rounds_abandoned", 0) < 20:
        beat(bus, cfg, "L0")
        clock.advance(0.25)
        sync.pump()
    assert bus.stream_length(bus.keys.rounds(0)) <= 16


def test_the_notice_and_round_record_streams_stay_capped_across_merges(bus, clock):
    """Each stream under its own cap: the notices under ``stream_maxlen``, the (much larger)
    round records under ``rounds_maxlen``."""
    cfg = make_config(
        quorum=1,
        redis__stream_maxlen=16,
        redis__rounds_maxlen=24,
        version_ring=2,
        max_staleness=1,
    )
    beat(bus, cfg, "L0")
    sync = new_sync(bus, clock, cfg)
    delta = np.full(size_of(cfg, 0), 1e-3, np.float32)
    for version in range(30):
        r = open_round(sync, clock, 0)
        contribute(
            bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=version, delta=delta
        )
        for _ in range(20):
            sync.pump()
            if state_of(bus, cfg, 0).version == version + 1:
                break
            clock.advance(0.01)
        beat(bus, cfg, "L0")
    assert state_of(bus, cfg, 0).version == 30
    assert 16 < bus.stream_length(bus.keys.rounds(0)) <= 24
    assert bus.stream_length(bus.keys.down(0)) <= 16


# ── recovery: the latest round, pending entries, reclaim ───────────────────────────────────


def context(bus, clock, cfg) -> Context:
    """The context a synchronizer ``sync-0`` of ``cfg`` builds."""
    injector = FaultInjector("sync-0", clock=clock)
    return Context(
        bus=bus, clock=clock, wall=clock.now, cfg=cfg, owner="sync-0", injector=injector, kill=kill
    )


@pytest.fixture
def ctx(bus, clock) -> Context:
    return context(bus, clock, make_config())


def round_open(round_id: int, run_id: str = "t") -> dict[str, bytes]:
    return RoundOpen(
        run_id=run_id, fragment_id=round_id % 2, round_id=round_id, opened_at_s=1.0, reason="x"
    ).to_fields()


def test_latest_round_is_the_newest_opening_or_none(ctx, bus, caplog):
    assert recovery.latest_round(ctx) is None
    stream = bus.keys.opened_rounds()
    bus.append(stream, round_open(2))
    bus.append(stream, round_open(5))
    assert recovery.latest_round(ctx) == 5
    garbage = {"m": b"\x00garbage"}
    bad = bus.append(stream, garbage)
    with pytest.raises(ProtocolError) as refused:
        RoundOpen.from_fields(garbage, run_id="t", limits=ctx.limits)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert recovery.latest_round(ctx) is None
    [line] = [r for r in caplog.records if r.name == LOGGER]
    assert line.levelno == logging.WARNING
    assert line.getMessage() == f"round.open_unreadable {bad}: {refused.value}"


def fill(bus, fragment: int, n: int, consumer: str) -> list[str]:
    """``n`` entries on a fragment's ``up`` stream, delivered to ``consumer`` (pending)."""
    stream = bus.keys.up(fragment)
    ids = [bus.append(stream, {"x": b"%d" % i}) for i in range(n)]
    bus.ensure_group(stream, SYNC_GROUP)
    assert len(bus.read_group(stream, SYNC_GROUP, consumer, count=n)) == n
    return ids


def test_pending_entries_reads_every_page_once(ctx, bus, monkeypatch):
    ids = fill(bus, 0, 1001, "sync-0")  # two full pages and one entry
    fill(bus, 1, 3, "other")  # another fragment's, another consumer's
    calls = []
    read = bus.read_own_pending

    def counted(*args, **kw):
        calls.append(kw)
        if len(calls) > 10:
            raise AssertionError("pending_entries does not page forward")
        return read(*args, **kw)

    monkeypatch.setattr(bus, "read_own_pending", counted)
    assert [e.id for e in recovery.pending_entries(ctx, 0)] == ids
    assert [e.id for e in recovery.pending_entries(ctx, 1)] == []


def test_reclaim_takes_a_whole_page_of_idle_entries(ctx, bus, clock):
    ids = fill(bus, 0, 150, "old")
    assert recovery.reclaim_entries(ctx, 0) == []  # not idle yet
    clock.advance(ctx.sync.claim_idle_ms / 1000 + 0.1)
    assert [e.id for e in recovery.reclaim_entries(ctx, 0)] == ids
    assert bus.pending_summary(bus.keys.up(0), SYNC_GROUP).consumers == {"sync-0": 150}


def test_reclaim_warns_about_entries_trimmed_before_they_were_settled(ctx, bus, clock, caplog):
    ids = fill(bus, 1, 10, "old")
    bus.append(bus.keys.up(1), {"x": b"new"}, maxlen=1, approximate=False)  # trims all 10
    clock.advance(ctx.sync.claim_idle_ms / 1000 + 0.1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert recovery.reclaim_entries(ctx, 1) == []
    [line] = [r for r in caplog.records if r.name == LOGGER]
    assert line.levelno == logging.WARNING
    assert line.getMessage() == (
        "contribution.lost fragment 1: 10 pending entries were trimmed before they were "
        f"settled: {ids[:8]}"
    )


# ── recovery: rebuild_round ────────────────────────────────────────────────────────────────


def committed(bus, clock, cfg, fragment: int, **changes):
    """The fragment's committed state as a synchronizer created it, with ``changes``."""
    new_sync(bus, clock, cfg).close()
    return dataclasses.replace(state_of(bus, cfg, fragment), **changes)


def answered(bus, cfg, fragment: int, *rounds: int):
    """Entries of contributions to ``fragment`` for ``rounds`` (as pending entries)."""
    delta = np.zeros(size_of(cfg, fragment), np.float32)
    for i, r in enumerate(rounds):
        contribute(
            bus,
            cfg,
            learner_id=f"L{i}",
            fragment_id=fragment,
            round_id=r,
            base_version=0,
            delta=delta,
        )
    return bus.read(bus.keys.up(fragment), count=1000)


def rebuilt(ctx, state, entries=(), *, latest=None):
    round_state, announced = recovery.rebuild_round(ctx, state, entries, latest=latest, now=7.5)
    assert round_state.opened_at_s == 7.5 and round_state.current_version == state.version
    assert round_state.fragment_id == state.fragment_id
    assert round_state.last_merged_round_id == state.last_merged_round_id
    return round_state.round_id, announced


def test_a_round_a_learner_answered_is_open_again(ctx, bus, clock):
    state = committed(bus, clock, ctx.cfg, 0)
    assert rebuilt(ctx, state, answered(bus, ctx.cfg, 0, 2)) == (2, True)


def test_answers_to_another_fragments_round_are_ignored(ctx, bus, clock):
    state = committed(bus, clock, ctx.cfg, 0)
    assert rebuilt(ctx, state, answered(bus, ctx.cfg, 0, 3)) == (0, False)


def test_the_fragments_newest_opening_at_or_before_the_latest_is_open(ctx, bus, clock):
    state = committed(bus, clock, ctx.cfg, 0)
    assert rebuilt(ctx, state, latest=1) == (0, True)  # round 0 ≤ 1 is fragment 0's
    assert rebuilt(ctx, state, latest=4) == (4, True)
    assert rebuilt(ctx, state) == (0, False)  # nothing announced: the placeholder


@pytest.mark.parametrize(
    ("fragment", "latest", "expected"),
    [(2, 1, (2, False)), (1, 5, (4, True)), (2, 5, (5, True)), (0, 5, (3, True))],
)
def test_three_fragments_find_their_own_latest_round(bus, clock, fragment, latest, expected):
    cfg = make_config(n_fragments=3)
    ctx = context(bus, clock, cfg)
    state = committed(bus, clock, cfg, fragment)
    assert rebuilt(ctx, state, latest=latest) == expected


def test_rounds_up_to_the_last_merged_one_are_not_reopened(ctx, bus, clock):
    state = committed(bus, clock, ctx.cfg, 0, last_merged_round_id=4)
    assert rebuilt(ctx, state, answered(bus, ctx.cfg, 0, 4), latest=4) == (6, False)
    assert rebuilt(ctx, state) == (6, False)
    assert rebuilt(ctx, state, latest=5) == (6, False)  # round 4 is fragment 0's latest
    assert rebuilt(ctx, state, latest=6) == (6, True)


# ── two bugs this pass found (fixed) ───────────────────────────────────────────────────────


def _next_round(sync, bus, cfg, clock, fragment: int, after: int) -> int:
    """Pump past the open round's timeout (L0 and L1 live) until ``fragment`` announces a
    round after ``after``."""
    for _ in range(400):
        beat(bus, cfg, "L0")
        beat(bus, cfg, "L1")
        sync.pump()
        clock.advance(0.05)
        st = {s.fragment_id: s for s in sync.status()}[fragment]
        if st.announced and st.round_id > after:
            return int(st.round_id)
    raise AssertionError(f"fragment {fragment} opened no round after {after}")


def _cancelling_pair(n: int, x: float) -> tuple[np.ndarray, np.ndarray]:
    """Two equal-norm Δs that agree on even elements and cancel on odd ones: RDA keeps their
    radius but puts it all on the even elements, so the merged Δ is √2·x there."""
    one = np.full(n, x, np.float32)
    two = one.copy()
    two[1::2] *= -1
    return one, two


def test_a_merge_that_overflows_float32_dead_letters_the_pair_and_the_run_goes_on(
    bus, clock, caplog
):
    """Each Δ (2.5e38) is fine alone, their RDA merge (3.5e38) is not: the merge used to
    raise out of the loop (the synchronizer exited, and again after every restart)."""
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    cfg = make_config(quorum=2, merge_rule="rda", outer_lr=0.1, outer_momentum=0.0)
    beat(bus, cfg, "L0")
    beat(bus, cfg, "L1")
    sync = new_sync(bus, clock, cfg)
    r = open_round(sync, clock, 0)
    one, two = _cancelling_pair(size_of(cfg, 0), 2.5e38)
    contribute(bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=one)
    contribute(bus, cfg, learner_id="L1", fragment_id=0, round_id=r, base_version=0, delta=two)
    for _ in range(5):
        sync.pump()
        clock.advance(0.05)
    reasons = sorted(e.fields["ddq.dlq.reason"].decode() for e in dead_letters(bus, 0))
    assert reasons == [f"overflow: the 2 contributions of round {r} together make the merge "
                       "non-finite"] * 2  # fmt: skip
    assert sync.versions()[0] == 0
    (closed,) = records(bus, cfg, 0)  # both answered, both refused: nothing more can come
    assert closed.decision == "abandon" and closed.round_id == r, closed
    assert closed.reason.startswith(f"every live learner answered round {r} without quorum 2")
    overflows = messages(caplog, "merge overflow on fragment 0: ")
    assert overflows and all(
        m.endswith("the merged delta overflowed float32; contributions are far too large")
        for m in overflows
    ), overflows
    good = np.full(size_of(cfg, 0), 0.01, np.float32)
    r2 = _next_round(sync, bus, cfg, clock, 0, r)  # learners answer the next
    for learner in ("L0", "L1"):  # the fragment still merges good contributions afterwards
        contribute(bus, cfg, learner_id=learner, fragment_id=0, round_id=r2, base_version=0,
                   delta=good)  # fmt: skip
    for _ in range(20):
        sync.pump()
        clock.advance(0.05)
        if sync.versions()[0] == 1:
            break
    assert sync.versions()[0] == 1
    assert sorted(c.learner_id for c in records(bus, cfg, 0)[-1].contributors) == ["L0", "L1"]


def test_a_refused_contribution_no_longer_counts_toward_quorum(bus, clock):
    """L0's Δ makes the outer step overflow (alone, and with L1's) and is dead-lettered: with
    quorum 2 the round must wait for another L0 contribution, not merge L1's alone (it used
    to, and its record said "all live learners contributed (L0, L1)"). L0 answered this round
    already, so the round closes at once, keeping L1's for the next."""
    cfg = make_config(quorum=2, outer_lr=2.0)
    beat(bus, cfg, "L0")
    beat(bus, cfg, "L1")
    sync = new_sync(bus, clock, cfg)
    r = open_round(sync, clock, 0)
    n = size_of(cfg, 0)
    contribute(bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0,
               delta=np.full(n, 3e38, np.float32))  # fmt: skip
    contribute(bus, cfg, learner_id="L1", fragment_id=0, round_id=r, base_version=0,
               delta=np.full(n, 0.01, np.float32))  # fmt: skip
    for _ in range(10):
        sync.pump()
        clock.advance(0.05)
    assert [e.fields["ddq.dlq.id"] for e in dead_letters(bus, 0)]  # L0's, with its reason
    assert "merged alone" in dead_letters(bus, 0)[0].fields["ddq.dlq.reason"].decode()
    assert sync.versions()[0] == 0
    (closed,) = records(bus, cfg, 0)  # both answered, 1 of quorum 2 usable: closed, L1 kept
    assert closed.decision == "abandon" and "refused L0" in closed.reason, closed.reason
    assert [(e.learner_id, e.outcome) for e in closed.entries] == [("L1", "carried")]
    r2 = _next_round(sync, bus, cfg, clock, 0, r)  # keeps L1's contribution, opens the next
    contribute(bus, cfg, learner_id="L0", fragment_id=0, round_id=r2, base_version=0,
               delta=np.full(n, 0.02, np.float32))  # fmt: skip
    for _ in range(20):
        sync.pump()
        clock.advance(0.05)
        if sync.versions()[0] == 1:
            break
    [record] = [rec for rec in records(bus, cfg, 0) if rec.decision == "merge"]
    assert sorted(c.learner_id for c in record.contributors) == ["L0", "L1"]


def test_staleness_is_recorded_and_a_weightless_round_keeps_theta_and_momentum(bus, clock):
    """A merge records each contributor's staleness (version − base). A round whose
    contributions all weigh 0 (no tokens) still advances the version, with Θ_p and the
    momentum (buffer and step) carried over exactly, and says so in its record."""
    cfg = make_config()
    beat(bus, cfg, "L0")
    sync = new_sync(bus, clock, cfg)
    size = size_of(cfg, 0)

    def merge_one(after: int, base: int, tokens: int, value: float) -> tuple[int, RoundRecord]:
        r = _next_round(sync, bus, cfg, clock, 0, after)
        contribute(bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=base,
                   delta=np.full(size, value, np.float32), n_tokens=tokens)  # fmt: skip
        for _ in range(50):
            beat(bus, cfg, "L0")
            sync.pump()
            clock.advance(0.05)
            done = [rec for rec in records(bus, cfg, 0) if rec.round_id == r]
            if done:
                return r, done[0]
        raise AssertionError(f"round {r} did not merge")

    r1, first = merge_one(-1, 0, 400, 0.01)
    assert [c.staleness for c in first.contributors] == [0]
    assert [(e.outcome, e.reason) for e in first.entries] == [("merged", "weight 1.0000")]
    r1, _ = merge_one(r1, 1, 400, 0.01)
    r2, second = merge_one(r1, 1, 400, 0.02)  # trained from version 1, merged into 2 → 3
    assert second.version_after == 3
    assert [(c.learner_id, c.staleness) for c in second.contributors] == [("L0", 1)]
    theta2 = latest_global(bus, cfg, 0)[1]  # Θ_p(3)
    state2 = state_of(bus, cfg, 0)
    momentum2 = load_momentum(bus, state2, size=size)
    assert np.any(momentum2.momentum_buffer != 0)
    _, third = merge_one(r2, 3, 0, 0.5)  # no tokens: no weight, no update
    assert (third.decision, third.version_after) == ("merge", 4)
    assert [(e.outcome, e.reason) for e in third.entries] == [("merged", "weight 0.0000")]
    np.testing.assert_array_equal(latest_global(bus, cfg, 0)[1], theta2)
    momentum3 = load_momentum(bus, state_of(bus, cfg, 0), size=size)
    np.testing.assert_array_equal(momentum3.momentum_buffer, momentum2.momentum_buffer)
    assert momentum3.step == momentum2.step


class CountingPool:
    """Records the arrays a synchronizer's buffer pool hands out and gets back."""

    def __init__(self, pool) -> None:
        self.taken: list[np.ndarray] = []
        self.given: list[np.ndarray] = []
        self._take, self._give = pool.take, pool.give
        pool.take, pool.give = self.take, self.give

    def take(self, size: int) -> np.ndarray:
        array = self._take(size)
        self.taken.append(array)
        return array

    def give(self, arrays) -> None:
        arrays = list(arrays)
        self.given.extend(arrays)
        self._give(arrays)

    def kept(self) -> list[np.ndarray]:
        """Arrays taken and not given back."""
        back = {id(a) for a in self.given}
        return [a for a in self.taken if id(a) not in back]


def test_a_refused_merge_gives_back_every_array_it_took(bus, clock):
    cfg = make_config(quorum=1, outer_lr=1.0, outer_momentum=0.9)
    beat(bus, cfg, "L0")
    sync = new_sync(bus, clock, cfg)
    r = open_round(sync, clock, 0)
    pool = CountingPool(sync.ctx.buffers)
    huge = np.full(size_of(cfg, 0), 3e38, np.float32)
    contribute(bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=huge)
    sync.pump()
    assert len(dead_letters(bus, 0)) == 1
    assert len(pool.taken) >= 6  # Θ, momentum and merged Δ of the merge and of its retry alone
    assert pool.kept() == []


def test_a_merge_keeps_only_the_new_theta_and_momentum(bus, clock):
    cfg = make_config(quorum=1)
    beat(bus, cfg, "L0")
    sync = new_sync(bus, clock, cfg)
    r = open_round(sync, clock, 0)
    old = (sync.fragments[0].theta, sync.fragments[0].momentum.momentum_buffer)
    pool = CountingPool(sync.ctx.buffers)
    delta = np.full(size_of(cfg, 0), 0.01, np.float32)
    contribute(bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=delta)
    sync.pump()
    assert state_of(bus, cfg, 0).version == 1
    rt = sync.fragments[0]
    kept = pool.kept()
    assert len(kept) == 2 and {id(a) for a in kept} == {
        id(rt.theta),
        id(rt.momentum.momentum_buffer),
    }
    given = {id(a) for a in pool.given}
    assert {id(a) for a in old} <= given  # the previous version's arrays are free again


def test_a_kill_right_after_the_commit_keeps_the_commit_and_applies_it_once(bus, clock):
    cfg = make_config(quorum=1)
    injector = FaultInjector("sync-0", clock=clock)
    sync = new_sync(bus, clock, cfg, injector=injector)
    r = open_round(sync, clock, 0)
    delta = np.full(size_of(cfg, 0), 0.01, np.float32)
    entry = contribute(
        bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=delta
    )
    injector.arm("kill", fault_id="k", params={"point": "after_commit"})
    with pytest.raises(Exception, match="after_commit"):
        sync.pump()
    assert state_of(bus, cfg, 0).version == 1 and pending_count(bus, 0) == 0  # committed whole
    again = new_sync(bus, clock, cfg)
    for _ in range(5):
        again.pump()
        clock.advance(0.05)
    assert state_of(bus, cfg, 0).version == 1
    [record] = records(bus, cfg, 0)
    assert [e.entry_id for e in record.entries] == [entry]


@pytest.mark.parametrize("anchor", ["learner", "synchronizer"])
def test_a_stale_contribution_is_anchored_as_the_config_says(bus, clock, anchor):
    """lr 1, μ 0: Θ(v+1) = Θ(v) − Δ'. Learner anchoring keeps Δ as sent; synchronizer
    anchoring moves it to the current version first (Δ' = Θ(now) − Θ(base) + Δ), so the
    stale learner's model itself becomes the global one."""
    cfg = make_config(outer_lr=1.0, outer_momentum=0.0, merge_rule="mean", anchor=anchor)
    beat(bus, cfg, "L0"), beat(bus, cfg, "L1")
    sync = new_sync(bus, clock, cfg)
    theta0 = sync.theta(0).copy()
    first = np.full(theta0.size, 0.5, np.float32)
    r = open_round(sync, clock, 0)
    contribute(bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=first)
    for _ in range(100):  # the grace window for L1 passes
        sync.pump()
        if state_of(bus, cfg, 0).version == 1:
            break
        clock.advance(0.05)
    theta1 = sync.theta(0).copy()
    assert state_of(bus, cfg, 0).version == 1
    stale = np.full(theta0.size, 0.25, np.float32)  # made against v0
    r = open_round(sync, clock, 0)
    contribute(bus, cfg, learner_id="L1", fragment_id=0, round_id=r, base_version=0, delta=stale)
    for _ in range(100):
        sync.pump()
        if state_of(bus, cfg, 0).version == 2:
            break
        clock.advance(0.05)
    expected = theta1 - stale if anchor == "learner" else theta0 - stale
    np.testing.assert_allclose(sync.theta(0), expected, rtol=0, atol=1e-6)


def test_an_overflowing_merge_gives_back_every_array_it_took(bus, clock):
    """The merge itself overflows (RDA of a cancelling pair at 2.5e38): Θ, momentum and the
    merged-Δ buffer of every attempt go back to the pool."""
    cfg = make_config(quorum=2, merge_rule="rda", outer_lr=0.1, outer_momentum=0.0)
    beat(bus, cfg, "L0"), beat(bus, cfg, "L1")
    sync = new_sync(bus, clock, cfg)
    r = open_round(sync, clock, 0)
    pool = CountingPool(sync.ctx.buffers)
    one, two = _cancelling_pair(size_of(cfg, 0), 2.5e38)
    contribute(bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=one)
    contribute(bus, cfg, learner_id="L1", fragment_id=0, round_id=r, base_version=0, delta=two)
    for _ in range(5):
        sync.pump()
        clock.advance(0.05)
    assert len(dead_letters(bus, 0)) == 2
    assert len(pool.taken) >= 9  # the merge of both, then each alone: 3 arrays each
    assert pool.kept() == []


def test_a_contribution_the_anchoring_drops_is_recorded_with_its_reason(bus, clock):
    """max_staleness 3 admits a contribution 2 versions behind, but a ring of 1 version has
    no Θ(v0) to re-anchor it from: it is dropped, and the record says why."""
    cfg = make_config(quorum=1, version_ring=1, max_staleness=3, outer_momentum=0.0)
    beat(bus, cfg, "L0")
    sync = new_sync(bus, clock, cfg)
    delta = np.full(size_of(cfg, 0), 0.01, np.float32)
    for version in range(2):
        r = open_round(sync, clock, 0)
        contribute(
            bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=version, delta=delta
        )
        for _ in range(50):
            sync.pump()
            if state_of(bus, cfg, 0).version == version + 1:
                break
            clock.advance(0.05)
    assert state_of(bus, cfg, 0).version == 2
    r = open_round(sync, clock, 0)
    stale = contribute(
        bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=delta
    )
    for _ in range(200):
        sync.pump()
        if any(e.entry_id == stale for rec in records(bus, cfg, 0) for e in rec.entries):
            break
        clock.advance(0.05)
    [entry] = [e for rec in records(bus, cfg, 0) for e in rec.entries if e.entry_id == stale]
    assert (entry.outcome, entry.reason) == (
        "dropped",
        "L0: base v0 left the ring (holds v2..v2); dropped as too stale",
    )


# ── poison pills: an entry still pending after max_takes takes ─────────────────────────────


def test_takes_after_counts_only_what_is_still_pending_and_names_those_over_the_limit():
    after, poisoned = recovery.takes_after({"a": 3, "b": 1, "gone": 9}, ["a", "b", "c", "a"],
                                           max_takes=3)  # fmt: skip
    assert after == {"a": 4, "b": 2, "c": 1}  # settled entries ("gone") are forgotten
    assert poisoned == ["a"]
    assert recovery.takes_after({}, [], max_takes=1) == ({}, [])
    assert recovery.takes_after({"a": 1}, ["a"], max_takes=1) == ({"a": 2}, ["a"])


def test_an_entry_that_kills_every_restart_is_dead_lettered_as_poison(bus, clock):
    """A contribution whose merge kills the synchronizer (here: a kill fault at after_merge in
    every process, as a crash the checks do not catch would) used to kill every restart; after
    max_takes restarts have found it pending it is dead-lettered and the run goes on."""
    cfg = make_config(quorum=1, max_takes=2)

    def start(n: int):
        injector = FaultInjector("sync-0", clock=clock)
        injector.arm("kill", fault_id=f"k{n}", params={"point": "after_merge"})
        return new_sync(bus, clock, cfg, injector=injector)  # the same name: a take

    sync = start(0)
    r = open_round(sync, clock, 0)
    delta = np.full(size_of(cfg, 0), 0.01, np.float32)
    bad = contribute(bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0,
                     delta=delta)  # fmt: skip
    kills = 0
    while kills < 10:
        try:
            for _ in range(20):
                sync.pump()
                clock.advance(0.05)
            break
        except Killed:
            kills += 1
            clock.advance(1.0)
            sync = start(kills)
    assert kills == 3  # read once by the running process, then found pending by two takes
    [letter] = dead_letters(bus, 0)
    assert letter.fields["ddq.dlq.id"].decode() == bad
    reason = letter.fields["ddq.dlq.reason"].decode()
    assert reason.startswith("poison: still pending after 3 takes of fragment 0"), reason
    assert pending_count(bus, 0) == 0 and sync.versions()[0] == 0


def test_takes_of_entries_that_settle_do_not_accumulate(bus, clock):
    """Restarts while entries merge normally never dead-letter anything."""
    cfg = make_config(quorum=1, max_takes=1)
    delta = np.full(size_of(cfg, 0), 0.01, np.float32)
    for version in range(1, 4):
        sync = new_sync(bus, clock, cfg)
        r = open_round(sync, clock, 0)
        contribute(bus, cfg, learner_id="L0", fragment_id=0, round_id=r,
                   base_version=version - 1, delta=delta)  # fmt: skip
        for _ in range(40):
            sync.pump()
            clock.advance(0.05)
            if sync.versions()[0] == version:
                break
        assert sync.versions()[0] == version
        sync.close()
    assert dead_letters(bus, 0) == []


def test_a_fragment_whose_state_cannot_be_read_is_left_with_its_reason_not_a_crash(bus, clock):
    """A garbled state key used to raise out of start() on every restart (a crash loop); now
    the synchronizer owns the other fragments, says why, and tries the bad one again later."""
    cfg = make_config()
    new_sync(bus, clock, cfg, sid="sync-a").close()
    bus.set(bus.keys.state(0), b"\x93garbage")
    sync = new_sync(bus, clock, cfg)
    assert sync.owned == {1}
    [event] = events(bus, cfg, "fragment.unreadable")
    assert event.fields["fragment"] == 0 and "cannot be loaded" in event.message
    assert event.message.endswith("retrying in 30 s")
    for _ in range(5):  # no retry before its time, no second event
        sync.pump()
        clock.advance(1.0)
    assert sync.owned == {1} and len(events(bus, cfg, "fragment.unreadable")) == 1
    clock.advance(25.0)
    sync.pump()  # its time has come: tried again, refused again with its reason
    assert sync.owned == {1} and len(events(bus, cfg, "fragment.unreadable")) == 2
