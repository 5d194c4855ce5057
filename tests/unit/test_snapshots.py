"""Snapshots on disk (``synchronizer.snapshots``) and the synchronizer's restore after Redis lost
the run: real Synchronizers on MemoryBus under a FakeClock, real files in a temporary directory."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import numpy as np
import pytest

from dd_queue.bus import MemoryBus
from dd_queue.cli import main
from dd_queue.clock import FakeClock
from dd_queue.errors import ConfigError
from dd_queue.keys import SYNC_GROUP
from dd_queue.messages import Heartbeat, RoundOpen
from dd_queue.synchronizer import Synchronizer, snapshots
from tests.synchronizer_support import (
    beat,
    contribute,
    make_config,
    opened,
    records,
    tiny_source,
)

EVERY = 2


def _write(root: Path, version: int, keep: int = 3, plan: str = "plan", n: int = 4) -> None:
    snapshots.write(
        root, run_id="t", fragment_id=0, version=version,
        theta=np.full(n, version, np.float32), momentum=np.zeros(n, np.float32),
        outer_steps=version, last_merged_round_id=version * 2, plan_digest=plan,
        config_digest="cfg", keep=keep,
    )  # fmt: skip


def test_writes_are_whole_and_only_the_newest_are_kept(tmp_path: Path) -> None:
    for v in range(1, 6):
        _write(tmp_path, v)
    kept = snapshots.fragment_snapshots(tmp_path, "t", 0)
    assert [s.version for s in kept] == [3, 4, 5]
    assert not list(tmp_path.rglob("*.tmp"))
    assert sorted(p.name for p in (tmp_path / "t" / "f0").iterdir()) == [
        f"v{v}.{ext}" for v in (3, 4, 5) for ext in ("json", "safetensors")
    ]
    theta, momentum = kept[-1].load()
    assert theta.tolist() == [5.0] * 4 and momentum.tolist() == [0.0] * 4


def test_latest_skips_what_is_altered_or_of_another_plan_and_says_why(tmp_path: Path) -> None:
    _write(tmp_path, 3)
    _write(tmp_path, 4, plan="other")
    _write(tmp_path, 5)
    newest = tmp_path / "t" / "f0" / "v5.safetensors"
    newest.write_bytes(newest.read_bytes()[:-4] + b"oops")
    snap, why = snapshots.latest(
        tmp_path, run_id="t", fragment_id=0, plan_digest="plan", config_digest="cfg"
    )
    assert snap is not None and snap.version == 3
    assert "v5: v5.safetensors does not match its SHA-256" in why and "v4: another" in why
    problems = {s.version: p for s, p in snapshots.verify(tmp_path)}
    assert problems[3] is None and "SHA-256" in str(problems[5])
    with pytest.raises(ConfigError, match="SHA-256"):
        snapshots.fragment_snapshots(tmp_path, "t", 0)[-1].load()
    none, why = snapshots.latest(tmp_path, run_id="t", fragment_id=1, plan_digest="plan",
                                 config_digest="cfg")  # fmt: skip
    assert none is None and "no usable snapshot" in why


def test_the_restored_version_is_above_the_lost_tail_and_every_learner() -> None:
    assert snapshots.restored_version(10, 5, []) == 16
    assert snapshots.restored_version(10, 5, [12, 30]) == 31


def test_ddq_snapshot_ls_and_verify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _write(tmp_path, 1)
    _write(tmp_path, 2)
    assert main(["snapshot", "ls", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out.splitlines()[-1])["snapshots"]
    assert [r["version"] for r in rows] == [1, 2]
    assert main(["snapshot", "verify", str(tmp_path)]) == 0
    (tmp_path / "t" / "f0" / "v2.safetensors").unlink()
    assert main(["snapshot", "verify", str(tmp_path), "--json"]) == 1
    out = capsys.readouterr().out
    assert "v2.safetensors is missing" in out and json.loads(out.splitlines()[-1])["unusable"] == 1
    assert main(["snapshot", "ls", str(tmp_path / "nowhere")]) == 2


# ── the synchronizer: snapshots while merging, restore into an empty bus ───────────────────
def _sync(bus: MemoryBus, clock: FakeClock, root: Path) -> Synchronizer:
    cfg = make_config(snapshot_dir=str(root), snapshot_every_versions=EVERY)
    sync = Synchronizer(
        cfg, bus=bus, clock=clock, source=tiny_source(), wall=clock.now, synchronizer_id="s0"
    )
    sync.start()
    return sync


def _merge_rounds(sync: Synchronizer, bus: MemoryBus, clock: FakeClock, n: int) -> None:
    cfg = sync.ctx.cfg
    for _ in range(n):
        beat(bus, cfg, "L0")
        for _ in range(400):
            sync.pump()
            st = {s.fragment_id: s for s in sync.status()}[0]
            if st.announced:
                break
            clock.advance(0.01)
        version = sync.versions()[0]
        size = sync.theta(0).size
        contribute(
            bus, cfg, learner_id="L0", fragment_id=0, round_id=st.round_id,
            base_version=version, delta=np.full(size, 0.01, np.float32),
        )  # fmt: skip
        for _ in range(400):
            sync.pump()
            if sync.versions()[0] == version + 1:
                break
            clock.advance(0.01)
        assert sync.versions()[0] == version + 1


def _learner_holding(bus: MemoryBus, sync: Synchronizer, version: int) -> None:
    cfg = sync.ctx.cfg
    hb = Heartbeat(
        run_id=cfg.run.run_id, config_digest=cfg.run_digest, role="learner", member_id="L0",
        state="training", step=1, n_tokens=1, step_time_ema_s=0.05, versions={0: version},
        queue_depths={}, device="cpu", host=socket.gethostname(), pid=os.getpid(), sent_at_s=1.0,
    )  # fmt: skip
    bus.heartbeat("L0", hb.to_bytes(), ttl_s=cfg.membership.dead_after_s)


@pytest.mark.parametrize("learner_at", [None, 9])
def test_a_run_redis_lost_comes_back_from_its_snapshot_above_every_version_seen(
    tmp_path: Path, learner_at: int | None
) -> None:
    clock = FakeClock(1000.0)
    bus = MemoryBus("t", clock=clock)
    sync = _sync(bus, clock, tmp_path)
    _merge_rounds(sync, bus, clock, 5)  # versions 1..5: snapshots at 2 and 4
    assert [s.version for s in snapshots.fragment_snapshots(tmp_path, "t", 0)] == [0, 2, 4]
    at_4 = snapshots.fragment_snapshots(tmp_path, "t", 0)[-1]
    theta_4, momentum_4 = at_4.load()

    empty = MemoryBus("t", clock=clock)  # Redis lost every key; the learners come back to it
    if learner_at is not None:
        _learner_holding(empty, sync, learner_at)
    again = _sync(empty, clock, tmp_path)
    expected = snapshots.restored_version(4, EVERY, [] if learner_at is None else [learner_at])
    assert again.versions()[0] == expected == (7 if learner_at is None else 10)
    np.testing.assert_array_equal(again.theta(0), theta_4)  # bit for bit
    np.testing.assert_array_equal(again.fragments[0].momentum.momentum_buffer, momentum_4)
    assert again.fragments[0].momentum.step == at_4.outer_steps
    assert again.fragments[0].state.last_merged_round_id == at_4.last_merged_round_id
    assert "restored from snapshot v4" in again.fragments[0].state.last_reason
    assert snapshots.fragment_snapshots(tmp_path, "t", 0)[-1].version == expected  # bound reset
    assert again.versions()[1] == EVERY + 1  # fragment 1 never merged: back from its v0


def test_a_restored_fragment_waits_on_no_round_of_the_history_redis_lost(tmp_path: Path) -> None:
    """Found by the e2e restore: the synchronizer that lives through the loss announces fragment
    1's next round on the new Redis before it sees the loss. Fragment 0's round before it was
    announced, answered and merged in the lost history; taken as open again, it would wait out
    its round timeout for answers the learners had already sent, while fragment 1 trained on."""
    clock = FakeClock(1000.0)
    bus = MemoryBus("t", clock=clock)
    sync = _sync(bus, clock, tmp_path)
    _merge_rounds(sync, bus, clock, 5)  # the snapshot holds v4; v5's round is merged, then lost
    lost = sync.fragments[0].state.last_merged_round_id
    assert lost is not None and lost % 2 == 0
    empty = MemoryBus("t", clock=clock)
    seen = RoundOpen(
        run_id="t", fragment_id=1, round_id=lost + 1, opened_at_s=clock.now(), reason="late"
    )
    empty.append(empty.keys.opened_rounds(), seen.to_fields(), maxlen=100)
    again = _sync(empty, clock, tmp_path)
    for _ in range(400):
        st = {s.fragment_id: s for s in again.status()}[0]
        if st.announced:
            break
        again.pump()
        clock.advance(0.01)
    assert st.announced and st.round_id > lost  # a round the learners have not answered
    seen_now = {(o.fragment_id, o.round_id) for o in opened(empty, again.ctx.cfg)}
    assert (0, st.round_id) in seen_now  # and can see
    _merge_rounds(again, empty, clock, 1)  # which merges


def test_a_restored_round_whose_only_answer_is_stale_closes_at_once(tmp_path: Path) -> None:
    """Found by the e2e restore too: L0 answered fragment 0's round on the new Redis from a
    version of the lost history. The restored version is above every version a learner held,
    so the answer is stale; L0 answers a round once, so the round waits for nothing more and
    closes at once (it used to wait out its round timeout while fragment 1 trained on)."""
    clock = FakeClock(1000.0)
    bus = MemoryBus("t", clock=clock)
    sync = _sync(bus, clock, tmp_path)
    _merge_rounds(sync, bus, clock, 5)
    lost = sync.fragments[0].state.last_merged_round_id
    assert lost is not None
    empty = MemoryBus("t", clock=clock)
    cfg = sync.ctx.cfg
    seen = RoundOpen(
        run_id="t", fragment_id=0, round_id=lost + 2, opened_at_s=clock.now(), reason="late"
    )
    empty.append(empty.keys.opened_rounds(), seen.to_fields(), maxlen=100)
    beat(empty, cfg, "L0")
    contribute(
        empty, cfg, learner_id="L0", fragment_id=0, round_id=lost + 2, base_version=1,
        delta=np.full(sync.theta(0).size, 0.01, np.float32),
    )  # fmt: skip
    assert empty.read_group(empty.keys.up(0), SYNC_GROUP, "gone", count=10)  # the old owner's
    clock.advance(1.0)  # idle past claim_idle_ms: reclaimed at the take
    again = _sync(empty, clock, tmp_path)
    version = again.versions()[0]
    assert version - 1 > cfg.synchronizer.max_staleness  # restored above every held version
    for _ in range(5):
        again.pump()
        clock.advance(0.01)
    closed = [r for r in records(empty, cfg, 0) if r.round_id == lost + 2]
    assert [r.decision for r in closed] == ["abandon"], closed
    assert "every live learner answered" in closed[0].reason
    assert [e.outcome for e in closed[0].entries] == ["stale"]
    _merge_rounds(again, empty, clock, 1)  # the next round merges
