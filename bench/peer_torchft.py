"""The torchft side of ``bench/bench_resilience.py --peer torchft``: its venv, its worker, its
formation and its scenarios, reduced to the same figures as ours.

The peer runs in a venv of its own (``torch==2.13.0``, ``torchft==0.2.0`` and this checkout of
dd_queue, so that its worker trains *our* model on *our* data: ``training_parts`` builds the same
model, shard, ``InnerLoop`` (AdamW, clipping, schedule) and step log as our learners and the plain
baseline). Each replica is one process with one thread: a torchft ``Manager`` over Gloo (one
``TCPStore`` per replica group of one process, no torchrun) and ``torchft.local_sgd.DiLoCo`` with
the outer Nesterov SGD of our config, H inner steps per sync, talking to a ``torchft_lighthouse``
(quorum tick 100 ms, join timeout 10 s, heartbeat timeout 5 s: the settings of the anchor in
``../shared/anchors/torchft/``; this code is ours). Faults are real: ``kill -9`` by pid, and a
replica that kills itself half-way through the per-tensor allreduces of a sync (torchft's
counterpart of our learner dying while it publishes). A slow replica sleeps (factor − 1) × its
step time after every step, as our ``slow`` fault does.

    python bench/peer_torchft.py --venv DIR         # create (or check) the peer's venv only
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from bench_resilience import (  # noqa: E402  (the bench folder is not a package)
    LEARNERS,
    WARM_STEP,
    Processes,
    longest_gap,
    median_step,
    rate,
    steps,
)

PINS = ("torch==2.13.0", "torchft==0.2.0")
DEFAULT_VENV = ROOT / ".bench" / "torchft-0.2.0"
LIGHTHOUSE_FLAGS = ("--quorum_tick_ms", "100", "--join_timeout_ms", "10000")
HEARTBEAT_TIMEOUT_MS = 5000


# ── the venv ───────────────────────────────────────────────────────────────────────────────
_PROBE = (
    "import torch, torchft, dd_queue.learner.inner; "
    "v = torch.__version__.split('+')[0]; "
    "assert v == '2.13.0', f'torch {v} (want 2.13.0)'"
)


def ensure_venv(path: Path) -> tuple[Path | None, str]:
    """The peer's python, creating the venv when it is missing or incomplete; (None, why) when
    it cannot be installed. The torch wheel index is ``DDQ_TORCH_INDEX`` (as ``scripts/setup``),
    the CPU wheels by default."""
    py = path / "bin" / "python"
    if py.exists() and _ok([str(py), "-c", _PROBE]):
        return py, "ready"
    index = os.environ.get("DDQ_TORCH_INDEX", "https://download.pytorch.org/whl/cpu")
    pip = [str(py), "-m", "pip", "install", "-q", "--extra-index-url", index]
    try:
        _run([sys.executable, "-m", "venv", str(path)])
        _run([*pip, *PINS])
        # dd_queue itself, so the worker trains our parts; torch stays at the pin
        _run([*pip, "-e", str(ROOT), *PINS])
        _run([str(py), "-c", _PROBE])
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = getattr(exc, "stderr", None) or str(exc)
        tail = detail.decode(errors="replace") if isinstance(detail, bytes) else str(detail)
        return None, f"cannot install {' '.join(PINS)} into {path}: {tail.strip()[-400:]}"
    return py, "installed"


def _run(argv: Sequence[str]) -> None:
    subprocess.run(list(argv), check=True, capture_output=True, timeout=1800)


def _ok(argv: Sequence[str]) -> bool:
    return subprocess.run(list(argv), capture_output=True, timeout=300).returncode == 0


# ── the worker (runs in the peer's venv) ───────────────────────────────────────────────────
def worker(argv: Sequence[str]) -> int:
    """One torchft replica; step lines in our step-log format, plus ``quorum`` and ``commit``
    lines (``ok``, participants, manager step) and ``killed`` before a self-kill."""
    p = argparse.ArgumentParser()
    p.add_argument("config")
    p.add_argument("learner")
    p.add_argument("log")
    p.add_argument("--lighthouse", required=True)
    p.add_argument("--steps", type=int, default=0, help="0: until stopped")
    p.add_argument("--slow", type=float, default=1.0)
    p.add_argument("--die-at-sync", type=int, default=0)
    p.add_argument("--snapshots", help="save the global model here after commits (chaos)")
    p.add_argument("--snapshot-every-s", type=float, default=20.0)
    a = p.parse_args(argv)

    from datetime import timedelta

    import torch
    from bench_resilience import training_parts
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.local_sgd import DiLoCo

    from dd_queue.learner.inner import count_tokens

    cfg, inner, loader, log = training_parts(a.config, a.learner, a.log)
    model = inner.model
    sync = cfg.synchronizer
    outer = torch.optim.SGD(
        model.parameters(), lr=sync.outer_lr, momentum=sync.outer_momentum, nesterov=True
    )
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=10)),
        load_state_dict=lambda sd: (
            model.load_state_dict(sd["model"]),
            inner.load_state_dict(sd["inner"]),
            outer.load_state_dict(sd["outer"]),
        ),
        state_dict=lambda: {
            "model": model.state_dict(),
            "inner": inner.state_dict(),
            "outer": outer.state_dict(),
        },
        min_replica_size=1,
        use_async_quorum=False,  # DiLoCo needs it
        timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=120),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=store.port,
        lighthouse_addr=a.lighthouse,
        replica_id=a.learner,
        checkpoint_transport=HTTPTransport(timeout=timedelta(seconds=30), num_chunks=0),
    )
    step = [0]
    _instrument(manager, log, step, a.die_at_sync, len(list(model.parameters())))
    stopping = [False]
    signal.signal(signal.SIGTERM, lambda *_: stopping.__setitem__(0, True))
    diloco = DiLoCo(
        manager,
        [model],
        inner.optimizer,
        outer,
        sync_every=sync.sync_every_steps,
        backup_device=torch.device("cpu"),
        pin_memory=False,
    )
    tokens, commits, last_snapshot = 0, [0], 0.0
    _count_commits(manager, commits)
    with diloco:
        log.joined(0, {})
        while not stopping[0] and (a.steps == 0 or step[0] < a.steps):
            started = time.monotonic()
            batches = [next(loader) for _ in range(cfg.learner.grad_accum_steps)]
            loss, _lr = inner.train_step(batches)  # DiLoCo's hook syncs every H steps
            if a.slow > 1.0:
                time.sleep((a.slow - 1.0) * (time.monotonic() - started))
            tokens += sum(count_tokens(b) for b in batches)
            step[0] += 1
            if a.snapshots and commits[0] and time.time() - last_snapshot >= a.snapshot_every_s:
                commits[0], last_snapshot = 0, time.time()  # the global model after a commit
                torch.save(
                    {"t": last_snapshot, "model": model.state_dict()},
                    Path(a.snapshots) / f"{a.learner}-{os.getpid()}-{last_snapshot:.3f}.pt",
                )
            log.step(
                step[0],
                tokens=tokens,
                loss=float(loss) if log.wants_loss(step[0]) else None,
                applied=(),
                snapshots=(),
            )
    log.write("left", step=step[0])
    log.close()
    manager.shutdown(wait=False)
    return 0


def _count_commits(manager: Any, commits: list[int]) -> None:
    """Count ok commits into ``commits[0]`` (after the instrumented ``should_commit``)."""
    should_commit = manager.should_commit

    def counted(*args: Any, **kw: Any) -> Any:
        ok = should_commit(*args, **kw)
        commits[0] += bool(ok)
        return ok

    manager.should_commit = counted


def _instrument(manager: Any, log: Any, step: list[int], die_at_sync: int, n_tensors: int) -> None:
    """Log every quorum and commit (timing only; behaviour unchanged) and, with
    ``die_at_sync`` K, SIGKILL this process after half the allreduces of its K-th sync."""
    start_quorum, should_commit, allreduce = (
        manager.start_quorum,
        manager.should_commit,
        manager.allreduce,
    )

    def logged_quorum(*args: Any, **kw: Any) -> Any:
        t0 = time.time()
        out = start_quorum(*args, **kw)
        log.write("quorum", step=step[0], dur=time.time() - t0, np=manager.num_participants())
        return out

    def logged_commit(*args: Any, **kw: Any) -> Any:
        ok = should_commit(*args, **kw)
        log.write(
            "commit",
            step=step[0] + 1,  # inside the optimizer step of the step being trained
            ok=bool(ok),
            np=manager.num_participants(),
            mstep=manager.current_step(),
        )
        return ok

    calls = [0]
    kill_at = (die_at_sync - 1) * n_tensors + n_tensors // 2

    def dying_allreduce(*args: Any, **kw: Any) -> Any:
        out = allreduce(*args, **kw)
        calls[0] += 1
        if calls[0] == kill_at:
            log.write("killed", step=step[0], point="mid_allreduce")
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    manager.start_quorum, manager.should_commit = logged_quorum, logged_commit
    if die_at_sync > 0:
        manager.allreduce = dying_allreduce


# ── the formation ──────────────────────────────────────────────────────────────────────────
class TorchftFormation(Processes):
    """A lighthouse and two replicas (the peer's python), on the run's config."""

    def __init__(self, work: Path, py: Path, config: Path, *, min_replicas: int) -> None:
        from tests.redisproc import free_port

        super().__init__(work)
        self.py, self.config, self.min_replicas = py, config, min_replicas
        self.addr = f"127.0.0.1:{free_port()}"
        self.lighthouse()

    def lighthouse(self) -> None:
        """Start (or restart, on the same address) the lighthouse."""
        self.popen(
            "lighthouse",
            [
                str(self.py.parent / "torchft_lighthouse"),
                "--bind",
                self.addr,
                "--min_replicas",
                str(self.min_replicas),
                *LIGHTHOUSE_FLAGS,
                "--heartbeat_timeout_ms",
                str(HEARTBEAT_TIMEOUT_MS),
            ],
        )

    def replica(self, lid: str, *extra: str) -> None:
        self.popen(
            lid,
            [
                str(self.py),
                str(Path(__file__)),
                "--worker",
                str(self.config),
                lid,
                str(self.work / "steps" / f"{lid}.jsonl"),
                "--lighthouse",
                f"http://{self.addr}",
                *extra,
            ],
        )

    def commits(self, lid: str, index: int = -1) -> list[Mapping[str, Any]]:
        return [r for r in self.incarnation(lid, index) if r["ev"] == "commit"]


# ── reductions (pure) ──────────────────────────────────────────────────────────────────────
def discarded_by_failed_commits(records: Sequence[Mapping[str, Any]]) -> int:
    """Inner steps thrown away: a failed commit restores the last global weights, so the steps
    since the previous sync point are lost. A relaunch (``start``) counts its steps from 0 again,
    so each incarnation's count starts there (records of all incarnations, in order)."""
    lost, since = 0, 0
    for r in records:
        if r["ev"] == "start":
            since = 0
        elif r["ev"] == "commit":
            if not r["ok"]:
                lost += r["step"] - since
            since = r["step"]
    return lost


def commit_share(commits: Sequence[Mapping[str, Any]], lo: float, hi: float, np: int) -> float:
    """Of the ok commits in [lo, hi], the share with at least ``np`` participants."""
    window = [c for c in commits if c["ok"] and lo <= c["t"] <= hi]
    return sum(c["np"] >= np for c in window) / len(window) if window else 0.0


# ── scenarios ──────────────────────────────────────────────────────────────────────────────
def steady(work: Path, py: Path, config: Path, n_steps: int) -> dict[str, Any]:
    """Two replicas to ``n_steps`` each; steps/s from step 20 to the last."""
    with TorchftFormation(work, py, config, min_replicas=2) as f:
        for lid in LEARNERS:
            f.replica(lid, "--steps", str(n_steps))
        f.wait_exit(LEARNERS, 900)
        rates = {lid: rate(f.incarnation(lid)) for lid in LEARNERS}
        commits = f.commits("L0")
    return {
        "learner_steps_per_s": rates,
        "merged_rounds": sum(c["ok"] for c in commits),
        "contributors_per_round": (
            sum(c["np"] for c in commits if c["ok"]) / max(1, sum(c["ok"] for c in commits))
        ),
    }


def hetero(work: Path, py: Path, config: Path, n_steps: int, factor: float) -> dict[str, Any]:
    """L1 slowed by ``factor``; L0 to ``n_steps``."""
    with TorchftFormation(work, py, config, min_replicas=2) as f:
        f.replica("L0", "--steps", str(n_steps))
        f.replica("L1", "--slow", str(factor))
        f.wait_exit(["L0"], 1800)
        f.kill("L1")  # alone under min_replicas 2 it would wait out the quorum timeout
        l0, l1 = f.incarnation("L0"), f.incarnation("L1")
        warm = next(r for r in steps(l0) if r["step"] >= WARM_STEP)["t"]
        end = steps(l0)[-1]["t"]
        share = commit_share(f.commits("L0"), warm, end, 2)
    return {
        "factor": factor,
        "fast_steps_per_s": rate(l0),
        "slow_steps_per_s": rate(l1),
        "fast_round_share": share,
        "slow_round_share": share,  # lock-step: every commit holds both or neither waits
    }


def kill_learner(work: Path, py: Path, config: Path, how: str, h: int, seed: int) -> dict[str, Any]:
    """Kill L1 (``signal``: kill -9 at a seeded phase of the sync period after step 40;
    ``publish``: it kills itself mid-allreduce at its 3rd sync), relaunch at once, follow it to
    its first commit with both replicas."""
    import random

    rng = random.Random(seed)
    with TorchftFormation(work, py, config, min_replicas=1) as f:
        f.replica("L0")
        f.replica("L1", *(("--die-at-sync", "3") if how == "publish" else ()))
        f.wait("both replicas past step 40", lambda: min(f.step_of(x) for x in LEARNERS) >= 40, 300)
        if how == "signal":
            target = f.step_of("L1") + 1 + rng.randrange(h)
            f.wait(f"L1 at step {target}", lambda: f.step_of("L1") >= target, 120)
            killed_at = f.kill("L1")
        else:
            f.wait("L1 killed", lambda: f.procs["L1"].poll() is not None, 300)
            killed_at = max(r["t"] for r in f.incarnation("L1"))
        victim = f.incarnation("L1")
        f.replica("L1")
        launched = f.launched["L1"]
        together = f.wait(
            "a commit of the relaunched L1 with both replicas",
            lambda: next(
                (c for c in f.commits("L1") if c["t"] > launched and c["ok"] and c["np"] >= 2),
                None,
            ),
            180,
        )
        settle = time.time() + 5.0
        f.wait("5 s after it", lambda: time.time() >= settle, 30)
        survivor = f.incarnation("L0")
        end = time.time()
        newest = f.incarnation("L1")
        start = next(r for r in newest if r["ev"] == "start")
        first_step = steps(newest)[0] if steps(newest) else None
        resume = next((c for c in f.commits("L0") if c["ok"] and c["t"] > killed_at), None)
        last_ok = max((c["step"] for c in victim if c["ev"] == "commit" and c["ok"]), default=0)
    gap, med = longest_gap(survivor, killed_at, end), median_step(survivor)
    return {
        "how": how,
        "survivor_longest_gap_s": gap,
        "survivor_median_step_s": med,
        "gap_over_median": gap / med,
        "survivor_steps_discarded": discarded_by_failed_commits(survivor),
        "victim_steps_since_last_contribution": (
            steps(victim)[-1]["step"] - last_ok if steps(victim) else 0
        ),
        "kill_to_next_merge_s": None if resume is None else resume["t"] - killed_at,
        "process_start_s": start["t"] - launched,
        "join_s": None if first_step is None else first_step["t"] - start["t"],
        "first_contribution_s": None if first_step is None else together["t"] - first_step["t"],
        "relaunch_to_merged_s": together["t"] - launched,
    }


def chaos(
    work: Path,
    py: Path,
    config: Path,
    events: Sequence[Any],
    args: Any,
    plain: Mapping[str, float | None],
) -> dict[str, Any]:
    """Our chaos schedule on torchft (``min_replicas`` 1, as in kill_learner): replica kills
    relaunched at once, the lighthouse (its coordinator, where ours is the synchronizer) killed
    and restarted at the synchronizer kills' times, the same stalls and slowdowns by signal.
    A replica saves the global model after a commit every 20 s; the held-out loss of each save
    is scored afterwards, in this process (``HeldOut``: the evaluator's model and batches)."""
    import statistics

    import torch
    from bench_resilience import chaos_figures, drive_chaos

    from dd_queue.config import load_config
    from dd_queue.synchronizer.evaluator import HeldOut

    saves = work / "snapshots"
    saves.mkdir(parents=True, exist_ok=True)
    flags = ("--snapshots", str(saves))
    with TorchftFormation(work, py, config, min_replicas=1) as f:
        for lid in LEARNERS:
            f.replica(lid, *flags)
        f.wait(
            f"both replicas past step {WARM_STEP}",
            lambda: min(f.step_of(x) for x in LEARNERS) >= WARM_STEP,
            300,
        )
        restart: dict[str, Any] = {
            lid: (lambda lid=lid: f.replica(lid, *flags)) for lid in LEARNERS
        }
        restart["lighthouse"] = f.lighthouse
        lo, hi, kills, exits = drive_chaos(f, events, args.chaos_s, restart, "lighthouse")
        records = {lid: f.records(lid) for lid in LEARNERS}
    ok = {
        lid: [r["t"] for r in records[lid] if r["ev"] == "commit" and r["ok"]] for lid in LEARNERS
    }
    heldout = HeldOut.build(load_config(config))
    evals = []
    for path in sorted(saves.glob("*.pt")):
        saved = torch.load(path, map_location="cpu")
        if lo <= saved["t"] <= hi:
            heldout.model.load_state_dict(saved["model"])
            evals.append((float(saved["t"]), heldout.score()[0]))
    evals.sort()
    merges = sorted({round(t, 1) for lid in LEARNERS for t in ok[lid]})
    rate = statistics.mean(v for v in plain.values() if v)
    figures = chaos_figures(records, ok, merges, evals, kills, (lo, hi), rate, args)
    return {
        "mode": "torchft",
        "seed": args.seed,
        **figures,
        "stalls": sum(e.kind == "stall" for e in events),
        "slowdowns": sum(e.kind == "slow" for e in events),
        "unexpected_exits": exits,
        "n_unexpected_exits": len(exits),
        "steps_discarded": sum(discarded_by_failed_commits(r) for r in records.values()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1:])
    p = argparse.ArgumentParser(description="create or check the torchft peer's venv")
    p.add_argument("--venv", default=str(DEFAULT_VENV))
    a = p.parse_args(argv)
    py, why = ensure_venv(Path(a.venv))
    print(f"{py}: {why}" if py else why)
    return 0 if py else 1


if __name__ == "__main__":
    raise SystemExit(main())
