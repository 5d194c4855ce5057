"""The learner's own record of its inner steps: one JSON line per event, appended to a file.

Turned on by ``learner.step_log: runs/steps/{learner_id}.jsonl``. A restarted learner appends
to the same file; every line carries the process id, so each incarnation's steps stay apart::

    {"ev": "start", "t": 1764965998.40, "mono": 5120.31, "pid": 4242, "learner": "L0"}
    {"ev": "joined", "t": 1764966000.12, "mono": 5122.03, "pid": 4242, "learner": "L0",
     "step": 0, "versions": {"0": 3}}
    {"ev": "step", "t": 1764966000.45, "mono": 5122.36, "pid": 4242, "step": 1,
     "tokens": 2048}
    {"ev": "step", ..., "step": 20, "tokens": 40960, "dt_s": 0.33, "applied": [[0, 4]],
     "snapshots": [[0, 7]], "loss": 5.41}

(one object per line in the file). ``start`` is written once the process has read its config
(before it waits for Redis), ``joined`` once it holds the global model, ``killed`` (a kill
fault) or ``left`` at the end. ``t`` is wall-clock time (``time.time()``, the clock of the
synchronizer's round records) and ``mono`` the host's monotonic clock, both taken when the
step's work is done; ``dt_s`` is the time since the previous step of this process (absent on
its first). ``applied`` lists the global (fragment, version) pairs written into the model at
this step, ``snapshots`` the (fragment, round) contributions taken. The loss is written every
``tracking.every_steps`` steps only: reading it waits for a GPU. A file that cannot be written
is reported once and the record switched off: it never stops training.
Benchmarks (``bench/bench_resilience.py``) read step gaps, rates and rejoin times from it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import IO, Any

log = logging.getLogger("dd_queue.learner")


class StepLog:
    """Appends step records of one learner process to ``path`` (see the module doc)."""

    def __init__(self, path: str | Path, *, learner_id: str, loss_every: int) -> None:
        self.path = Path(str(path).replace("{learner_id}", learner_id))
        self.learner_id, self.loss_every = learner_id, max(1, loss_every)
        self.pid = os.getpid()
        self._last_t: float | None = None
        self._file: IO[str] | None = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", buffering=1, encoding="utf-8")
        except OSError as exc:
            log.error("steplog.off cannot open %s: %s", self.path, exc)

    def write(self, ev: str, **values: Any) -> None:
        """One line ``{"ev": ev, "t": now, "pid": ..., **values}`` (no-op once switched off)."""
        if self._file is None:
            return
        now = (round(time.time(), 6), round(time.monotonic(), 6))
        record = {"ev": ev, "t": now[0], "mono": now[1], "pid": self.pid, **values}
        try:
            self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        except (OSError, ValueError) as exc:
            log.error("steplog.off cannot write %s: %s; step records stop here", self.path, exc)
            self.close()

    def joined(self, step: int, versions: dict[int, int] | None) -> None:
        """The learner holds the global model and starts (or resumes at ``step``)."""
        held = {str(p): v for p, v in (versions or {}).items()}
        self.write("joined", learner=self.learner_id, step=step, versions=held)

    def step(
        self,
        step: int,
        *,
        tokens: int,
        loss: float | None,
        applied: tuple[tuple[int, int], ...],
        snapshots: tuple[tuple[int, int], ...],
    ) -> None:
        """One trained inner step; ``loss`` is only asked for every ``loss_every`` steps."""
        now = time.monotonic()
        values: dict[str, Any] = {"step": step, "tokens": tokens}
        if self._last_t is not None:
            values["dt_s"] = round(now - self._last_t, 6)
        self._last_t = now
        if applied:
            values["applied"] = [list(pair) for pair in applied]
        if snapshots:
            values["snapshots"] = [list(pair) for pair in snapshots]
        if loss is not None:
            values["loss"] = round(loss, 6)
        self.write("step", **values)

    def wants_loss(self, step: int) -> bool:
        """Whether this step's record carries the loss."""
        return step % self.loss_every == 0

    def close(self) -> None:
        """Close the file; later writes do nothing."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


__all__ = ["StepLog"]
