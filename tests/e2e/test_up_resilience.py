"""Resilience with real processes started as the Procfile starts them (``python -m services.*``
against a private redis-server with AOF): kill -9 a learner, SIGSTOP/SIGCONT another, kill -9
the synchronizer and restart it, restart Redis (AOF) gracefully and then after a kill -9 — and
training goes on (merges continue while a learner is stopped).

Checked at the end, with the learners stopped and the pending lists empty: global versions
never went down while sampled all along, and rose by exactly one per merge in the complete
record (the round records and the ``down`` stream), no contribution was settled twice,
every contribution entry is settled in a round record or dead-lettered (none lost), and the
killed learner rejoined and contributed again.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from dd_queue.bus import RedisBus
from dd_queue.config import DDQConfig, load_config
from dd_queue.errors import DDQError
from dd_queue.keys import SYNC_GROUP
from dd_queue.messages import Heartbeat, RoundRecord
from tests.bus_support import pending_ids
from tests.e2e.test_faults_http_support import write_config
from tests.integration.conftest import require_redis_server
from tests.redisproc import RedisProcess, free_port
from tests.synchronizer_support import versions_published

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
LEARNERS = ("L0", "L1", "L2")


def poll(predicate: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``predicate`` until truthy (returned); fail after the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except DDQError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.5)


class Run:
    """The processes of one run, each started as its Procfile line does."""

    def __init__(self, directory: Path, redis: RedisProcess) -> None:
        self.dir, self.redis = directory, redis
        self.config = write_config(directory / "run.yaml", redis.url, free_port(), "resil")
        raw = yaml.safe_load(self.config.read_text())
        raw["membership"]["expected_learners"] = len(LEARNERS)
        raw["synchronizer"]["sync_every_steps"] = 32  # fewer, bigger rounds: cheaper to audit
        self.config.write_text(yaml.safe_dump(raw))
        self.cfg: DDQConfig = load_config(self.config)
        self.bus = RedisBus(redis.url, "resil", options=self.cfg.redis.options())
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.max_versions: dict[int, int] = {}

    def spawn(self, name: str, module: str, *extra: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with (self.dir / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                [sys.executable, "-m", module, "--config", str(self.config), *extra],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def learner(self, lid: str) -> None:
        self.spawn(lid, "dd_queue.services.learner", "--learner-id", lid)

    def rounds(self) -> list[tuple[str, RoundRecord]]:
        limits, found = self.cfg.wire.message_limits(), []
        for p in range(self.cfg.synchronizer.n_fragments):
            for e in self.bus.read(self.bus.keys.rounds(p), count=100_000):
                found.append(
                    (e.id, RoundRecord.from_fields(e.fields, run_id="resil", limits=limits))
                )
        return found

    def merged_by(self, lid: str, exclude: frozenset[str] = frozenset()) -> bool:
        """Whether a merged round (not in ``exclude``) has ``lid`` among its contributors."""
        for name, proc in self.procs.items():
            if proc.poll() not in (None, -signal.SIGKILL):
                pytest.fail(f"{name} exited with {proc.returncode}")
        self.sample_versions()
        return any(
            r.decision == "merge" and any(c.learner_id == lid for c in r.contributors)
            for rid, r in self.rounds()
            if rid not in exclude
        )

    def sample_versions(self) -> None:
        """Check that no fragment's newest merged version went down since the last sample."""
        newest: dict[int, int] = {}
        for _, r in self.rounds():
            newest[r.fragment_id] = max(newest.get(r.fragment_id, 0), r.version_after)
        for p, v in self.max_versions.items():
            assert newest.get(p, 0) >= v, f"fragment {p}: version went down {v} → {newest}"
        self.max_versions = newest

    def beat_age(self, lid: str) -> float | None:
        for info in self.bus.heartbeats().values():
            hb = Heartbeat.from_bytes(
                info.payload, run_id="resil", limits=self.cfg.wire.message_limits()
            )
            if hb.role == "learner" and hb.member_id == lid:
                return info.age_s
        return None

    def pending_ids(self) -> set[str]:
        """Ids of every contribution entry delivered to a synchronizer and not yet acked."""
        return {
            e
            for p in range(self.cfg.synchronizer.n_fragments)
            for e in pending_ids(self.redis.url, self.bus.keys.up(p), SYNC_GROUP)
        }

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
        self.bus.close()

    def tail(self) -> str:
        return "\n".join(
            f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
            for p in sorted(self.dir.glob("*.log"))
        )


def test_learner_sync_and_redis_crashes(tmp_path: Path) -> None:
    require_redis_server()
    with RedisProcess(appendonly=True) as redis:
        run = Run(tmp_path, redis)
        try:
            _exercise(run)
            _check_invariants(run)
        except BaseException:
            sys.stderr.write(run.tail() + "\n")
            raise
        finally:
            run.close()


def _exercise(run: Run) -> None:
    run.spawn("synchronizer", "dd_queue.services.synchronizer")
    for lid in LEARNERS:
        run.learner(lid)
    poll(lambda: all(run.merged_by(x) for x in LEARNERS), 150, "every learner contributing")

    run.procs["L0"].kill()  # kill -9 a learner
    run.procs["L0"].wait()
    run.procs["L1"].send_signal(signal.SIGSTOP)
    stalled_s = run.cfg.membership.stalled_after_s
    poll(lambda: (run.beat_age("L1") or 0) > stalled_s, 30, "L1 silent while stopped")
    # merges go on without the stopped learner (and the killed one)
    before = {rid for rid, _ in run.rounds()}
    poll(lambda: run.merged_by("L2", frozenset(before)), 60, "merging while L1 is stopped")
    run.procs["L1"].send_signal(signal.SIGCONT)

    run.procs["synchronizer"].kill()  # kill -9 the synchronizer, then restart it
    run.procs["synchronizer"].wait()
    run.spawn("synchronizer", "dd_queue.services.synchronizer")
    before = {rid for rid, _ in run.rounds()}
    poll(lambda: run.merged_by("L2", frozenset(before)), 90, "merging after the restart")

    run.redis.restart(graceful=True)  # Redis restart: AOF keeps streams, groups, pending
    before = {rid for rid, _ in run.rounds()}
    poll(lambda: run.merged_by("L1", frozenset(before)), 90, "L1 merging after Redis restart")
    run.redis.restart()  # a Redis crash (kill -9): what it acknowledged is in the AOF file
    before = {rid for rid, _ in run.rounds()}
    poll(lambda: run.merged_by("L2", frozenset(before)), 90, "merging after a Redis crash")

    poll(lambda: run.beat_age("L0") is None, 30, "the dead L0's heartbeat to expire")
    before = {rid for rid, _ in run.rounds()}
    run.learner("L0")  # the killed learner rejoins
    poll(lambda: run.merged_by("L0", frozenset(before)), 120, "L0 contributing again")

    # The pending list drains: everything pending after the faults is settled while the run
    # goes on (entries are settled by a round's commit, so the run must keep merging).
    held = run.pending_ids()
    poll(lambda: not held & run.pending_ids(), 60, f"{len(held)} pending entries to settle")
    for lid in LEARNERS:
        run.procs[lid].send_signal(signal.SIGTERM)
    for lid in LEARNERS:
        assert run.procs[lid].wait(timeout=60) == 0, f"{lid} did not leave cleanly"
    # ... and once the learners have left, to empty: their last contributions merge (quorum 1)
    # or are settled, none is left pending.
    poll(lambda: not run.pending_ids(), 60, "the pending list to empty after the learners left")
    run.procs["synchronizer"].send_signal(signal.SIGTERM)
    assert run.procs["synchronizer"].wait(timeout=30) == 0


def _check_invariants(run: Run) -> None:
    run.sample_versions()
    limits = run.cfg.wire.message_limits()
    for p in range(run.cfg.synchronizer.n_fragments):
        records = [
            RoundRecord.from_fields(e.fields, run_id="resil", limits=limits)
            for e in run.bus.read(run.bus.keys.rounds(p), count=100_000)
        ]
        # The complete record (every round, every published version), so strict: one version
        # per merge, none skipped or repeated, across every crash and restart.
        versions = [r.version_after for r in records if r.decision == "merge"]
        assert versions == list(range(1, len(versions) + 1)), (
            f"fragment {p}: merged versions not 1, 2, 3, ...: {versions}"
        )
        chained = [0] + [r.version_after for r in records[:-1]]
        assert [r.version_before for r in records] == chained, (
            f"fragment {p}: a round did not start from the previous round's version"
        )
        published = versions_published(run.bus, run.cfg, p)
        assert published == list(range(len(versions) + 1)), (
            f"fragment {p}: down stream versions not 0, 1, 2, ... (one per merge): {published}"
        )
        settled: dict[str, int] = {}
        for r in records:
            for o in r.entries:
                if o.outcome != "carried":
                    settled[o.entry_id] = settled.get(o.entry_id, 0) + 1
        twice = [eid for eid, n in settled.items() if n > 1]
        assert not twice, f"fragment {p}: settled twice: {twice[:5]}"
        dlq = {
            e.fields["ddq.dlq.id"].decode()
            for e in run.bus.read(run.bus.keys.dlq(p), count=100_000)
        }
        sent = {e.id for e in run.bus.read(run.bus.keys.up(p), count=100_000)}
        held = set(pending_ids(run.redis.url, run.bus.keys.up(p), SYNC_GROUP))
        assert not held, f"fragment {p}: {len(held)} still pending"
        lost = sent - set(settled) - dlq
        assert not lost, f"fragment {p}: contributions neither settled nor dead-lettered: {lost}"
