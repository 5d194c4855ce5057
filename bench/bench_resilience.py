"""Resilience with real processes: steady rate, slow peers, kills and restarts, timed from the
processes' own records.

    python bench/bench_resilience.py                            # all but chaos once, ~12 min
    python bench/bench_resilience.py --scenarios steady,kill-learner --repeat 3
    python bench/bench_resilience.py --smoke --json             # the CI smoke: steady, ~40 s
    python bench/bench_resilience.py --scenarios steady,hetero,kill-learner --peer torchft
    python bench/bench_resilience.py --scenarios chaos --peer torchft --json   # ~35 min
    python bench/bench_resilience.py --combine a.out b.out      # one table of earlier --json runs

Each scenario starts its own formation the way the Procfile does (``python -m dd_queue.services.*``
with one config): a private redis-server with AOF on a free loopback port, the synchronizer
(``sync-0``), the control plane, the evaluator and two learners (``OMP_NUM_THREADS=1``: one core
each on this 2-core machine, as in the torchft anchor). The model, data and optimizers are the
torchft anchor's (``../shared/anchors/torchft/RESULTS.md``): a byte-level GPT of 4 blocks × 192
(6 heads, seq 128, untied head, vocab 256), batch 16, AdamW(4e-4, wd 0.1, β 0.9/0.95), outer
Nesterov(0.7, 0.9), H = 20, one fragment; every other setting is ``config/base.yaml``'s, as a
new user gets it (K = 1 + grace, lease TTL 10 s, claim idle 30 s). Faults go through the control
plane's HTTP API (``POST /api/faults``) or a real signal (``kill -9`` by pid).

Timings come from the records the processes write, never from polling: every learner appends
one JSON line per inner step to ``learner.step_log`` (``dd_queue/learner/steplog.py``: wall and
monotonic time, pid, step; ``start`` and ``joined`` events), and the synchronizer's round records
(in Redis, written inside each round's commit) carry each round's close time in wall time (the
step records' ``t``; one host, one clock) and every settled entry. The bench polls only to
decide *when* to inject a fault or to stop.

Scenarios (``--scenarios``, comma-separated):

* ``steady``: two plain training processes (the same ``InnerLoop``, model, data and thread
  count, no bus) run side by side, then the formation; each learner's steps/s from its step 20
  to its last, against the plain pair's in the same invocation. The CPU time of every other
  process in that window (synchronizer with its fetch processes, evaluator, control plane,
  Redis) is read from ``/proc`` and reported as a share of the machine.
* ``hetero``: L1 slowed 1.5× and then 2× (a ``slow`` fault: it sleeps (factor − 1) × its
  compute time after every step, as the anchor's slow replica does); L0's steps/s against its
  steady rate, and the share of merged rounds each learner contributed to.
* ``kill-learner``: kill -9 of L1 during inner steps (at a seeded phase of the sync period),
  and a ``kill`` fault at ``before_publish`` (the learner dies holding a contribution); the bench
  relaunches it at once. Reported: the survivor's longest inner-step gap against its median
  step, inner steps discarded (a learner's step counter going back; the victim's steps since its
  last contribution are lost compute and reported apart), and relaunch → first merged
  contribution of the new process, split into process start (launch → its ``start`` line),
  join (→ ``joined``) and first contribution (→ the close of the first merged round holding an
  entry it sent).
* ``kill-sync``: kill -9 of the synchronizer during a run (restarted at once, same id), a
  ``kill`` fault at ``after_merge`` (between merge and commit; restarted at once), and kill -9
  with a standby synchronizer (``sync-1``) already running and the dead one never restarted.
  Reported: the learners' longest inner-step gap, kill → next merged round, and from the round
  records and streams after the learners stop and the pending list drains: entries settled
  twice, merged twice, and lost (neither settled nor dead-lettered). All three must be 0.
* ``redis``: kill -9 of redis-server and a restart on the same port from its AOF; the learners'
  longest gap and Redis back → next merged round.

``--peer torchft`` runs torchft's side of every scenario it has a part in (steady, hetero,
kill-learner, chaos; it has no synchronizer and no broker) right after ours, in a venv the bench
creates (``bench/peer_torchft.py``: ``torch==2.13.0``, ``torchft==0.2.0`` and this dd_queue, so
its replicas train the same model, shard and ``InnerLoop``), and prints both systems side by side
with ratios; torchft's steady rate is set against the same plain pair. Where the peer cannot be
installed the bench says why and runs our side. Without it, the table quotes the torchft
anchor's figures (``../shared/anchors/torchft/``, measured on this machine kind).

* ``chaos``: a seeded schedule (``bench/chaos_schedule.py``: 20 learner kills, 5 synchronizer
  kills, 10 stalls and 6 2× slowdowns over ``--chaos-s`` = 600 s (the stalls and slowdowns scale
  with ``--chaos-s``; the kills are ``--chaos-kills``, ``--chaos-sync-kills``), all by signal;
  kills relaunched at once), run twice on the same schedule: ``decoupled`` (the config's K = 1 +
  grace) and ``synchronous`` (K = M = 2). Reported: goodput (useful steps ÷ what the plain pair
  computes in the same time), uptime, kills survived, unexpected exits, windows of two round
  times without a merge, the exactly-once audit, and the held-out loss (``eval.done`` every 20
  s) at equal wall time and at equal tokens computed. With ``--peer torchft`` the same schedule
  runs a third time on torchft (``peer_torchft.chaos``: replica kills, its lighthouse killed and
  restarted at the synchronizer kills' times, the same signals), whose replicas save the global
  model after a commit every 20 s for the same held-out scoring afterwards.
``--json`` prints one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script: find tests/

TOKEN = "bench-resilience-admin-token"
LEARNERS = ("L0", "L1")
WARM_STEP = 20
TORCHFT = {  # ../shared/anchors/torchft/RESULTS.md, rerun 2026-12-01 (same machine kind)
    "plain_steps_per_s": 2.84,
    "steady_steps_per_s": 2.89,
    "hetero_1.5_fast_ratio": 0.674,
    "hetero_2_fast_ratio": 0.487,
    "kill_survivor_gap_s": 2.48,
    "kill_survivor_stall_s": 5.26,
    "kill_mid_allreduce_steps_discarded": 20,
    "relaunch_to_commit_s": 12.58,
}


# ── records (pure) ─────────────────────────────────────────────────────────────────────────
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of ``path`` (a torn last line after kill -9 is skipped)."""
    out: list[dict[str, Any]] = []
    with contextlib.suppress(FileNotFoundError), path.open(encoding="utf-8") as f:
        for line in f:
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def by_pid(records: Iterable[Mapping[str, Any]]) -> dict[int, list[Mapping[str, Any]]]:
    """The records of each process (incarnation), in order of first appearance."""
    out: dict[int, list[Mapping[str, Any]]] = {}
    for r in records:
        out.setdefault(int(r["pid"]), []).append(r)
    return out


def steps(records: Iterable[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """The ``step`` records."""
    return [r for r in records if r["ev"] == "step"]


def rate(records: Sequence[Mapping[str, Any]], warm: int = WARM_STEP) -> float | None:
    """Steps/s of one process from the end of its step ``warm`` to its last step."""
    trained = steps(records)
    start = next((r for r in trained if r["step"] >= warm), None)
    if start is None or trained[-1] is start:
        return None
    return (trained[-1]["step"] - start["step"]) / (trained[-1]["t"] - start["t"])


def step_gaps(records: Sequence[Mapping[str, Any]]) -> list[tuple[float, float]]:
    """(end time, gap) between consecutive steps of one process (wall seconds)."""
    trained = steps(records)
    return [(b["t"], b["t"] - a["t"]) for a, b in itertools.pairwise(trained)]


def longest_gap(records: Sequence[Mapping[str, Any]], lo: float, hi: float) -> float:
    """The longest gap between two steps of one process that ends within [lo, hi], counting the
    open gap at ``hi`` when no step came since (a learner that stopped stepping)."""
    inside = [gap for end, gap in step_gaps(records) if lo <= end <= hi]
    trained = [r for r in steps(records) if r["t"] <= hi]
    tail = hi - trained[-1]["t"] if trained else 0.0
    return max([*inside, tail])


def median_step(records: Sequence[Mapping[str, Any]]) -> float:
    """The median gap between two steps of one process."""
    gaps = [gap for _, gap in step_gaps(records)]
    return statistics.median(gaps) if gaps else float("nan")


def discarded_steps(records: Sequence[Mapping[str, Any]]) -> int:
    """Inner steps one process threw away: how far its step counter ever went back."""
    lost, top = 0, 0
    for r in steps(records):
        if r["step"] <= top:
            lost += top - r["step"] + 1
        top = max(top, r["step"])
    return lost


def entry_ms(entry_id: str) -> int:
    """The Redis server time (ms) in a stream entry id ``<ms>-<seq>``."""
    return int(entry_id.split("-", 1)[0])


def merged(rounds: Iterable[Any]) -> list[Any]:
    """Merged rounds, by close time."""
    return sorted((r for r in rounds if r.decision == "merge"), key=lambda r: r.closed_at_s)


def first_merge_after(rounds: Iterable[Any], at: float) -> Any | None:
    """The first merged round that closed after wall time ``at``."""
    return next((r for r in merged(rounds) if r.closed_at_s > at), None)


def first_contribution(rounds: Iterable[Any], learner: str, sent_after_ms: float) -> Any | None:
    """The first merged round holding an entry of ``learner`` sent after ``sent_after_ms``."""
    for r in merged(rounds):
        for o in r.entries:
            mine = o.learner_id == learner and o.outcome == "merged"
            if mine and entry_ms(o.entry_id) >= sent_after_ms:
                return r
    return None


def round_share(rounds: Iterable[Any], learner: str, lo: float, hi: float) -> float | None:
    """The share of merged rounds closed within [lo, hi] that ``learner`` contributed to."""
    inside = [r for r in merged(rounds) if lo <= r.closed_at_s <= hi]
    if not inside:
        return None
    return sum(any(c.learner_id == learner for c in r.contributors) for r in inside) / len(inside)


class Tally:
    """Settlements and merges per entry id, fed round records as they are read (a soak reads
    them while the streams are trimmed behind it)."""

    def __init__(self) -> None:
        self.settled: dict[str, int] = {}
        self.merges: dict[str, int] = {}

    def add(self, rounds: Iterable[Any]) -> None:
        for r in rounds:
            for o in r.entries:
                if o.outcome != "carried":
                    self.settled[o.entry_id] = self.settled.get(o.entry_id, 0) + 1
                if o.outcome == "merged":
                    self.merges[o.entry_id] = self.merges.get(o.entry_id, 0) + 1

    def audit(self, sent: set[str], dead_lettered: set[str], pending: set[str]) -> dict[str, int]:
        """Entries settled twice, merged twice, and lost (sent, neither settled, dead-lettered
        nor still pending)."""
        return {
            "settled_twice": sum(n > 1 for n in self.settled.values()),
            "merged_twice": sum(n > 1 for n in self.merges.values()),
            "lost": len(sent - self.settled.keys() - dead_lettered - pending),
            "pending": len(pending),
            "sent": len(sent),
        }


def audit(
    rounds: Iterable[Any], sent: set[str], dead_lettered: set[str], pending: set[str]
) -> dict[str, int]:
    """:meth:`Tally.audit` over the round records of one fragment."""
    tally = Tally()
    tally.add(rounds)
    return tally.audit(sent, dead_lettered, pending)


def spread(values: Sequence[float | None]) -> dict[str, float | None]:
    """Median, min and max of the measured values (None where nothing was measured)."""
    got = [v for v in values if v is not None]
    if not got:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": statistics.median(got), "min": min(got), "max": max(got), "n": len(got)}


# ── CPU time from /proc ────────────────────────────────────────────────────────────────────
_TICK = os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(c) for c in f.read().split()]
    return out


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its live descendants (0 once gone)."""
    total = 0.0
    with contextlib.suppress(OSError, IndexError, ValueError):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / _TICK
    for child in _children(pid):
        total += cpu_seconds(child)
    return total


# ── the formation ──────────────────────────────────────────────────────────────────────────
def run_config(
    work: Path,
    redis_url: str,
    port: int,
    args: argparse.Namespace,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """The run's config file (see the module doc), with ``overrides`` per section."""
    import yaml

    raw: dict[str, Any] = {
        "extends": str(ROOT / "config" / "base.yaml"),
        "run": {"run_id": "resil", "seed": args.seed},
        "redis": {"url": redis_url, "rounds_maxlen": 1_000_000},  # the audit reads every record
        "model": {
            "preset": "gpt-tiny",
            "n_layers": args.layers,
            "d_model": args.width,
            "n_heads": args.width // 32,
            "seq_len": 128,
            "vocab_size": 256,
            "tie_embeddings": False,
        },
        "data": {"source": "stdlib-text", "batch_size": args.batch, "max_bytes": 1 << 20},
        "learner": {
            "inner_lr": 4e-4,
            "weight_decay": 0.1,
            "adam_beta1": 0.9,
            "adam_beta2": 0.95,
            "device": "cpu",
            "step_log": str(work / "steps" / "{learner_id}.jsonl"),
        },
        "synchronizer": {"n_fragments": args.fragments, "sync_every_steps": args.h},
        "membership": {"expected_learners": len(LEARNERS)},
        "control": {"port": port, "admin_token": TOKEN},
        "faults": {"enabled": True},
    }
    for section, values in (overrides or {}).items():
        raw[section] = {**raw.get(section, {}), **values}
    path = work / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


class Processes:
    """Named child processes, their launch times and their step logs under ``work/steps``."""

    def __init__(self, work: Path) -> None:
        self.work = work
        (work / "steps").mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.launched: dict[str, float] = {}  # name → wall time of its latest launch

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def popen(self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        """Start ``argv`` as ``name`` (one thread for torch), output in ``work/name.log``."""
        full = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
        with (self.work / f"{name}.log").open("ab") as log:
            self.procs[name] = subprocess.Popen(
                list(argv), cwd=ROOT, env=full, stdout=log, stderr=subprocess.STDOUT
            )
        self.launched[name] = time.time()

    def kill(self, name: str) -> float:
        """kill -9 ``name`` (and its children, as a dead host takes them); returns the time."""
        proc = self.procs[name]
        family = [proc.pid, *_children(proc.pid)]
        at = time.time()
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()
        return at

    def records(self, lid: str) -> list[dict[str, Any]]:
        return read_jsonl(self.work / "steps" / f"{lid}.jsonl")

    def incarnation(self, lid: str, index: int = -1) -> list[Mapping[str, Any]]:
        """The records of one process of ``lid`` (default: the latest)."""
        procs = list(by_pid(self.records(lid)).values())
        return procs[index] if procs else []

    def step_of(self, lid: str) -> int:
        trained = steps(self.incarnation(lid))
        return trained[-1]["step"] if trained else -1

    def wait(self, what: str, predicate: Callable[[], Any], timeout_s: float) -> Any:
        """Poll ``predicate`` (orchestration only, never a timing) until truthy; a process
        that exits with an error (not 0, not kill -9) meanwhile is an error."""
        deadline = time.time() + timeout_s
        while True:
            with contextlib.suppress(Exception):
                if value := predicate():
                    return value
            for name, proc in self.procs.items():
                if proc.poll() not in (None, 0, -signal.SIGKILL, 137):
                    raise RuntimeError(
                        f"{name} exited with {proc.returncode} while waiting for {what}; "
                        f"see {self.work / (name + '.log')}"
                    )
            if time.time() > deadline:
                raise TimeoutError(f"no {what} within {timeout_s:g} s; logs in {self.work}")
            time.sleep(0.2)

    def wait_exit(self, names: Sequence[str], timeout_s: float) -> None:
        deadline = time.time() + timeout_s
        for name in names:
            left = max(0.1, deadline - time.time())
            try:
                self.procs[name].wait(timeout=left)
            except subprocess.TimeoutExpired as exc:
                raise TimeoutError(f"{name} did not finish within {timeout_s:g} s") from exc

    def close(self) -> None:
        """SIGTERM every live process; kill -9 what has not exited 20 s later."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 20.0
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Formation(Processes):
    """Redis, synchronizer(s), control plane, evaluator and two learners as real processes."""

    def __init__(
        self,
        work: Path,
        args: argparse.Namespace,
        *,
        evaluator: bool = True,
        max_steps: int = 0,
        overrides: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        from dd_queue.bus import RedisBus
        from dd_queue.config import load_config
        from tests.redisproc import RedisProcess, free_port

        super().__init__(work)
        self.redis = RedisProcess(appendonly=True).start()
        self.port = free_port()
        self.config = run_config(work, self.redis.url, self.port, args, overrides)
        self.cfg = load_config(self.config)
        self.bus = RedisBus(self.redis.url, "resil", options=self.cfg.redis.options())
        self.max_steps = max_steps
        self.evaluator = evaluator

    def __enter__(self) -> Formation:
        self.spawn("synchronizer", "dd_queue.services.synchronizer")
        self.spawn("control", "dd_queue.services.control_plane")
        if self.evaluator:
            self.spawn("evaluator", "dd_queue.cli", "evaluator", first=True)
        for lid in LEARNERS:
            self.learner(lid)
        return self

    def spawn(self, name: str, module: str, *extra: str, first: bool = False) -> None:
        """Start ``python -m module [extra...] --config run.yaml`` (``first``: the subcommand
        goes before ``--config``)."""
        env = {"DDQ__LEARNER__MAX_STEPS": str(self.max_steps)} if self.max_steps else {}
        args = [*extra, "--config", str(self.config)] if first else ["--config", str(self.config)]
        if not first:
            args += list(extra)
        self.popen(name, [sys.executable, "-m", module, *args], env)

    def learner(self, lid: str) -> None:
        self.spawn(lid, "dd_queue.services.learner", "--learner-id", lid)

    def synchronizer(self, sync_id: str = "sync-0") -> None:
        name = "synchronizer" if sync_id == "sync-0" else sync_id
        self.spawn(name, "dd_queue.services.synchronizer", "--id", sync_id)

    def rounds(self) -> list[Any]:
        from dd_queue.messages import RoundRecord

        limits, found = self.cfg.wire.message_limits(), []
        for p in range(self.cfg.synchronizer.n_fragments):
            for e in self.bus.read(self.bus.keys.rounds(p), count=1_000_000):
                found.append(RoundRecord.from_fields(e.fields, run_id="resil", limits=limits))
        return found

    def fault(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST /api/faults (the admin token); raises on an error status."""
        import httpx

        reply = httpx.post(
            f"http://127.0.0.1:{self.port}/api/faults",
            json=dict(body),
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=10.0,
        )
        if reply.status_code >= 300:
            raise RuntimeError(f"POST /api/faults {body}: {reply.status_code} {reply.text}")
        return dict(reply.json())

    def stop_learners(self) -> None:
        for lid in LEARNERS:
            if self.procs[lid].poll() is None:
                self.procs[lid].send_signal(signal.SIGTERM)
        self.wait_exit(LEARNERS, 60.0)

    def audit(self) -> dict[str, int]:
        """Settled/merged twice and lost entries over every fragment, once the synchronizer has
        settled what the stopped learners sent (waits ≤ 60 s for the pending list to empty)."""
        from dd_queue.keys import SYNC_GROUP
        from tests.bus_support import pending_ids

        def drained() -> bool:
            return all(
                not pending_ids(self.redis.url, self.bus.keys.up(p), SYNC_GROUP)
                for p in range(self.cfg.synchronizer.n_fragments)
            )

        with contextlib.suppress(TimeoutError):
            self.wait("an empty pending list", drained, 60.0)
        rounds, totals = self.rounds(), {}
        for p in range(self.cfg.synchronizer.n_fragments):
            dlq = {
                e.fields["ddq.dlq.id"].decode()
                for e in self.bus.read(self.bus.keys.dlq(p), count=1_000_000)
            }
            sent = {e.id for e in self.bus.read(self.bus.keys.up(p), count=1_000_000)}
            held = set(pending_ids(self.redis.url, self.bus.keys.up(p), SYNC_GROUP))
            mine = [r for r in rounds if r.fragment_id == p]
            for key, n in audit(mine, sent, dlq, held).items():
                totals[key] = totals.get(key, 0) + n
        return totals

    def close(self) -> None:
        super().close()
        self.bus.close()
        self.redis.close()


class CpuSampler:
    """CPU seconds of named pids, sampled at the moments the caller asks for."""

    def __init__(self, pids: Callable[[], Mapping[str, int]]) -> None:
        self.pids = pids

    def sample(self) -> tuple[float, dict[str, float]]:
        return time.time(), {name: cpu_seconds(pid) for name, pid in self.pids().items()}


# ── the plain baseline ─────────────────────────────────────────────────────────────────────
def training_parts(config: str, learner_id: str, log_path: str) -> tuple[Any, Any, Any, Any]:
    """(cfg, inner loop, batch iterator, step log) of one training process: the learner's model,
    shard, ``InnerLoop`` and thread count, no bus. The plain baseline and the torchft peer's
    worker (``bench/peer_torchft.py``) both train exactly these."""
    import torch

    from dd_queue.config import load_config
    from dd_queue.learner.build import build_loader_for
    from dd_queue.learner.dist import SingleProcess
    from dd_queue.learner.inner import InnerLoop, autocast_dtype, grad_scaler
    from dd_queue.learner.steplog import StepLog
    from dd_queue.models.builder import build

    cfg = load_config(config)
    device = torch.device("cpu")
    log = StepLog(log_path, learner_id=learner_id, loss_every=cfg.tracking.every_steps)
    log.write("start", learner=learner_id)
    model = build(cfg.model.architecture(), seed=cfg.run.seed, device=device)
    loader = build_loader_for(cfg, learner_id, SingleProcess())
    compute = autocast_dtype(device, cfg.model.autocast)
    inner = InnerLoop(
        model,
        forward=model,
        cfg=cfg.learner,
        device=device,
        autocast=compute,
        scaler=grad_scaler(device, compute),
    )
    return cfg, inner, loader, log


def plain_worker(config: str, learner_id: str, n_steps: int, log_path: str) -> int:
    """One plain training process (``training_parts``, no bus, no pump threads); one step line
    per step in the learner's step-log format."""
    from dd_queue.learner.inner import count_tokens

    cfg, inner, loader, log = training_parts(config, learner_id, log_path)
    log.joined(0, {})
    tokens = 0
    for _ in range(n_steps):
        batches = [next(loader) for _ in range(cfg.learner.grad_accum_steps)]
        loss, _lr = inner.train_step(batches)
        tokens += sum(count_tokens(b) for b in batches)
        step = inner.step_count
        log.step(
            step,
            tokens=tokens,
            loss=float(loss) if log.wants_loss(step) else None,
            applied=(),
            snapshots=(),
        )
    log.close()
    return 0


def plain_pair(work: Path, config: Path, n_steps: int) -> dict[str, float | None]:
    """Two plain processes side by side; steps/s of each from step 20 to its last."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs, logs = [], []
    for lid in LEARNERS:
        log = work / "plain" / f"{lid}.jsonl"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.unlink(missing_ok=True)
        logs.append(log)
        with (work / "plain" / f"{lid}.out").open("ab") as out:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--plain-worker",
                        str(config),
                        lid,
                        str(n_steps),
                        str(log),
                    ],
                    cwd=ROOT,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            )
    for proc, lid in zip(procs, LEARNERS, strict=True):
        if proc.wait(timeout=900) != 0:
            raise RuntimeError(f"plain worker {lid} exited {proc.returncode}; see {work}/plain")
    return {lid: rate(read_jsonl(log)) for lid, log in zip(LEARNERS, logs, strict=True)}


# ── scenarios ──────────────────────────────────────────────────────────────────────────────
def scenario_steady(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Plain pair, then the formation to ``args.steps`` steps per learner."""
    from tests.redisproc import free_port

    config = run_config(work, "redis://127.0.0.1:1/0", free_port(), args)
    plain = plain_pair(work, config, args.steps)
    with Formation(work / "run", args, max_steps=args.steps) as f:
        sampler = CpuSampler(
            lambda: {
                **{n: p.pid for n, p in f.procs.items()},
                "redis": f.redis.pid or 0,
            }
        )
        f.wait(
            f"step {WARM_STEP} on both learners",
            lambda: all(f.step_of(lid) >= WARM_STEP for lid in LEARNERS),
            300,
        )
        before = sampler.sample()
        last_before: dict[str, float] = dict(before[1])
        t_last = before[0]
        # learners exit at max_steps; sample just before the first exits
        while all(f.procs[lid].poll() is None for lid in LEARNERS):
            last = sampler.sample()
            if all(f.procs[lid].poll() is None for lid in LEARNERS):
                last_before = dict(last[1])
                t_last = last[0]
            time.sleep(0.5)
        f.wait_exit(LEARNERS, 300)
        rates = {lid: rate(f.incarnation(lid)) for lid in LEARNERS}
        window = max(1e-9, t_last - before[0])
        cpu_share = {
            name: (last_before[name] - before[1].get(name, 0.0)) / (window * (os.cpu_count() or 1))
            for name in last_before
        }
        rounds = merged(f.rounds())
    ours = [v for v in rates.values() if v is not None]
    base = [v for v in plain.values() if v is not None]
    ratio = statistics.mean(ours) / statistics.mean(base) if ours and base else None
    return {
        "plain_steps_per_s": plain,
        "learner_steps_per_s": rates,
        "ratio": ratio,
        "cpu_share": cpu_share,
        "merged_rounds": len(rounds),
        "contributors_per_round": (
            statistics.mean(len(r.contributors) for r in rounds) if rounds else None
        ),
    }


def scenario_hetero(work: Path, args: argparse.Namespace, factor: float) -> dict[str, Any]:
    """L1 slowed by ``factor``; L0 runs ``args.steps`` steps."""
    with Formation(work, args) as f:
        f.wait("L1 joined", lambda: any(r["ev"] == "joined" for r in f.records("L1")), 300)
        f.fault({"target": "L1", "kind": "slow", "factor": factor, "duration_s": 3600})
        f.wait(f"L0 at step {args.steps}", lambda: f.step_of("L0") >= args.steps, 900)
        l0, l1 = f.incarnation("L0"), f.incarnation("L1")
        warm = next(r for r in steps(l0) if r["step"] >= WARM_STEP)["t"]
        end = steps(l0)[-1]["t"]
        rounds = f.rounds()
    return {
        "factor": factor,
        "fast_steps_per_s": rate(l0),
        "slow_steps_per_s": rate(l1),
        "fast_round_share": round_share(rounds, "L0", warm, end),
        "slow_round_share": round_share(rounds, "L1", warm, end),
    }


def _relaunch_split(
    f: Formation, lid: str, launched: float, timeout_s: float
) -> dict[str, float | None]:
    """Launch → start line → joined line → first merged round with an entry of the new
    process (wall seconds), for the newest incarnation of ``lid``."""

    def joined() -> Mapping[str, Any] | None:
        newest = f.incarnation(lid)
        return next((r for r in newest if r["ev"] == "joined" and r["t"] >= launched), None)

    join = f.wait(f"{lid} rejoined", joined, timeout_s)
    start = next(r for r in f.incarnation(lid) if r["ev"] == "start")
    first = f.wait(
        f"a merged contribution of the relaunched {lid}",
        lambda: first_contribution(f.rounds(), lid, join["t"] * 1000.0),
        timeout_s,
    )
    return {
        "process_start_s": start["t"] - launched,
        "join_s": join["t"] - start["t"],
        "first_contribution_s": first.closed_at_s - join["t"],
        "relaunch_to_merged_s": first.closed_at_s - launched,
        "resumed_at_step": join["step"],
    }


def scenario_kill_learner(work: Path, args: argparse.Namespace, how: str) -> dict[str, Any]:
    """Kill L1 (``signal``: kill -9 at a seeded phase; ``publish``: a kill fault at
    ``before_publish``), relaunch at once, follow it to its first merged contribution."""
    rng = random.Random(args.seed)
    with Formation(work, args) as f:
        f.wait(
            "both learners past step 40",
            lambda: all(f.step_of(lid) >= 40 for lid in LEARNERS),
            300,
        )
        victim_before = f.incarnation("L1")
        if how == "signal":
            # a seeded point of the sync period, in steps
            target = f.step_of("L1") + 1 + rng.randrange(args.h)
            f.wait(f"L1 at step {target}", lambda: f.step_of("L1") >= target, 120)
            killed_at = f.kill("L1")
        else:
            f.fault({"target": "L1", "kind": "kill", "point": "before_publish"})
            f.wait("L1 killed", lambda: f.procs["L1"].poll() is not None, 120)
            killed_at = max(r["t"] for r in f.incarnation("L1"))
        victim_before = f.incarnation("L1")
        f.learner("L1")
        launched = f.launched["L1"]
        split = _relaunch_split(f, "L1", launched, 180)
        settle = time.time() + 5.0
        f.wait("5 s after the first contribution", lambda: time.time() >= settle, 30)
        survivor = f.incarnation("L0")
        end = time.time()
        gap = longest_gap(survivor, killed_at, end)
        med = median_step(survivor)
        last_snapshot = max(
            (r["step"] for r in steps(victim_before) if r.get("snapshots")), default=0
        )
        lost = (steps(victim_before)[-1]["step"] - last_snapshot) if steps(victim_before) else 0
        resume = first_merge_after(f.rounds(), killed_at)
    return {
        "how": how,
        "survivor_longest_gap_s": gap,
        "survivor_median_step_s": med,
        "gap_over_median": gap / med,
        "survivor_steps_discarded": discarded_steps(survivor),
        "victim_steps_since_last_contribution": lost,
        "kill_to_next_merge_s": None if resume is None else resume.closed_at_s - killed_at,
        **split,
    }


def scenario_kill_sync(work: Path, args: argparse.Namespace, how: str) -> dict[str, Any]:
    """Kill the synchronizer (``signal``, ``after_merge`` or ``standby``) and follow the next
    merges; audit the rounds once the learners stop."""
    with Formation(work, args) as f:
        if how == "standby":
            f.synchronizer("sync-1")
        f.wait(
            "3 merged rounds with both learners training",
            lambda: all(f.step_of(lid) >= 30 for lid in LEARNERS) and len(merged(f.rounds())) >= 3,
            300,
        )
        if how == "after_merge":
            count = len(merged(f.rounds()))
            f.fault({"target": "synchronizer", "kind": "kill", "point": "after_merge"})
            f.wait(
                "the synchronizer killed", lambda: f.procs["synchronizer"].poll() is not None, 120
            )
            killed_at = time.time()  # the exit is seen ≤ 0.2 s after it happens
            assert len(merged(f.rounds())) == count, "a round committed after the kill point"
        else:
            killed_at = f.kill("synchronizer")
        if how != "standby":
            f.synchronizer()
        resume = f.wait(
            "a merge after the kill", lambda: first_merge_after(f.rounds(), killed_at), 120
        )
        after = len([r for r in merged(f.rounds()) if r.closed_at_s > killed_at])
        f.wait(
            "3 more merged rounds",
            lambda: len([r for r in merged(f.rounds()) if r.closed_at_s > killed_at]) >= after + 2,
            120,
        )
        end = time.time()
        gaps = {lid: longest_gap(f.incarnation(lid), killed_at, end) for lid in LEARNERS}
        meds = {lid: median_step(f.incarnation(lid)) for lid in LEARNERS}
        f.stop_learners()
        checked = f.audit()
    worst = max(LEARNERS, key=lambda lid: gaps[lid] / meds[lid])
    return {
        "how": how,
        "learners_longest_gap_s": gaps[worst],
        "learners_median_step_s": meds[worst],
        "gap_over_median": gaps[worst] / meds[worst],
        "kill_to_next_merge_s": resume.closed_at_s - killed_at,
        "lease_ttl_s": f.cfg.synchronizer.lease_ttl_s,
        **checked,
    }


def scenario_redis(work: Path, args: argparse.Namespace) -> dict[str, Any]:
    """kill -9 redis-server, restart it from its AOF; follow the learners and the next merge."""
    with Formation(work, args) as f:
        f.wait(
            "3 merged rounds with both learners training",
            lambda: all(f.step_of(lid) >= 30 for lid in LEARNERS) and len(merged(f.rounds())) >= 3,
            300,
        )
        killed_at = time.time()
        f.redis.restart()
        back_at = time.time()
        resume = f.wait(
            "a merge after Redis is back", lambda: first_merge_after(f.rounds(), back_at), 180
        )
        settle = time.time() + 5.0
        f.wait("5 s more", lambda: time.time() >= settle, 30)
        end = time.time()
        gaps = {lid: longest_gap(f.incarnation(lid), killed_at, end) for lid in LEARNERS}
        meds = {lid: median_step(f.incarnation(lid)) for lid in LEARNERS}
    worst = max(LEARNERS, key=lambda lid: gaps[lid] / meds[lid])
    return {
        "learners_longest_gap_s": gaps[worst],
        "learners_median_step_s": meds[worst],
        "gap_over_median": gaps[worst] / meds[worst],
        "redis_down_s": back_at - killed_at,
        "back_to_next_merge_s": resume.closed_at_s - back_at,
    }


_PLAIN: dict[str, dict[str, float | None]] = {}  # the plain pair's steps/s, once per work dir


def _plain_rates(work: Path, args: argparse.Namespace) -> dict[str, float | None]:
    """The plain pair's steps/s for the chaos runs' fault-free reference (measured once)."""
    from tests.redisproc import free_port

    if str(work) not in _PLAIN:
        work.mkdir(parents=True, exist_ok=True)
        config = run_config(work, "redis://127.0.0.1:1/0", free_port(), args)
        _PLAIN[str(work)] = plain_pair(work, config, args.steps)
    return _PLAIN[str(work)]


def _signals(f: Processes, events: Sequence[Any], t0: float, done: threading.Event) -> None:
    """Apply the schedule's stalls and slowdowns with SIGSTOP/SIGCONT
    (``chaos_schedule.stopped_at``), every 10 ms, to whichever process each learner id is now;
    SIGCONT to all at the end."""
    import chaos_schedule as ch

    stalls: dict[str, list[tuple[float, float]]] = {lid: [] for lid in LEARNERS}
    slows: dict[str, list[tuple[float, float, float]]] = {lid: [] for lid in LEARNERS}
    for e in events:
        a, b = t0 + e.at_s, t0 + e.at_s + e.duration_s
        if e.kind == "stall":
            stalls[e.target].append((a, b))
        elif e.kind == "slow":
            slows[e.target].append((a, b, e.factor))
    stopped: dict[int, bool] = {}
    while not done.is_set():
        now = time.time()
        for lid in LEARNERS:
            proc = f.procs[lid]
            want = proc.poll() is None and ch.stopped_at(now, stalls[lid], slows[lid])
            if stopped.get(proc.pid, False) != want:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGSTOP if want else signal.SIGCONT)
                stopped[proc.pid] = want
        done.wait(0.01)
    for pid, was in stopped.items():
        if was:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


def _supervise_until(
    f: Processes,
    deadline: float,
    exits: list[dict[str, Any]],
    restart: Mapping[str, Callable[[], None]],
) -> None:
    """Sleep until ``deadline``, relaunching (as a supervisor would: ``restart``) and recording
    any process that exits on its own: those are failures to survive, counted."""
    while time.time() < deadline:
        for name, proc in list(f.procs.items()):
            rc = proc.poll()
            if rc is None or rc == -signal.SIGKILL or any(x["pid"] == proc.pid for x in exits):
                continue
            exits.append({"name": name, "pid": proc.pid, "rc": rc, "t": time.time()})
            if name in restart:
                restart[name]()
        time.sleep(0.2)


def drive_chaos(
    f: Processes,
    events: Sequence[Any],
    duration_s: float,
    restart: Mapping[str, Callable[[], None]],
    coordinator: str,
) -> tuple[float, float, list[dict[str, Any]], list[dict[str, Any]]]:
    """Play a schedule on a running formation from now: kill -9 and relaunch at once
    (``restart[name]``; ``sync-kill`` hits ``coordinator``), stalls and slowdowns by signal.
    Returns (start, end, kills made, unexpected exits)."""
    t0 = time.time()
    done = threading.Event()
    signaller = threading.Thread(target=_signals, args=(f, events, t0, done), daemon=True)
    signaller.start()
    kills: list[dict[str, Any]] = []
    exits: list[dict[str, Any]] = []
    try:
        for e in events:
            if e.kind not in ("kill", "sync-kill"):
                continue
            _supervise_until(f, t0 + e.at_s, exits, restart)
            name = e.target if e.kind == "kill" else coordinator
            at = f.kill(name)
            restart[name]()
            kills.append({"kind": e.kind, "target": e.target, "t": at})
        _supervise_until(f, t0 + duration_s, exits, restart)
    finally:
        done.set()
        signaller.join()
    return t0, time.time(), kills, exits


def chaos_figures(
    records: Mapping[str, Sequence[Mapping[str, Any]]],
    sends: Mapping[str, Sequence[float]],
    merges: Sequence[float],
    evals: Sequence[tuple[float, float]],
    kills: Sequence[Mapping[str, Any]],
    window: tuple[float, float],
    plain_rate: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The chaos figures (``bench/chaos_schedule.py``'s doc) of one run of either system, from
    each learner's step records, the times its work reached the global model (``sends``: our
    merged contributions' send times, torchft's ok commits), the global model's updates
    (``merges``), the held-out losses (wall time, loss) and the kills made."""
    import chaos_schedule as ch

    lo, hi = window
    incarnations = {lid: list(by_pid(records[lid]).values()) for lid in LEARNERS}
    useful = sum(ch.useful_steps(incarnations[lid], sends[lid], lo, hi) for lid in LEARNERS)
    med = ch.median_of(
        gap for lid in LEARNERS for inc in incarnations[lid] for _, gap in step_gaps(inc)
    )
    all_steps = sorted(r["t"] for lid in LEARNERS for r in steps(records[lid]))
    computed = sum(1 for t in all_steps if lo <= t <= hi)
    times = sorted(merges)
    coordinator = [k["t"] for k in kills if k["kind"] == "sync-kill"]
    resumed = {t: next((m for m in times if m > t), None) for t in coordinator}
    excused = [(t, r if r is not None else hi) for t, r in resumed.items()]
    learner_kills = [k for k in kills if k["kind"] == "kill"]
    tokens_per_step = args.batch * 128
    return {
        "duration_s": hi - lo,
        "plain_steps_per_s": plain_rate,
        "steps_computed": computed,
        "steps_useful": useful,
        "goodput": useful / (plain_rate * len(LEARNERS) * (hi - lo)),
        "compute_share_useful": useful / max(1, computed),
        "uptime": statistics.mean(
            ch.uptime([r["t"] for r in steps(records[lid])], lo, hi, med) for lid in LEARNERS
        ),
        "median_step_s": med,
        "merged_rounds": sum(1 for m in times if lo <= m <= hi),
        **ch.downtime(times, lo, hi, 2 * args.h * med, excused),
        "learner_kills": len(learner_kills),
        "learner_kills_survived": sum(
            any(s > k["t"] for s in sends[k["target"]]) for k in learner_kills
        ),
        "sync_kills": len(coordinator),
        "sync_kills_survived": sum(v is not None for v in resumed.values()),
        "loss_by_time": [(t - lo, loss) for t, loss in evals],
        "loss_by_tokens": [
            (ch.tokens_by(all_steps, t, tokens_per_step), loss) for t, loss in evals
        ],
        "tokens_computed": computed * tokens_per_step,
    }


def _events(args: argparse.Namespace) -> tuple[Any, ...]:
    import chaos_schedule as ch

    return ch.plan_chaos(
        args.seed,
        args.chaos_s,
        LEARNERS,
        learner_kills=args.chaos_kills,
        sync_kills=args.chaos_sync_kills,
    )


def scenario_chaos(work: Path, args: argparse.Namespace, mode: str) -> dict[str, Any]:
    """The seeded schedule (``bench/chaos_schedule.py``) over ``args.chaos_s`` seconds,
    ``decoupled`` (the config's K = 1 + grace) or ``synchronous`` (K = M): kills relaunched at
    once, stalls and slowdowns by signal; the figures of that module's doc."""
    from dd_queue.messages import Event

    plain = _plain_rates(work.parent.parent / "plain-reference", args)
    events = _events(args)
    sync: dict[str, Any] = {"eval_interval_s": 20.0}
    if mode == "synchronous":
        sync["quorum"] = len(LEARNERS)
    with Formation(work, args, overrides={"synchronizer": sync}) as f:
        f.wait(
            f"step {WARM_STEP} on both learners",
            lambda: all(f.step_of(lid) >= WARM_STEP for lid in LEARNERS),
            300,
        )
        restart: dict[str, Callable[[], None]] = {
            lid: (lambda lid=lid: f.learner(lid)) for lid in LEARNERS
        }
        restart["synchronizer"] = f.synchronizer
        lo, hi, kills, exits = drive_chaos(f, events, args.chaos_s, restart, "synchronizer")
        records = {lid: f.records(lid) for lid in LEARNERS}
        rounds = f.rounds()
        limits = f.cfg.wire.message_limits()
        evals = []
        for entry in f.bus.read(f.bus.keys.events(), count=1_000_000):
            ev = Event.from_fields(entry.fields, run_id="resil", limits=limits)
            if ev.kind == "eval.done" and lo <= ev.at_s <= hi:
                evals.append((ev.at_s, float(ev.fields["loss"])))
        f.stop_learners()
        checked = f.audit()
    done_rounds = merged(rounds)
    sends = {
        lid: [
            entry_ms(o.entry_id) / 1000.0
            for r in done_rounds
            for o in r.entries
            if o.learner_id == lid and o.outcome == "merged"
        ]
        for lid in LEARNERS
    }
    merges = [r.closed_at_s for r in done_rounds]
    figures = chaos_figures(records, sends, merges, evals, kills, (lo, hi), _mean_rate(plain), args)
    return {
        "mode": mode,
        "seed": args.seed,
        **figures,
        "abandoned_rounds": sum(
            1 for r in rounds if r.decision == "abandon" and lo <= r.closed_at_s <= hi
        ),
        "stalls": sum(e.kind == "stall" for e in events),
        "slowdowns": sum(e.kind == "slow" for e in events),
        "unexpected_exits": exits,
        "n_unexpected_exits": len(exits),
        **checked,
    }


def _mean_rate(plain: Mapping[str, float | None]) -> float:
    return statistics.mean(v for v in plain.values() if v)


SCENARIOS = ("steady", "hetero", "kill-learner", "kill-sync", "redis", "chaos")
DEFAULT_SCENARIOS = SCENARIOS[:-1]  # chaos takes ~25 min more: asked for by name


Scenario = tuple[
    str, Callable[[Path], dict[str, Any]], Callable[[Path, Path], dict[str, Any]] | None
]


def plan(args: argparse.Namespace, peer_py: Path | None) -> list[Scenario]:
    """(variant, our run, torchft's run or None where it has no such part) of every asked
    scenario, in order. torchft has no synchronizer and no broker: kill-sync and redis are
    ours alone."""
    import peer_torchft as tf

    py = peer_py or Path("python")
    out: list[Scenario] = []
    for name in args.scenarios:
        if name == "steady":
            out.append(
                (
                    "steady",
                    lambda w: scenario_steady(w, args),
                    lambda w, c: tf.steady(w, py, c, args.steps),
                )
            )
        elif name == "hetero":
            out += [
                (
                    f"hetero-{x:g}",
                    lambda w, x=x: scenario_hetero(w, args, x),
                    lambda w, c, x=x: tf.hetero(w, py, c, args.steps, x),
                )
                for x in (1.5, 2.0)
            ]
        elif name == "kill-learner":
            out += [
                (
                    f"kill-learner-{h}",
                    lambda w, h=h: scenario_kill_learner(w, args, h),
                    lambda w, c, h=h: tf.kill_learner(w, py, c, h, args.h, args.seed),
                )
                for h in ("signal", "publish")
            ]
        elif name == "kill-sync":
            out += [
                (f"kill-sync-{h}", lambda w, h=h: scenario_kill_sync(w, args, h), None)
                for h in ("signal", "after_merge", "standby")
            ]
        elif name == "redis":
            out.append(("redis", lambda w: scenario_redis(w, args), None))
        elif name == "chaos":  # the same schedule three ways; torchft's run follows ours
            out += [
                (
                    "chaos-decoupled",
                    lambda w: scenario_chaos(w, args, "decoupled"),
                    lambda w, c: tf.chaos(
                        w,
                        py,
                        c,
                        _events(args),
                        args,
                        _plain_rates(w.parent.parent / "plain-reference", args),
                    ),
                ),
                ("chaos-synchronous", lambda w: scenario_chaos(w, args, "synchronous"), None),
            ]
    return out


def run_scenarios(
    args: argparse.Namespace, work: Path, peer_py: Path | None = None
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]]]:
    """Every asked scenario ``args.repeat`` times, each followed by torchft's counterpart when
    ``peer_py`` is its venv's python; the raw results of both systems by variant name."""
    from tests.redisproc import free_port

    results: dict[str, dict[str, list[dict[str, Any]]]] = {"dd_queue": {}, "torchft": {}}

    def keep(who: str, name: str, fn: Callable[[Path], dict[str, Any]], rep: int) -> dict[str, Any]:
        where = work / who / f"{name}-{rep}"
        where.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        out = fn(where)
        out["wall_s"] = time.time() - t0
        results[who].setdefault(name, []).append(out)
        print(f"  {who} {name} #{rep + 1}: {json.dumps(out, default=_jsonable)}", file=sys.stderr)
        return out

    for rep in range(args.repeat):
        for variant, mine, peer in plan(args, peer_py):
            got = keep("dd_queue", variant, mine, rep)
            if peer_py is None or peer is None:
                continue
            (work / "torchft").mkdir(parents=True, exist_ok=True)
            config = run_config(work / "torchft", "redis://127.0.0.1:1/0", free_port(), args)
            theirs = keep("torchft", variant, lambda w, p=peer, c=config: p(w, c), rep)
            if variant == "steady":  # against the same plain pair, measured in this run
                theirs["plain_steps_per_s"] = got["plain_steps_per_s"]
    return results["dd_queue"], results["torchft"]


def _jsonable(value: Any) -> Any:
    return float(value) if hasattr(value, "__float__") else str(value)


# ── report ─────────────────────────────────────────────────────────────────────────────────
def _num(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _med(runs: Sequence[Mapping[str, Any]], key: str, digits: int = 2) -> str:
    s = spread([r.get(key) for r in runs])
    if s["median"] is None:
        return "—"
    if s["n"] == 1:
        return _num(s["median"], digits)
    return f"{_num(s['median'], digits)} [{_num(s['min'], digits)}–{_num(s['max'], digits)}]"


def derive(results: Mapping[str, Sequence[dict[str, Any]]]) -> None:
    """Add the table's derived figures to one system's runs, in place: the steady means and CPU
    shares, each slow-peer run's fast rate over that system's own steady median, and the chaos
    runs' goodput ratio (decoupled ÷ synchronous)."""
    for r in results.get("steady", []):
        plain = r.get("plain_steps_per_s") or {}
        r["plain"] = statistics.mean(v for v in plain.values() if v) if plain else None
        r["ours"] = statistics.mean(v for v in r["learner_steps_per_s"].values() if v)
        if r["plain"]:
            r["ratio"] = r["ours"] / r["plain"]
        for name, key in (
            ("synchronizer", "sync_cpu"),
            ("evaluator", "eval_cpu"),
            ("control", "control_cpu"),
            ("redis", "redis_cpu"),
        ):
            r[key] = r.get("cpu_share", {}).get(name)
    dec, syn = results.get("chaos-decoupled", []), results.get("chaos-synchronous", [])
    for d, y in zip(dec, syn, strict=False):  # the same schedule: repetition by repetition
        d["goodput_over_synchronous"] = d["goodput"] / y["goodput"] if y["goodput"] else None
    base = spread([r.get("ours") for r in results.get("steady", [])])["median"]
    for name, runs in results.items():
        if name.startswith("hetero-"):
            for r in runs:
                r["fast_ratio"] = r["fast_steps_per_s"] / base if base else None


def compare_chaos(groups: Iterable[Sequence[dict[str, Any] | None]]) -> None:
    """Set each chaos run's held-out loss at equal tokens and at equal wall time, in place: for
    each group of runs on the same schedule (one repetition of every system), where every run
    of the group has got to (the fewest tokens computed, the shortest time evaluated)."""
    import chaos_schedule as ch

    for group in groups:
        runs = [r for r in group if r is not None and r.get("loss_by_tokens")]
        if not runs:
            continue
        tokens = min(max(x for x, _ in r["loss_by_tokens"]) for r in runs)
        seconds = min(max(x for x, _ in r["loss_by_time"]) for r in runs)
        for r in runs:
            r["tokens_compared"], r["seconds_compared"] = tokens, seconds
            r["loss_at_equal_tokens"] = ch.at_x(r["loss_by_tokens"], tokens)
            r["loss_at_equal_time"] = ch.at_x(r["loss_by_time"], seconds)


# (variant, measurement, key or keys, digits, the torchft anchor's figure)
Row = tuple[str, str, str | tuple[str, ...], int, str]


def table_rows() -> list[Row]:
    """Every measurement of the head-to-head table, in order."""
    rows: list[Row] = [
        ("steady", "steady: plain pair, steps/s each", "plain", 2, "2.84"),
        ("steady", "steady: learners, steps/s each", "ours", 2, "2.89"),
        ("steady", "steady: ratio to the plain pair (target ≥ 0.98)", "ratio", 3, "1.02"),
        ("steady", "steady: synchronizer CPU, share of the machine", "sync_cpu", 3, "—"),
        ("steady", "steady: evaluator CPU share", "eval_cpu", 3, "—"),
        ("steady", "steady: control plane CPU share", "control_cpu", 3, "—"),
        ("steady", "steady: redis CPU share", "redis_cpu", 3, "—"),
        ("steady", "steady: learners per merged round", "contributors_per_round", 2, "2"),
    ]
    for factor, anchor in (("1.5", "0.674"), ("2", "0.487")):
        v, label = f"hetero-{factor}", f"peer {factor}× slower"
        rows += [
            (v, f"{label}: fast learner vs steady (≥ 0.98)", "fast_ratio", 3, anchor),
            (v, f"{label}: rounds the fast one merged into", "fast_round_share", 2, "1.00"),
            (v, f"{label}: rounds the slow one merged into", "slow_round_share", 2, "1.00"),
        ]
    for how, label, discarded in (
        ("signal", "kill -9 in inner steps", "0"),
        ("publish", "kill while publishing (torchft: mid-allreduce)", "20"),
    ):
        v = f"kill-learner-{how}"
        rows += [
            (v, f"{label}: survivor's longest step gap, s", "survivor_longest_gap_s", 2, "2.48"),
            (v, f"{label}: … over its median step (≤ 1.5)", "gap_over_median", 2, "7.8"),
            (v, f"{label}: survivor steps discarded", "survivor_steps_discarded", 0, discarded),
            (
                v,
                f"{label}: victim's steps not yet contributed",
                "victim_steps_since_last_contribution",
                0,
                "—",
            ),
            (v, f"{label}: kill → survivor's next merge, s", "kill_to_next_merge_s", 2, "5.26"),
            (
                v,
                f"{label}: relaunch → first merged contribution, s (< 5)",
                "relaunch_to_merged_s",
                2,
                "12.58",
            ),
            (v, f"{label}: … process start, s", "process_start_s", 2, "2.48"),
            (v, f"{label}: … join (torchft: to its first step), s", "join_s", 2, "—"),
            (v, f"{label}: … first contribution, s", "first_contribution_s", 2, "—"),
        ]
    for how, label in (
        ("signal", "synchronizer kill -9, restarted"),
        ("after_merge", "synchronizer killed between merge and commit, restarted"),
        ("standby", "synchronizer kill -9, standby takes over"),
    ):
        v, target = f"kill-sync-{how}", ("< 5" if how != "standby" else "≤ TTL + 2")
        rows += [
            (v, f"{label}: learners' longest step gap ÷ median (≤ 1.5)", "gap_over_median", 2, "—"),
            (v, f"{label}: kill → next merge, s ({target})", "kill_to_next_merge_s", 2, "—"),
            (
                v,
                f"{label}: settled twice / merged twice / lost",
                ("settled_twice", "merged_twice", "lost"),
                0,
                "—",
            ),
        ]
    for mode in ("decoupled", "synchronous"):
        v, label = f"chaos-{mode}", f"chaos, {mode}"
        goodput = "goodput (≥ 0.95)" if mode == "decoupled" else "goodput"
        rows += [
            (v, f"{label}: {goodput}", "goodput", 3, "—"),
            (v, f"{label}: uptime, share of learner-time training", "uptime", 3, "—"),
            (
                v,
                f"{label}: learner kills survived / made",
                ("learner_kills_survived", "learner_kills"),
                0,
                "—",
            ),
            (
                v,
                f"{label}: synchronizer kills survived / made",
                ("sync_kills_survived", "sync_kills"),
                0,
                "—",
            ),
            (v, f"{label}: unexpected exits", "n_unexpected_exits", 0, "—"),
            (
                v,
                f"{label}: windows of 2 rounds without a merge (0)",
                "windows_without_merge",
                0,
                "—",
            ),
            (v, f"{label}: longest time without a merge, s", "longest_merge_gap_s", 1, "—"),
            (
                v,
                f"{label}: merged / abandoned rounds",
                ("merged_rounds", "abandoned_rounds"),
                0,
                "—",
            ),
            (
                v,
                f"{label}: settled twice / merged twice / lost",
                ("settled_twice", "merged_twice", "lost"),
                0,
                "—",
            ),
            (v, f"{label}: held-out loss at equal wall time", "loss_at_equal_time", 3, "—"),
            (v, f"{label}: held-out loss at equal tokens", "loss_at_equal_tokens", 3, "—"),
        ]
    rows.append(
        (
            "chaos-decoupled",
            "chaos: decoupled goodput ÷ synchronous (≥ 1.5)",
            "goodput_over_synchronous",
            2,
            "—",
        )
    )
    rows += [
        ("redis", "redis kill -9 + AOF restart: longest gap ÷ median", "gap_over_median", 2, "—"),
        ("redis", "redis kill -9 + AOF restart: back → merge, s", "back_to_next_merge_s", 2, "—"),
    ]
    return rows


def _cell(runs: Sequence[Mapping[str, Any]] | None, key: str | tuple[str, ...], digits: int) -> str:
    if runs is None:
        return "n/a"
    if isinstance(key, tuple):
        return "/".join(_med(runs, k, digits) for k in key)
    return _med(runs, key, digits)


def summarize(
    results: Mapping[str, Sequence[dict[str, Any]]],
    peer: Mapping[str, Sequence[dict[str, Any]]] | None = None,
) -> list[tuple[str, str, str, str]]:
    """Rows (measurement, dd_queue: median [min–max], torchft, dd_queue ÷ torchft) of the
    head-to-head table. torchft is ``peer`` (measured in this run; "n/a" where it has no such
    scenario) or, without one, the anchor's figure (and no ratio)."""
    derive(results)
    if peer is not None:
        derive(peer)
    compare_chaos(
        itertools.zip_longest(
            results.get("chaos-decoupled", []),
            results.get("chaos-synchronous", []),
            (peer or {}).get("chaos-decoupled", []),
        )
    )
    out = []
    for variant, label, key, digits, anchor in table_rows():
        if variant not in results:
            continue
        ours = _cell(results[variant], key, digits)
        if peer is None:
            out.append((label, ours, anchor, ""))
            continue
        theirs = _cell(peer.get(variant), key, digits)
        ratio = ""
        if isinstance(key, str) and variant in peer:
            a = spread([r.get(key) for r in results[variant]])["median"]
            b = spread([r.get(key) for r in peer[variant]])["median"]
            if a is not None and b:
                ratio = f"{a / b:.2f}"
        out.append((label, ours, theirs, ratio))
    return out


def combine_outputs(
    paths: Sequence[Path],
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[dict[str, Any]]] | None]:
    """The raw results of several ``--json`` outputs (each file's last JSON line), run after run
    by variant, ours and the peer's; they must share the model and schedule settings.

    Raises:
        ValueError: A file has no JSON summary, or its settings differ from the first's.
    """
    same = ("h", "fragments", "layers", "width", "batch", "seed", "chaos_s", "steps")
    results: dict[str, list[dict[str, Any]]] = {}
    peer: dict[str, list[dict[str, Any]]] = {}
    first: dict[str, Any] | None = None
    for path in paths:
        lines = [ln for ln in path.read_text().splitlines() if ln.startswith("{")]
        if not lines:
            raise ValueError(f"{path}: no JSON summary (run the bench with --json)")
        out = json.loads(lines[-1])
        settings = {k: out.get("settings", {}).get(k) for k in same}
        if first is None:
            first = settings
        elif settings != first:
            diff = {k: (first[k], settings[k]) for k in same if first[k] != settings[k]}
            raise ValueError(f"{path}: settings differ from {paths[0]}: {diff}")
        for name, runs in out.get("results", {}).items():
            results.setdefault(name, []).extend(runs)
        for name, runs in ((out.get("peer") or {}).get("results") or {}).items():
            peer.setdefault(name, []).extend(runs)
    return results, (peer or None)


def combine(args: argparse.Namespace, p: argparse.ArgumentParser) -> int:
    """``--combine``: the table (and with ``--json`` its object) of earlier outputs."""
    try:
        results, peer = combine_outputs([Path(f) for f in args.combine])
    except (OSError, ValueError) as exc:
        p.error(str(exc))
    rows = summarize(results, peer)
    print_table(rows, peer is not None)
    n = max((len(v) for v in results.values()), default=0)
    print(f"({n} repetition(s) from {len(args.combine)} invocation(s))")
    if args.json:
        summary = {
            "bench": "resilience",
            "combined": args.combine,
            "results": results,
            "peer": {"results": peer},
            "table": table_json(rows, peer is not None),
        }
        print(json.dumps(summary, default=_jsonable))
    return 0


def table_json(rows: Sequence[tuple[str, str, str, str]], peer: bool) -> list[dict[str, Any]]:
    """The table's rows as the ``--json`` object holds them."""
    column = "torchft" if peer else "torchft_anchor"
    return [{"measurement": a, "dd_queue": b, column: c, "ratio": d or None} for a, b, c, d in rows]


def print_table(rows: Sequence[tuple[str, str, str, str]], peer: bool) -> None:
    width = max(len(r[0]) for r in rows)
    head = "torchft (this run)  dd_queue ÷ torchft" if peer else "torchft (anchor)"
    print(f"{'measurement':<{width}}  {'dd_queue':>24}  {head}")
    for name, ours, theirs, ratio in rows:
        line = f"{name:<{width}}  {ours:>24}  {theirs:>18}"
        print(f"{line}  {ratio}" if peer else f"{name:<{width}}  {ours:>24}  {theirs}")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--plain-worker"]:
        config, lid, n, log = argv[1:5]
        return plain_worker(config, lid, int(n), log)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--scenarios",
        default=",".join(DEFAULT_SCENARIOS),
        help="comma-separated: " + ", ".join(SCENARIOS) + " (default: all but chaos)",
    )
    p.add_argument("--repeat", type=int, default=1, help="repetitions of each (default 1)")
    p.add_argument(
        "--steps", type=int, default=200, help="inner steps per learner (steady, hetero)"
    )
    p.add_argument("--h", type=int, default=20, help="H: inner steps between syncs (default 20)")
    p.add_argument("--fragments", type=int, default=1, help="P (default 1, as torchft DiLoCo)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=192)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chaos-s", type=float, default=600.0, help="chaos: length, s (default 600)")
    p.add_argument("--chaos-kills", type=int, default=20, help="chaos: learner kills (default 20)")
    p.add_argument(
        "--chaos-sync-kills", type=int, default=5, help="chaos: synchronizer kills (default 5)"
    )
    p.add_argument("--work", help="keep every log and record here (default: a temp dir)")
    p.add_argument("--smoke", action="store_true", help="steady only, a tiny model, 60 steps")
    p.add_argument(
        "--peer",
        choices=["torchft"],
        help="also run torchft's side of every scenario (its own venv) and print both",
    )
    p.add_argument(
        "--peer-venv",
        default=str(ROOT / ".bench" / "torchft-0.2.0"),
        help="the peer's venv (created when missing; default .bench/torchft-0.2.0)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object last")
    p.add_argument(
        "--combine",
        nargs="+",
        metavar="FILE",
        help="run nothing: print one table of earlier --json outputs, as repetitions",
    )
    args = p.parse_args(argv)
    if args.combine:
        return combine(args, p)
    args.scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = sorted(set(args.scenarios) - set(SCENARIOS))
    if unknown:
        p.error(f"unknown scenarios {unknown}; known: {list(SCENARIOS)}")
    if args.smoke:
        args.scenarios, args.steps, args.layers, args.width, args.batch = ["steady"], 60, 1, 64, 4
    if args.width % 32:
        p.error("--width must be a multiple of 32 (heads of 32)")
    with contextlib.ExitStack() as stack:
        work = (
            Path(args.work)
            if args.work
            else Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="ddq-resil-")))
        )
        work.mkdir(parents=True, exist_ok=True)
        started = time.time()
        peer_py, peer_why = None, "not asked (--peer torchft)"
        if args.peer == "torchft":
            import peer_torchft as tf

            peer_py, peer_why = tf.ensure_venv(Path(args.peer_venv))
            print(f"torchft peer: {peer_why}", file=sys.stderr)
        results, peer = run_scenarios(args, work, peer_py)
        rows = summarize(results, peer if peer_py is not None else None)
        shape = (args.layers, args.width, args.batch, args.h, args.fragments)
        if peer_py is None and shape != (4, 192, 16, 20, 1):  # the anchor's model only
            rows = [(name, ours, "n/a (not the anchor's model)", "") for name, ours, *_ in rows]
        print_table(rows, peer_py is not None)
        if args.peer and peer_py is None:
            print(f"torchft side not run: {peer_why}")
        kept = work if args.work else "removed"
        print(f"({args.repeat} repetition(s), {time.time() - started:.0f} s; logs: {kept})")
        if args.json:
            summary = {
                "bench": "resilience",
                "date": time.strftime("%Y-%m-%d"),
                "settings": {k: v for k, v in vars(args).items() if k != "json"},
                "results": results,
                "peer": {"name": args.peer, "status": peer_why, "results": peer},
                "table": table_json(rows, peer_py is not None),
                "torchft_anchor": TORCHFT,
            }
            print(json.dumps(summary, default=_jsonable))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
