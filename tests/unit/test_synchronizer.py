"""The synchronizer on MemoryBus + FakeClock: run creation, merges, policy, outcomes, restarts.

Every test drives ``Synchronizer.pump()`` by hand and moves the fake clock, as the in-process
runner does; learners are scripted stand-ins (``tests/synchronizer_support.py``).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dd_queue.bus import MemoryBus, ops
from dd_queue.clock import FakeClock
from dd_queue.core.fragments import flatten_fragment
from dd_queue.core.merge import segment_sq_norms
from dd_queue.core.schedule import round_interval_s
from dd_queue.errors import ConfigError, CorruptPayload, DDQError
from dd_queue.faults import FaultInjector
from dd_queue.fragment_state import fragment_of
from dd_queue.messages import Event, FaultCommand, MessageLimits, RoundOpen
from dd_queue.synchronizer import ArraySource, FragmentState, Synchronizer, plan_of
from dd_queue.synchronizer.source import ConfigModelSource
from tests.synchronizer_support import (
    beat,
    contribute,
    dead_letters,
    latest_global,
    make_config,
    opened,
    pending_count,
    records,
    settled_outcomes,
    state_of,
    tiny_source,
    versions_published,
    with_nan,
)


class Killed(DDQError):
    """Stands in for SIGKILL in-process."""


def kill(point: str) -> None:
    raise Killed(point)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def bus(clock: FakeClock) -> MemoryBus:
    return MemoryBus("t", clock=clock)


def new_sync(bus, clock, cfg, *, sid="sync-0", source=None, **kw) -> Synchronizer:
    sync = Synchronizer(
        cfg,
        bus=bus,
        clock=clock,
        synchronizer_id=sid,
        source=source or tiny_source(),
        wall=clock.now,
        kill=kill,
        **kw,
    )
    sync.start()
    return sync


def open_round(sync: Synchronizer, clock: FakeClock, fragment: int) -> int:
    """Pump (moving the clock) until ``fragment`` has an announced round; return its id."""
    for _ in range(200):
        sync.pump()
        st = {s.fragment_id: s for s in sync.status()}
        if st[fragment].announced:
            return st[fragment].round_id
        clock.advance(0.01)
    raise AssertionError(f"fragment {fragment} never opened a round")


def size_of(cfg, fragment: int, source: ArraySource | None = None) -> int:
    return plan_of(source or tiny_source(), cfg.synchronizer).fragments[fragment].size


def theta0(cfg, fragment: int, source: ArraySource | None = None) -> np.ndarray:
    src = source or tiny_source()
    return flatten_fragment(plan_of(src, cfg.synchronizer).fragments[fragment], src.arrays())


# ── run creation and restart ───────────────────────────────────────────────────────────────


def test_start_creates_version_zero_of_every_fragment(bus, clock):
    cfg = make_config()
    sync = new_sync(bus, clock, cfg)
    assert sync.owned == {0, 1}
    plan = plan_of(tiny_source(), cfg.synchronizer)
    for p in (0, 1):
        state = state_of(bus, cfg, p)
        assert (state.version, state.plan_digest, state.config_digest) == (
            0,
            plan.digest,
            cfg.run_digest,
        )
        msg, theta = latest_global(bus, cfg, p)
        assert msg.version == 0
        np.testing.assert_array_equal(theta, theta0(cfg, p))


def _newest_opening(bus, cfg) -> RoundOpen:
    entry = bus.read_latest(bus.keys.opened_rounds())
    assert entry is not None
    return RoundOpen.from_fields(entry.fields, run_id="t", limits=MessageLimits())


@pytest.mark.parametrize("restart_after", [0.6, 3.0])
def test_a_restarted_synchronizer_keeps_the_runs_round_pace(bus, clock, restart_after):
    """The next round is due one interval after the predecessor's last opening (not after the
    restart), and opens at the first pump when that is overdue."""
    cfg = make_config()
    sync = cfg.synchronizer
    interval = round_interval_s(
        sync.initial_step_time_s,
        sync_every_steps=sync.sync_every_steps,
        n_fragments=sync.n_fragments,
    )
    open_round(new_sync(bus, clock, cfg), clock, 0)  # round 0, then the process dies
    first = _newest_opening(bus, cfg)
    clock.advance(first.opened_at_s + restart_after * interval - clock.now())
    restarted = new_sync(bus, clock, cfg)  # the same id: a restart
    restarted.pump()
    if restart_after > 1:  # overdue: at once
        assert _newest_opening(bus, cfg).round_id == 1
        assert _newest_opening(bus, cfg).opened_at_s == pytest.approx(clock.now())
        return
    assert _newest_opening(bus, cfg).round_id == 0  # not due yet
    while _newest_opening(bus, cfg).round_id == 0:
        clock.advance(0.01)
        restarted.pump()
    due = first.opened_at_s + interval
    assert _newest_opening(bus, cfg).opened_at_s == pytest.approx(due, abs=0.02)


def _merge_one_round(bus, clock, cfg) -> int:
    """A synchronizer merges one round of fragment 0 (L0's contribution) and dies; its id."""
    first = new_sync(bus, clock, cfg)
    beat(bus, cfg, "L0", step_time_s=1.0)  # the pace: one round per 1 s (H/P = 2/2)
    r = open_round(first, clock, 0)
    delta = np.full(size_of(cfg, 0), 0.01, np.float32)
    contribute(bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=delta)
    first.pump()
    assert first.versions()[0] == 1
    return r


@pytest.mark.parametrize(("restart_after", "early"), [(0.3, False), (0.6, True)])
def test_a_synchronizer_that_took_over_opens_early_once_half_an_interval_passed(
    bus, clock, restart_after, early
):
    """After a takeover the next round opens at once when ≥ half an interval has passed since
    the last opening (the learners' steps since then wait for no merge otherwise), and says
    so; earlier than that it waits for that half. Only the first round: then the pace holds."""
    cfg = make_config(initial_step_time_s=1.0)
    r = _merge_one_round(bus, clock, cfg)
    last = _newest_opening(bus, cfg)
    clock.advance(last.opened_at_s + restart_after - clock.now())
    restarted = new_sync(bus, clock, cfg)  # the same id: a restart
    restarted.pump()
    newest = _newest_opening(bus, cfg)
    if not early:
        assert newest.round_id == r
        while _newest_opening(bus, cfg).round_id == r:
            clock.advance(0.01)
            restarted.pump()
        newest = _newest_opening(bus, cfg)  # at half the interval, not at the full one
        assert newest.opened_at_s == pytest.approx(last.opened_at_s + 0.5, abs=0.02)
        assert "opens at once after a takeover" in newest.reason
        return
    assert newest.round_id == r + 1
    assert newest.opened_at_s == pytest.approx(clock.now())
    assert newest.reason.startswith(f"round {r + 1} (fragment 1) opens at once after a takeover")
    clock.advance(0.6)  # past the half interval again: the pace is the run's now
    restarted.pump()
    assert _newest_opening(bus, cfg).round_id == r + 1


def test_a_synchronizer_sharing_the_run_with_a_peer_keeps_the_pace_after_a_takeover(bus, clock):
    cfg = make_config(initial_step_time_s=1.0)
    r = _merge_one_round(bus, clock, cfg)
    last = _newest_opening(bus, cfg)
    clock.advance(last.opened_at_s + 0.6 - clock.now())
    restarted = new_sync(bus, clock, make_config(initial_step_time_s=1.0, max_fragments=1))
    assert restarted.owned == {0}  # the other fragment is a peer's to take
    restarted.pump()
    assert _newest_opening(bus, cfg).round_id == r


def test_restart_continues_exactly_where_the_commit_left(bus, clock):
    cfg = make_config(outer_momentum=0.9, outer_lr=0.7)
    sync = new_sync(bus, clock, cfg)
    beat(bus, cfg, "L0")
    for step in range(3):
        r = open_round(sync, clock, 0)
        delta = np.full(size_of(cfg, 0), 0.01 * (step + 1), np.float32)
        contribute(
            bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=step, delta=delta
        )
        sync.pump()
        assert sync.versions()[0] == step + 1
    before, momentum = sync.theta(0), sync.fragments[0].momentum.momentum_buffer.copy()
    again = new_sync(bus, clock, cfg)  # same id, same bus: a restart
    assert again.versions() == {0: 3, 1: 0}
    np.testing.assert_array_equal(again.theta(0), before)
    np.testing.assert_array_equal(again.fragments[0].momentum.momentum_buffer, momentum)
    assert again.fragments[0].ring.versions == (0, 1, 2, 3)


def test_other_run_digest_is_refused_unless_allowed(bus, clock):
    new_sync(bus, clock, make_config()).close()
    changed = make_config(sync_every_steps=4)  # H is part of the run digest
    with pytest.raises(ConfigError, match="allow-config-change"):
        new_sync(bus, clock, changed, sid="sync-1")
    sync = new_sync(bus, clock, changed, sid="sync-1", allow_config_change=True)
    assert sync.owned == {0, 1}
    assert sync.fragments[0].state.config_digest == changed.run_digest


def test_other_model_plan_is_refused(bus, clock):
    new_sync(bus, clock, make_config()).close()
    other = ArraySource({"embed.weight": np.zeros((16, 8)), "w": np.zeros((40,))})
    with pytest.raises(ConfigError, match="planned for another model"):
        new_sync(bus, clock, make_config(), sid="sync-1", source=other)


class _CountingSource(ConfigModelSource):
    """The config's model, counting how often it is built to plan."""

    builds = 0

    def shapes(self) -> dict[str, tuple[int, ...]]:
        type(self).builds += 1
        return ConfigModelSource.shapes(self)


def _config_model_sync(bus, clock, cfg, sid: str = "sync-0") -> Synchronizer:
    return new_sync(bus, clock, cfg, sid=sid, source=_CountingSource(cfg.model, cfg.run.seed))


@pytest.fixture
def counting():
    _CountingSource.builds = 0
    return _CountingSource


def test_a_restart_plans_from_the_committed_states_without_building_the_model(bus, clock, counting):
    cfg = make_config(model__preset="gpt-tiny")
    first = _config_model_sync(bus, clock, cfg)
    assert counting.builds == 1  # the run is created: the model is built
    plan = first._plan
    first.close()
    again = _config_model_sync(bus, clock, cfg)  # a restart, and a standby alike
    standby = _config_model_sync(bus, clock, cfg, sid="sync-1")
    assert counting.builds == 1
    assert again._plan == plan and standby._plan == plan
    assert again.owned == {0, 1}


def test_a_changed_config_or_a_missing_state_builds_the_model_to_check(bus, clock, counting):
    cfg = make_config(model__preset="gpt-tiny")
    _config_model_sync(bus, clock, cfg).close()
    changed = make_config(model__preset="gpt-tiny", sync_every_steps=4)  # another run digest
    with pytest.raises(ConfigError):
        _config_model_sync(bus, clock, changed)
    assert counting.builds == 2
    bus.delete([bus.keys.state(1)])  # a run whose creation stopped half-way
    again = _config_model_sync(bus, clock, cfg)
    assert counting.builds == 3 and again.owned == {0, 1}


def test_a_committed_plan_whose_layouts_do_not_make_its_digest_is_not_used(bus, clock, counting):
    cfg = make_config(model__preset="gpt-tiny")
    first = _config_model_sync(bus, clock, cfg)
    plan = first._plan
    first.close()
    state = state_of(bus, cfg, 0)
    forged = dataclasses.replace(state, segments=state.segments[:-1])  # a tensor less
    bus.set(bus.keys.state(0), forged.to_bytes())
    again = _config_model_sync(bus, clock, cfg)  # planned from the model instead
    assert counting.builds == 2 and again._plan == plan


# ── the algorithm's special cases ──────────────────────────────────────────────────────────


def test_one_learner_lr1_mu0_global_equals_the_learner_model(bus, clock):
    cfg = make_config(outer_lr=1.0, outer_momentum=0.0, merge_rule="mean")
    sync = new_sync(bus, clock, cfg)
    rng = np.random.default_rng(1)
    theta = theta0(cfg, 0)
    for step in range(3):
        r = open_round(sync, clock, 0)
        learner = theta + rng.standard_normal(theta.size).astype(np.float32) * 0.01
        contribute(
            bus,
            cfg,
            learner_id="L0",
            fragment_id=0,
            round_id=r,
            base_version=step,
            delta=theta - learner,
        )
        sync.pump()
        theta = sync.theta(0)
        np.testing.assert_allclose(theta, learner, rtol=0, atol=1e-6)


def test_k_equals_m_equal_tokens_mean_sgd_gives_the_mean_model(bus, clock):
    cfg = make_config(quorum=3, outer_lr=1.0, outer_momentum=0.0, merge_rule="mean")
    for learner in ("L0", "L1", "L2"):
        beat(bus, cfg, learner)
    sync = new_sync(bus, clock, cfg)
    r = open_round(sync, clock, 0)
    theta, rng, models = theta0(cfg, 0), np.random.default_rng(2), []
    for learner in ("L0", "L1", "L2"):
        models.append(theta + rng.standard_normal(theta.size).astype(np.float32) * 0.01)
        contribute(
            bus,
            cfg,
            learner_id=learner,
            fragment_id=0,
            round_id=r,
            base_version=0,
            delta=theta - models[-1],
        )
        assert sync.versions()[0] == 0 or learner == "L2"
        sync.pump()
    assert sync.versions()[0] == 1
    np.testing.assert_allclose(sync.theta(0), np.mean(models, axis=0), atol=1e-6)
    [record] = records(bus, cfg, 0)
    assert [c.weight for c in record.contributors] == pytest.approx([1 / 3] * 3)
    assert "all live learners contributed" in record.reason


@pytest.mark.parametrize("rule", ["rda", "mean"])
def test_reading_ahead_on_a_worker_merges_bit_identically_to_reading_inline(rule):
    """The fetch thread (RedisBus default) and inline reads (MemoryBus, runner) decode and take
    the segment norms with the same code: the same Θ_p and momentum, bit for bit, including a
    re-anchored contribution (whose norms are recomputed by the merge)."""
    results = []
    for threads in (0, 1):
        clock = FakeClock(1000.0)
        bus = MemoryBus("t", clock=clock)
        cfg = make_config(quorum=2, merge_rule=rule, outer_momentum=0.9, wire__codec="int8")
        for learner in ("L0", "L1"):
            beat(bus, cfg, learner)
        sync = new_sync(bus, clock, cfg, fetch_threads=threads)
        assert sync.contributions._reader.threaded == bool(threads)
        rng = np.random.default_rng(5)
        fragment = sync.fragments[0].fragment
        for step, bases in enumerate([(0, 0), (1, 0), (2, 2)]):
            r = open_round(sync, clock, 0)
            for learner, base in zip(("L0", "L1"), bases, strict=True):
                delta = (rng.standard_normal(fragment.size) * 0.01).astype(np.float32)
                contribute(
                    bus,
                    cfg,
                    learner_id=learner,
                    fragment_id=0,
                    round_id=r,
                    base_version=base,
                    delta=delta,
                    n_tokens=400 + 100 * step,
                )
                sync.pump()
                if learner == "L0":  # held, its norms taken when it was decoded (RDA only)
                    [held] = sync.fragments[0].held.values()
                    if rule == "mean":
                        assert held.sq_norms is None
                    else:
                        assert held.sq_norms is not None
                        expected = segment_sq_norms(held.delta, fragment)
                        assert held.sq_norms.tobytes() == expected.tobytes()
            assert sync.versions()[0] == step + 1
        rt = sync.fragments[0]
        results.append((rt.theta.tobytes(), rt.momentum.momentum_buffer.tobytes()))
        assert [len(rec.contributors) for rec in records(bus, cfg, 0)] == [2, 2, 2]
        sync.close()
    assert results[0] == results[1]


# ── quorum and grace window ────────────────────────────────────────────────────────────────


def test_grace_window_waits_for_stragglers_then_merges(bus, clock):
    cfg = make_config(quorum=1, grace_cap_s=1.0, round_timeout_s=5.0)
    for learner in ("L0", "L1"):
        beat(bus, cfg, learner)
    sync = new_sync(bus, clock, cfg)
    r = open_round(sync, clock, 0)
    delta = np.full(size_of(cfg, 0), 0.01, np.float32)
    contribute(bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=delta)
    wake = sync.pump()
    quorum_at = clock.now()
    assert sync.versions()[0] == 0 and wake is not None and wake <= quorum_at + 1.0
    assert (
        "grace window 1 s" in sync.status()[0].reason and "waiting on L1" in sync.status()[0].reason
    )
    while clock.now() < quorum_at + 1.0 - 1e-9:
        beat(bus, cfg, "L0")
        beat(bus, cfg, "L1")
        assert sync.versions()[0] == 0
        clock.advance(0.1)
        sync.pump()
    assert sync.versions()[0] == 1
    [record] = records(bus, cfg, 0)
    assert "grace window 1 s" in record.reason and "missing L1" in record.reason
    assert record.closed_at_s - record.quorum_at_s == pytest.approx(1.0, abs=0.11)


def test_fast_path_merges_when_every_live_learner_contributed(bus, clock):
    cfg = make_config(quorum=1, grace_cap_s=2.0)
    for learner in ("L0", "L1"):
        beat(bus, cfg, learner)
    sync = new_sync(bus, clock, cfg)
    r = open_round(sync, clock, 0)
    delta = np.full(size_of(cfg, 0), 0.01, np.float32)
    for learner in ("L0", "L1"):
        contribute(
            bus, cfg, learner_id=learner, fragment_id=0, round_id=r, base_version=0, delta=delta
        )
    sync.pump()
    assert sync.versions()[0] == 1
    assert "all live learners contributed (L0, L1)" in records(bus, cfg, 0)[0].reason


def test_abandoned_round_carries_held_contributions_into_the_next(bus, clock):
    cfg = make_config(quorum=2, round_timeout_s=1.0)
    beat(bus, cfg, "L0"), beat(bus, cfg, "L1")
    sync = new_sync(bus, clock, cfg)
    delta = np.full(size_of(cfg, 0), 0.01, np.float32)
    r = open_round(sync, clock, 0)
    first = contribute(
        bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=delta
    )
    while not records(bus, cfg, 0):
        beat(bus, cfg, "L0"), beat(bus, cfg, "L1")
        clock.advance(0.1)
        sync.pump()
    [abandoned] = records(bus, cfg, 0)
    assert abandoned.decision == "abandon" and "round timeout" in abandoned.reason
    assert [(e.entry_id, e.outcome) for e in abandoned.entries] == [(first, "carried")]
    assert pending_count(bus, 0) == 1  # carried: still pending
    r2 = open_round(sync, clock, 0)
    assert r2 > r
    second = contribute(
        bus, cfg, learner_id="L1", fragment_id=0, round_id=r2, base_version=0, delta=delta
    )
    sync.pump()
    merged = records(bus, cfg, 0)[-1]
    assert merged.decision == "merge"
    assert {e.entry_id: e.outcome for e in merged.entries} == {first: "merged", second: "merged"}
    assert settled_outcomes(records(bus, cfg, 0)) == {first: ["merged"], second: ["merged"]}
    assert pending_count(bus, 0) == 0


def test_duplicates_late_stale_and_superseded_are_settled_never_merged(bus, clock):
    cfg = make_config(quorum=2, max_staleness=1, round_timeout_s=1.0)
    beat(bus, cfg, "L0"), beat(bus, cfg, "L1")
    sync = new_sync(bus, clock, cfg)
    size = size_of(cfg, 0)
    delta = np.full(size, 0.01, np.float32)
    r = open_round(sync, clock, 0)
    a = contribute(
        bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=delta
    )
    dup = contribute(
        bus, cfg, learner_id="L0", fragment_id=0, round_id=r, base_version=0, delta=delta
    )
    b = contribute(
        bus, cfg, learner_id="L1", fragment_id=0, round_id=r, base_version=0, delta=delta
    )
    sync.pump()
    assert sync.versions()[0] == 1
    again = contribute(
        bus, cfg, learner_id="L1", fragment_id=0, round_id=r, base_version=0, delta=delta
    )
    late = contribute(
        bus, cfg, learner_id="L2", fragment_id=0, round_id=r, base_version=0, delta=delta
    )
    r2 = open_round(sync, clock, 0)
    sync.pump()
    out = settled_outcomes(records(bus, cfg, 0))
    assert out[a] == ["merged"] and out[b] == ["merged"] and out[dup] == ["duplicate"]
    # versions 1 → 3 by two more merges makes a base of 0 two behind: stale
    for v in (1, 2):
        c = contribute(
            bus, cfg, learner_id="L0", fragment_id=0, round_id=r2, base_version=v, delta=delta
        )
        d = contribute(
            bus, cfg, learner_id="L1", fragment_id=0, round_id=r2, base_version=v, delta=delta
        )
        sync.pump()
        r2 = open_round(sync, clock, 0)
    stale = contribute(
        bus, cfg, learner_id="L0", fragment_id=0, round_id=r2, base_version=0, delta=delta
    )
    sync.pump()
    while pending_count(bus, 0):
        beat(bus, cfg, "L0"), beat(bus, cfg, "L1")
        clock.advance(0.1)
        sync.pump()
    out = settled_outcomes(records(bus, cfg, 0))
    assert out[again] == ["duplicate"] and out[late] == ["late"] and out[stale] == ["stale"]
    assert out[c] == out[d] == ["merged"]
    assert all(len(v) == 1 for v in out.values())


# ── invalid contributions ──────────────────────────────────────────────────────────────────


def test_invalid_contributions_are_dead_lettered_with_reasons_and_never_merged(bus, clock):
    cfg = make_config(quorum=1)
    sync = new_sync(bus, clock, cfg)
    size = size_of(cfg, 0)
    r = open_round(sync, clock, 0)
    contribute(
        bus,
        cfg,
        learner_id="L0",
        fragment_id=0,
        round_id=r,
        base_version=0,
        delta=np.empty(0),
        encoded=with_nan(size),
    )
    contribute(
        bus,
        cfg,
        learner_id="L1",
        fragment_id=0,
        round_id=r,
        base_version=0,
        delta=np.zeros(size + 1, np.float32),
    )
    contribute(
        bus,
        cfg,
        learner_id="L2",
        fragment_id=0,
        round_id=r,
        base_version=0,
        delta=np.zeros(size, np.float32),
        config_digest="other",
    )
    bus.append(bus.keys.up(0), {"m": b"\x00garbage"})
    sync.pump()
    reasons = sorted(
        e.fields["ddq.dlq.reason"].decode().split(":")[0] for e in dead_letters(bus, 0)
    )
    assert reasons == ["corrupt", "incompatible", "incompatible", "non_finite"]
    assert sync.versions()[0] == 0 and records(bus, cfg, 0) == []
    assert pending_count(bus, 0) == 0
    assert state_of(bus, cfg, 0).counters["dead_lettered"] == 4


# ── leases, takeover and crashes ───────────────────────────────────────────────────────────


def test_stale_lease_holder_cannot_commit(bus, clock):
    cfg = make_config(quorum=1, lease_ttl_s=2.0)
    a = new_sync(bus, clock, cfg, sid="sync-a")
    r = open_round(a, clock, 0)
    clock.advance(2.5)  # a stalls past its lease
    b = new_sync(bus, clock, cfg, sid="sync-b")
    assert b.owned == {0, 1}
    contribute(
        bus,
        cfg,
        learner_id="L0",
        fragment_id=0,
        round_id=r,
        base_version=0,
        delta=np.full(size_of(cfg, 0), 0.01, np.float32),
    )
    a.fragments[0].lease = dataclasses.replace(a.fragments[0].lease, expires_at_s=clock.now() + 9)
    a.pump()  # a reads the entry and tries to merge: fenced
    assert 0 not in a.owned and versions_published(bus, cfg, 0) == [0]
    assert pending_count(bus, 0) == 1  # nothing acked by the stale holder
    clock.advance(1.0)  # idle past claim_idle_ms: b reclaims a's entry
    for _ in range(20):
        b.pump()
        clock.advance(0.1)
    assert versions_published(bus, cfg, 0) == [0, 1] and pending_count(bus, 0) == 0


@pytest.mark.parametrize("point", ["after_merge", "before_commit", "before_round"])
def test_kill_before_the_commit_loses_nothing_and_applies_once(bus, clock, point):
    cfg = make_config(quorum=1)
    injector = FaultInjector("sync-0", clock=clock)
    sync = new_sync(bus, clock, cfg, injector=injector)
    r = open_round(sync, clock, 0)
    entry = contribute(
        bus,
        cfg,
        learner_id="L0",
        fragment_id=0,
        round_id=r,
        base_version=0,
        delta=np.full(size_of(cfg, 0), 0.01, np.float32),
    )
    injector.arm("kill", fault_id="k", params={"point": point})
    with pytest.raises(Killed):
        sync.pump()
    delivered = point != "before_round"  # before_round fires before the read
    assert versions_published(bus, cfg, 0) == [0] and pending_count(bus, 0) == int(delivered)
    again = new_sync(bus, clock, cfg)  # restart under the same id: re-reads its pending entries
    for _ in range(5):
        again.pump()
        clock.advance(0.05)
    assert versions_published(bus, cfg, 0) == [0, 1]
    assert settled_outcomes(records(bus, cfg, 0)) == {entry: ["merged"]}
    assert pending_count(bus, 0) == 0


def test_second_synchronizer_takes_over_after_lease_expiry(bus, clock):
    cfg = make_config(quorum=1, lease_ttl_s=2.0)
    a = new_sync(bus, clock, cfg, sid="sync-a")
    b = new_sync(bus, clock, cfg, sid="sync-b")
    assert a.owned == {0, 1} and b.owned == frozenset()
    r = open_round(a, clock, 0)
    contribute(
        bus,
        cfg,
        learner_id="L0",
        fragment_id=0,
        round_id=r,
        base_version=0,
        delta=np.full(size_of(cfg, 0), 0.01, np.float32),
    )
    a.pump()
    assert a.versions()[0] == 1
    # a dies here (no more pumps); b owns everything once the leases expire
    waited = 0.0
    while b.owned != {0, 1}:
        clock.advance(0.1)
        waited += 0.1
        b.pump()
    assert waited <= cfg.synchronizer.lease_ttl_s + 0.2
    assert b.versions() == {0: 1, 1: 0}
    np.testing.assert_array_equal(b.theta(0), latest_global(bus, cfg, 0)[1])


def test_learner_paced_mode_keeps_one_round_open_per_fragment(bus, clock):
    cfg = make_config(quorum=1, schedule="learner")
    sync = new_sync(bus, clock, cfg)
    assert {(o.fragment_id, o.round_id) for o in opened(bus, cfg)} == {(0, 0), (1, 1)}
    contribute(
        bus,
        cfg,
        learner_id="L0",
        fragment_id=1,
        round_id=1,
        base_version=0,
        delta=np.full(size_of(cfg, 1), 0.01, np.float32),
    )
    sync.pump()
    assert sync.versions() == {0: 0, 1: 1}
    assert (1, 3) in {(o.fragment_id, o.round_id) for o in opened(bus, cfg)}


def test_fragment_state_round_trips_and_refuses_a_broken_ring(bus, clock):
    cfg = make_config()
    new_sync(bus, clock, cfg)
    state = state_of(bus, cfg, 0)
    limits = cfg.wire.message_limits()
    assert FragmentState.from_bytes(state.to_bytes(), run_id="t", limits=limits) == state
    assert fragment_of(state) == plan_of(tiny_source(), cfg.synchronizer).fragments[0]
    broken = dataclasses.replace(state, version=5)  # the ring ends with version 0
    with pytest.raises(CorruptPayload, match="ring must end with version 5"):
        FragmentState.from_bytes(broken.to_bytes(), run_id="t", limits=limits)


@pytest.mark.parametrize("enabled", [False, True])
def test_fault_commands_are_obeyed_only_where_the_config_enables_them(bus, clock, enabled):
    cfg = make_config(faults__enabled=enabled)
    sync = new_sync(bus, clock, cfg, injector=FaultInjector("sync-0", clock=clock))
    for target in ("all", "synchronizer"):
        cmd = FaultCommand(
            run_id="t",
            fault_id=f"k-{target}",
            target=target,
            kind="kill",
            params={"point": "before_round"},
            duration_s=None,
            issued_at_s=0.0,
        )
        ops.send_command(bus, target, cmd.to_fields())
    if enabled:
        with pytest.raises(Killed):
            for _ in range(100):
                sync.pump()
                clock.advance(0.05)
        return
    for _ in range(100):  # as long as the kill above may take
        sync.pump()
        clock.advance(0.05)
    limits = MessageLimits()
    events = [
        Event.from_fields(e.fields, run_id="t", limits=limits) for e in bus.read(bus.keys.events())
    ]
    ignored = sorted(e.fields["fault"] for e in events if e.kind == "fault.ignored")
    assert ignored == ["k-all", "k-synchronizer"]
    assert not any(e.kind == "fault.armed" for e in events)
