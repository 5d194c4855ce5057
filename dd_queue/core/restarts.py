"""When a supervisor starts a service again: the restart rule of ``ddq supervise`` and ``ddq up``.

A service that exits on its own is judged by its exit code (``dd_queue.errors.exit_code``):

- ``0``: it finished (a learner at ``max_steps``, a clean stop): never restarted.
- a *give-up* code (default ``2``, a misconfiguration: bad config, another run's digest, a
  learner id held by a live process): restarting would fail the same way, so the supervisor
  stops and passes the code on.
- anything else (``3``: a dependency stayed away past its wait; ``137`` or a signal: killed,
  crashed): restarted after a backoff that doubles with every quick failure,
  ``backoff_s · 2^(n−1)`` capped at ``max_backoff_s``, and starts over at 1 once a run lasted
  ``stable_after_s`` (a service that ran for minutes and was killed comes back at once).

Pure: time and exit codes are arguments; the decision carries its reason as text.
"""

from __future__ import annotations

from dataclasses import dataclass

from dd_queue.errors import CoreError

__all__ = ["RestartDecision", "RestartPolicy", "decide_restart", "describe_exit"]

_SIGNAL_NAMES = {1: "SIGHUP", 2: "SIGINT", 6: "SIGABRT", 9: "SIGKILL", 11: "SIGSEGV", 15: "SIGTERM"}


@dataclass(frozen=True, slots=True)
class RestartPolicy:
    """How a supervisor restarts a service that exited on its own.

    Attributes:
        backoff_s: Wait before the first restart after a quick failure, seconds.
        max_backoff_s: Longest wait between restarts, seconds.
        stable_after_s: A run at least this long resets the backoff, seconds.
        give_up_codes: Exit codes that are not restarted (passed on instead).
    """

    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_after_s: float = 60.0
    give_up_codes: frozenset[int] = frozenset({2})

    def __post_init__(self) -> None:
        if not (0 <= self.backoff_s <= self.max_backoff_s) or self.stable_after_s < 0:
            raise CoreError(
                f"restart policy needs 0 <= backoff_s ({self.backoff_s}) <= max_backoff_s "
                f"({self.max_backoff_s}) and stable_after_s >= 0 ({self.stable_after_s})"
            )
        if 0 in self.give_up_codes:
            raise CoreError("exit code 0 means done; it cannot be a give-up code")


@dataclass(frozen=True, slots=True)
class RestartDecision:
    """What to do after an exit.

    Attributes:
        restart: Start the service again.
        delay_s: Wait this long first (0 when not restarting).
        attempt: Quick failures in a row, this one included (1 after a stable run).
        reason: The rule that decided, for logs.
    """

    restart: bool
    delay_s: float
    attempt: int
    reason: str


def describe_exit(code: int) -> str:
    """How a process ended, as people read it: ``exited with code 3``, ``was killed by
    SIGKILL``, ``exited with code 137 (as if killed by SIGKILL)``."""
    if code < 0:
        return f"was killed by {_SIGNAL_NAMES.get(-code, f'signal {-code}')}"
    if code > 128 and code - 128 in _SIGNAL_NAMES:
        return f"exited with code {code} (as if killed by {_SIGNAL_NAMES[code - 128]})"
    return f"exited with code {code}"


def decide_restart(
    policy: RestartPolicy, *, exit_code: int, ran_s: float, attempt_before: int
) -> RestartDecision:
    """Decide about a service that exited by itself (not asked to stop).

    Args:
        policy: The rule.
        exit_code: Its exit code (negative: killed by that signal, as ``subprocess`` reports).
        ran_s: How long this run of it lasted, seconds.
        attempt_before: Quick failures in a row before this one.
    """
    how = f"{describe_exit(exit_code)} after {ran_s:.1f} s"
    if exit_code == 0:
        return RestartDecision(False, 0.0, 0, f"{how}: it finished; not restarting")
    if exit_code in policy.give_up_codes:
        return RestartDecision(
            False,
            0.0,
            attempt_before + 1,
            f"{how}: code {exit_code} means a misconfiguration that a restart would repeat; "
            "not restarting (fix what its log says)",
        )
    stable = ran_s >= policy.stable_after_s
    attempt = 1 if stable else attempt_before + 1
    delay_s = min(policy.max_backoff_s, policy.backoff_s * 2.0 ** min(attempt - 1, 60))
    streak = (
        f"it ran {policy.stable_after_s:g} s or more: backoff reset"
        if stable
        else f"failure {attempt} in a row"
    )
    return RestartDecision(True, delay_s, attempt, f"{how}: restart in {delay_s:.1f} s ({streak})")
