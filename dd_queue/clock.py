"""Time as an injectable dependency: ``SystemClock`` for services, ``FakeClock`` for tests.

The pure core never reads time; the shell passes ``clock.now()`` in as ``now`` (float seconds).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Monotonic seconds plus a sleep that a fake clock can turn into a jump."""

    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """Real monotonic time."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        if seconds > 0:
            time.sleep(seconds)


class FakeClock:
    """A clock that moves only when told to; ``sleep`` advances it instantly."""

    def __init__(self, start_s: float = 0.0) -> None:
        self._now = start_s
        self._lock = threading.Lock()

    def now(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock cannot go back (asked to advance by {seconds} s)")
        with self._lock:
            self._now += seconds

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))
