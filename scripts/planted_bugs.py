#!/usr/bin/env python3
"""Plant each known bug in a scratch copy of the checkout and check that its test fails.

    .venv/bin/python scripts/planted_bugs.py            # every bug (about 10 minutes)
    .venv/bin/python scripts/planted_bugs.py 1 4        # some of them, by number
    .venv/bin/python scripts/planted_bugs.py --json     # the table, then one JSON object

The bugs are the ones a mutation audit found the suite blind to (issue #23; docs/testing.md).
For each: copy the tree (without .venv and runs/) to a temporary directory, apply the edit,
run the test that must catch it from the copy (its services import the copy's ``dd_queue``),
and report whether it failed. Not part of CI: it runs slow e2e tests once per bug. Exit code
0 when every planted bug was caught, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Bug:
    """One planted bug: an exact edit of one file, and the tests that must fail."""

    number: int
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    count: int = 1  # occurrences of ``old`` that the edit replaces


BUGS = (
    Bug(
        1,
        "non-atomic commit: the acks leave the fenced commit, an ack follows it",
        "dd_queue/synchronizer/commit.py",
        "    bus.commit(rt.lease, commit_ops, commit_id=f\"{p}:{r}:{version}\")\n",
        "    commit_ops = [op for op in commit_ops if not isinstance(op, AckOp)]\n"
        "    bus.commit(rt.lease, commit_ops, commit_id=f\"{p}:{r}:{version}\")\n"
        "    bus.ack(bus.keys.up(p), SYNC_GROUP, list(entry_ids))\n",
        ("tests/e2e/test_synchronizer_crash.py::"
         "test_kill_dash_nine_at_random_points_loses_and_duplicates_nothing",),
    ),
    Bug(
        2,
        "lease renewal that does not extend the lease (Redis script)",
        "dd_queue/bus/_scripts.py",
        "  redis.call('PEXPIRE', KEYS[1], ARGV[2])\n  return 1\n",
        "  return 1\n",
        ("tests/integration/test_bus_contract.py::test_renewing_keeps_the_lease_past_its_first_ttl",),
    ),
    Bug(
        2,
        "lease renewal that does not extend the lease (MemoryBus)",
        "dd_queue/bus/memory.py",
        "            self._put(lease.name, lease.value.encode(), ttl_s)\n            return Lease(",
        "            return Lease(",
        ("tests/integration/test_bus_contract.py::test_renewing_keeps_the_lease_past_its_first_ttl",),
    ),
    Bug(
        3,
        "the synchronizer ignores its control stream",
        "dd_queue/synchronizer/synchronizer.py",
        "            self._commands.poll()\n",
        "            pass\n",
        ("tests/e2e/test_faults_http.py::test_synchronizer_obeys_stall_and_disconnect_from_its_control_stream",),
    ),
    Bug(
        4,
        "the dashboard's kill button also sends duration_s (422)",
        "dd_queue/control/static/dashboard.js",
        "  if (TIMED.has(kind)) body.duration_s",
        "  if (TIMED.has(kind) || kind === \"kill\") body.duration_s",
        ("tests/e2e/test_dashboard.py::test_every_control_of_the_dashboard_works_in_a_browser",),
    ),
    Bug(
        5,
        "the control plane's tail ignores eval.done",
        "dd_queue/control/tails.py",
        "            if event.kind == \"eval.done\":\n",
        "            if event.kind == \"eval.never\":\n",
        ("tests/unit/test_control_api.py::test_metrics_export_every_documented_series_with_samples",),
    ),
    Bug(
        6,
        "the delay fault does nothing",
        "dd_queue/learner/pump.py",
        "        if fault is not None and fault.kind == \"delay\":\n"
        "            self.clock.sleep(fault.number(\"delay_s\", 1.0))\n",
        "        if False:\n            pass\n",
        ("tests/e2e/test_faults_http.py::test_delay_holds_contributions_back_so_rounds_merge_without_them",),
        count=2,
    ),
    Bug(
        7,
        "momentum lost on synchronizer restart",
        "dd_queue/synchronizer/runtime.py",
        "    momentum = blobs.load_momentum(ctx.bus, state, size=fragment.size)\n",
        "    momentum = blobs.load_momentum(ctx.bus, state, size=fragment.size)\n"
        "    momentum.momentum_buffer[:] = 0.0\n",
        ("tests/e2e/test_synchronizer_crash.py::"
         "test_kill_dash_nine_at_random_points_loses_and_duplicates_nothing",),
    ),
    Bug(
        8,
        "a gap in the version sequence (every 10th merge skips a version)",
        "dd_queue/synchronizer/commit.py",
        "    t_stage, version = ctx.clock.now(), state.version + 1\n",
        "    t_stage, version = ctx.clock.now(), state.version + 1 + (state.version % 10 == 9)\n",
        ("tests/e2e/test_up_resilience.py::test_learner_sync_and_redis_crashes",),
    ),
)  # fmt: skip


def plant(bug: Bug, into: Path) -> None:
    """Copy the tree into ``into`` and apply ``bug``'s edit there."""
    shutil.copytree(ROOT, into, ignore=shutil.ignore_patterns(".venv", "runs", ".git", "*.pyc"))
    path = into / bug.path
    text = path.read_text()
    if text.count(bug.old) != bug.count:
        raise SystemExit(f"bug {bug.number}: {bug.path} no longer has the code to mutate")
    path.write_text(text.replace(bug.old, bug.new))


def caught(bug: Bug) -> tuple[bool, float]:
    """Whether the bug's tests fail in a planted copy, and how long they took (s)."""
    with tempfile.TemporaryDirectory(prefix=f"ddq-bug{bug.number}-") as tmp:
        copy = Path(tmp) / "tree"
        plant(bug, copy)
        env = {**os.environ, "PYTHONPATH": str(copy)}
        start = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *bug.tests],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
        )
        return done.returncode == 1, time.monotonic() - start  # 1: tests ran and failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("numbers", nargs="*", type=int, help="bug numbers (default: all)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    args = parser.parse_args()
    chosen = [b for b in BUGS if not args.numbers or b.number in args.numbers]
    out = sys.stdout
    out.write("| # | planted bug | test | caught | s |\n|---:|---|---|---|---:|\n")
    rows = []
    for bug in chosen:
        ok, seconds = caught(bug)
        rows.append({"bug": bug.number, "name": bug.name, "caught": ok, "seconds": seconds})
        test = bug.tests[0].split("::")[-1]
        verdict = "yes" if ok else "**NO**"
        out.write(f"| {bug.number} | {bug.name} | `{test}` | {verdict} | {seconds:.0f} |\n")
        out.flush()
    if args.json:
        out.write(json.dumps({"script": "planted_bugs", "rows": rows}) + "\n")
    return 0 if all(r["caught"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
