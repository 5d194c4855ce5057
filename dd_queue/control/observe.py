"""Watching a fault take effect: what changed at its target since it was sent.

One :class:`Watch` per fault the control plane sent. Each refresh gives it the target's current
observation and the round records closed since the last refresh; it answers with notes (the
observed effects, e.g. "L1 went dead after 2.3 s", "L1 active again after 9.1 s, restarted
(pid 41 → 57)") and closes itself when the effect has run its course or the observation window
(``settle_s`` after the fault's end) is over. What counts as the effect depends on the kind:

=============  ===============================================================================
kill, stall,   the target's liveness leaves ``active`` and comes back (a kill needs a restart)
disconnect
slow           the reported step time rises ≥ 1.5× and falls back after the fault ends
drop           rounds merge during the window without the target; later its merges resume
delay          the outcomes of the target's contributions during the window
corrupt        the target's contributions are dead-lettered
=============  ===============================================================================
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dd_queue.control.members import LearnerObs, SyncObs
from dd_queue.control.tails import Tally
from dd_queue.messages import RoundRecord

__all__ = ["Target", "Watch"]

_LIVENESS_KINDS = ("kill", "stall", "disconnect")


@dataclass(frozen=True, slots=True)
class Target:
    """What the watch needs to know about its target at one refresh."""

    state: str  # liveness state; for the synchronizer "active" or "silent"
    reason: str
    pid: int | None
    step_time_s: float | None
    tally: Tally

    @classmethod
    def of_learner(cls, obs: LearnerObs | None, tally: Tally) -> Target:
        """A learner target (``obs`` None: never seen)."""
        if obs is None:
            return cls("unknown", "never seen", None, None, tally)
        return cls(obs.state, obs.reason, obs.beat.pid, obs.beat.step_time_ema_s, tally)

    @classmethod
    def of_synchronizers(cls, syncs: Sequence[SyncObs], fresh_s: float) -> Target:
        """The synchronizer target: ``active`` while some heartbeat is fresher than
        ``fresh_s``, else ``silent``."""
        fresh = [s for s in syncs if s.heartbeat_age_s <= fresh_s]
        if not fresh:
            return cls(
                "silent",
                f"no synchronizer heartbeat fresher than {fresh_s:g} s",
                None,
                None,
                Tally(),
            )
        return cls("active", "heartbeat fresh", fresh[0].beat.pid, None, Tally())


class Watch:
    """Observes one fault from ``now`` until its effect ran its course or ``settle_s`` after
    its end (``duration_s`` after ``now``; a one-shot fault ends at once)."""

    def __init__(
        self,
        *,
        fault_id: str,
        target_id: str,
        kind: str,
        duration_s: float | None,
        now: float,
        before: Target,
        settle_s: float,
    ) -> None:
        self.fault_id, self.target_id, self.kind = fault_id, target_id, kind
        self.start_s, self.end_s = now, now + (duration_s or 0.0)
        self.deadline_s = self.end_s + settle_s
        self.before = before
        self._merged0, self._unmerged0 = before.tally.merged, before.tally.unmerged
        self._dead0 = before.tally.dead_lettered
        self.went: str | None = None
        self.effective = self.closed = False
        self._done: set[str] = set()
        self._rounds = self._with_target = 0
        self._merged_end = before.tally.merged

    def observe(self, now: float, target: Target, rounds: Sequence[RoundRecord]) -> list[str]:
        """Notes about what changed; the last note of a closing watch is its summary."""
        for record in rounds:
            if record.decision == "merge":
                self._rounds += 1
                self._with_target += any(
                    c.learner_id == self.target_id for c in record.contributors
                )
        t = now - self.start_s
        notes = self._notes(now, t, target)
        self.effective = self.effective or bool(notes)
        if self._finished(now, target) or now >= self.deadline_s:
            self.closed = True
            verdict = "" if self.effective else ": no effect seen"
            notes.append(
                f"observation of {self.kind} on {self.target_id} closed after {t:.1f} s{verdict}"
            )
        return notes

    def _once(self, tag: str) -> bool:
        if tag in self._done:
            return False
        self._done.add(tag)
        return True

    def _notes(self, now: float, t: float, target: Target) -> list[str]:
        notes: list[str] = []
        who, before = self.target_id, self.before
        if self.kind in _LIVENESS_KINDS:
            state = target.state
            if state not in ("active", before.state) and self._once(f"went {state}"):
                self.went = state
                notes.append(f"{who} went {state} after {t:.1f} s ({target.reason})")
            elif self.went is not None and target.state == "active" and self._once("back"):
                restarted = target.pid != before.pid and target.pid is not None
                how = f", restarted (pid {before.pid} → {target.pid})" if restarted else ""
                notes.append(f"{who} active again after {t:.1f} s{how}")
        elif self.kind == "slow":
            notes += self._slow(now, t, target)
        elif self.kind == "corrupt":
            dead = target.tally.dead_lettered - self._dead0
            if dead > 0 and self._once(f"dead{dead}"):
                notes.append(f"{dead} contribution(s) of {who} dead-lettered after {t:.1f} s")
        elif now >= self.end_s and self._once("window"):
            merged = target.tally.merged - self._merged0
            unmerged = target.tally.unmerged - self._unmerged0
            self._merged_end = target.tally.merged
            notes.append(
                f"during the {self.kind} window: {self._rounds} rounds merged, "
                f"{self._with_target} with {who}; its contributions merged {merged}, "
                f"settled unmerged {unmerged}"
            )
        elif (
            self.kind == "drop"
            and "window" in self._done
            and target.tally.merged > self._merged_end
            and self._once("resumed")
        ):
            notes.append(f"contributions of {who} merged again {t:.1f} s after the fault")
        return notes

    def _slow(self, now: float, t: float, target: Target) -> list[str]:
        base, step = self.before.step_time_s, target.step_time_s
        if not base or not step:
            return []
        if step >= 1.5 * base and self._once("slow"):
            return [
                f"step time of {self.target_id} {base:.3g} s → {step:.3g} s "
                f"(×{step / base:.1f}) after {t:.1f} s"
            ]
        back = now >= self.end_s and "slow" in self._done and step <= 1.25 * base
        if back and self._once("fast"):
            return [f"step time of {self.target_id} back to {step:.3g} s after {t:.1f} s"]
        return []

    def _finished(self, now: float, target: Target) -> bool:
        if now < self.end_s:
            return False
        if self.kind in _LIVENESS_KINDS:
            return "back" in self._done
        if self.kind == "slow":
            return "fast" in self._done
        if self.kind == "drop":
            return "resumed" in self._done
        if self.kind == "corrupt":
            return target.tally.dead_lettered > self._dead0
        return "window" in self._done
