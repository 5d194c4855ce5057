"""A run survives losing Redis entirely: snapshots on disk (``synchronizer.snapshot_dir``).

The services as ``ddq`` processes on a redis-server **without persistence**. Once the run has
merged past a few snapshots, Redis is killed (SIGKILL) and an empty one starts on the same port.
The synchronizer (still running) finds no state and restores every fragment from its newest
snapshot, above every version the learner reports. In the second case the synchronizer is
killed with Redis (one host lost) and a new process restores the run; its rounds count again
from the snapshot's, ids the learner saw in the lost history. Then:

* rounds merge again, with the learner's contributions, and none waits out its timeout: no
  fragment waits on a round of the lost history (answered and merged there already) while the
  other trains on without it;
* every version the learner applies, by its step log, is above the one before it, for each
  fragment: never backwards across the loss;
* the held-out loss goes on from where it was: the first evaluation after the restore is far
  below the untrained one, and within what was lost since the snapshot of the last one before;
* the learner kept running throughout (its inner optimizer state with it).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dd_queue.synchronizer import snapshots
from tests.e2e.services_support import Services
from tests.integration.conftest import require_redis_server
from tests.redisproc import RedisProcess

pytestmark = pytest.mark.timeout(400)

RUN = "snap"
EVERY = 4
_EVAL = re.compile(r"eval\.done loss ([0-9.]+)")


def _losses(services: Services) -> list[float]:
    return [float(x) for x in _EVAL.findall(services.log("evaluator"))]


def _applied(path: Path) -> list[tuple[int, int]]:
    """(fragment, version) pairs the learner applied, in its order."""
    pairs: list[tuple[int, int]] = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        pairs += [(int(p), int(v)) for p, v in record.get("applied", [])]
    return pairs


@pytest.mark.parametrize("with_synchronizer", [False, True], ids=["redis", "redis+synchronizer"])
def test_the_run_comes_back_from_its_snapshots_after_redis_is_lost(
    tmp_path: Path, with_synchronizer: bool
) -> None:
    """``with_synchronizer``: the synchronizer dies with Redis (one host) and a new process
    restores the run; the learner saw round ids of the lost history that the new one reuses."""
    require_redis_server()
    snaps, steps = tmp_path / "snapshots", tmp_path / "L0.jsonl"
    with RedisProcess() as redis_server:  # no AOF, no RDB: a kill loses everything
        services = Services(tmp_path, redis_server.url, run_id=RUN)
        services.env.update(
            {
                "DDQ__SYNCHRONIZER__SNAPSHOT_DIR": str(snaps),
                "DDQ__SYNCHRONIZER__SNAPSHOT_EVERY_VERSIONS": str(EVERY),
                "DDQ__LEARNER__STEP_LOG": str(steps),
                "DDQ__REDIS__UNAVAILABLE_AFTER_S": "60",
            }
        )
        try:
            for role in ("synchronizer", "evaluator", "control"):
                services.start(role)
            services.start("learner", "L0")
            services.wait_for(
                lambda: (
                    all(
                        snapshots.fragment_snapshots(snaps, RUN, p)
                        and snapshots.fragment_snapshots(snaps, RUN, p)[-1].version >= 2 * EVERY
                        for p in range(2)
                    )
                    and len(_losses(services)) >= 3
                ),
                240,
                "two snapshots of each fragment past version 0, and evaluations",
            )
            before = _losses(services)
            if with_synchronizer:
                services.procs["synchronizer"].kill()
                services.procs["synchronizer"].wait()
            redis_server.kill()
            redis_server.start()  # empty, same port
            if with_synchronizer:
                services.start("synchronizer")
            services.wait_log(
                "synchronizer", r"fragment\.restored \d+: version \d+ \(from snapshot v", 120
            )
            services.wait_for(
                lambda: services.state()["rounds_merged"] >= 4 and services.merging(("L0",)),
                240,
                "merges with L0 after the restore",
            )
            n_before = len(before)
            services.wait_for(lambda: len(_losses(services)) >= n_before + 2, 120, "evals after")
            after = _losses(services)[n_before + 1 :]  # the first may score the lost Redis
        finally:
            services.close()
    assert services.exit_codes == dict.fromkeys(services.procs, 0), services.logs()
    pairs = _applied(steps)
    for p in range(2):
        versions = [v for q, v in pairs if q == p]
        assert versions == sorted(set(versions)), f"fragment {p} went back: {versions}"
    since = services.log("synchronizer").split("fragment.restored", 1)[1]
    timed_out = re.findall(r"round\.abandoned .*: round timeout .*", since)
    assert not timed_out, timed_out
    untrained, last = before[0], before[-1]
    assert after[0] < untrained - 0.5 * (untrained - last), (before, after)
    assert after[0] < last + 0.5, (before, after)
