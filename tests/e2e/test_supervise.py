"""``python -m dd_queue.supervise`` with real processes: it restarts a service that was killed or
crashed (backoff), passes exit 0 and give-up codes on without restarting, forwards each stop
signal to the service exactly once (also when the whole process group is signalled, as honcho
does), holds the first one back for ``--stop-delay-s``, stops promptly during a backoff, leaves
no orphan when it is SIGKILLed, and refuses to run without a command.

Children are tiny ``python -c`` scripts that append to files in ``tmp_path``: one line per start,
one line per signal received. The tests poll those files (and the wrapper's log) with deadlines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DEADLINE_S = 10.0
"""Longest wait for anything (generous: the machine may be busy); tests normally take < 2 s."""

# Exits with the codes in argv[2] (comma-separated), one per start, the last one repeating.
EXITS = """
import sys
starts, codes = sys.argv[1], [int(c) for c in sys.argv[2].split(",")]
with open(starts, "a") as f:
    f.write("start\\n")
with open(starts) as f:
    n = len(f.read().splitlines())
sys.exit(codes[min(n, len(codes)) - 1])
"""

# Counts SIGTERMs in argv[2] (one line "signum monotonic" each), says "ready" in argv[3] once its
# handler is in place. Mode "once": 0.3 s after the first signal (time for a duplicate to show
# up) it exits 0. Mode "twice": it exits 143 on the second.
SIGNALS = """
import os, signal, sys, time
starts, got, ready, mode = sys.argv[1:5]
with open(starts, "a") as f:
    f.write("start\\n")
count = 0
def on_term(signum, frame):
    global count
    count += 1
    with open(got, "a") as f:
        f.write(f"{signum} {time.monotonic()!r}\\n")
    if mode == "twice" and count == 2:
        os._exit(143)
signal.signal(signal.SIGTERM, on_term)
with open(ready, "w") as f:
    f.write("ready\\n")
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    if count and mode == "once":
        time.sleep(0.3)
        sys.exit(0)
    time.sleep(0.01)
sys.exit(1)
"""

# Writes its pid to argv[1], then sleeps (until killed).
SLEEPER = """
import os, sys, time
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(sys.argv[1] + ".tmp", sys.argv[1])
time.sleep(60)
"""


def lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:g} s: {what}")
        time.sleep(0.01)


def gone(pid: int) -> bool:
    """Whether ``pid`` is dead: no such process, or a zombie (an orphan's zombie stays until
    an init that reaps adopts it; some container inits never do)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


@dataclass
class Wrapper:
    """A running ``python -m dd_queue.supervise``, its combined stdout+stderr in ``log``."""

    proc: subprocess.Popen[bytes]
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def finish(self, timeout_s: float = DEADLINE_S) -> int:
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"wrapper still running; its log:\n{self.output()}") from None

    def signal_group(self, signum: int) -> None:
        """Signal the wrapper's whole process group, as honcho does (the service is not in it)."""
        os.killpg(self.proc.pid, signum)


Start = Callable[..., Wrapper]


@pytest.fixture
def supervise(tmp_path: Path) -> Iterator[Start]:
    """Starts wrappers (in their own session, so a group signal hits only the wrapper); kills
    any left at the end."""
    started: list[Wrapper] = []

    def start(code: str, *child_args: str, options: Sequence[str] = ()) -> Wrapper:
        log = tmp_path / f"wrapper{len(started)}.log"
        command = [sys.executable, "-m", "dd_queue.supervise", "--backoff-s", "0.1", *options]
        command += ["--", sys.executable, "-c", code, *child_args]
        with log.open("wb") as out:
            proc = subprocess.Popen(
                command,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        wrapper = Wrapper(proc, log)
        started.append(wrapper)
        return wrapper

    yield start
    for wrapper in started:
        if wrapper.proc.poll() is None:
            wrapper.proc.kill()  # its service dies with it (PR_SET_PDEATHSIG)
            wrapper.proc.wait(DEADLINE_S)


@dataclass
class Files:
    starts: Path
    got: Path
    ready: Path


@pytest.fixture
def files(tmp_path: Path) -> Files:
    return Files(tmp_path / "starts", tmp_path / "got", tmp_path / "ready")


def start_signalled(supervise: Start, files: Files, mode: str, **kw: Sequence[str]) -> Wrapper:
    """A wrapper over the SIGNALS child, once the child's handler is in place."""
    wrapper = supervise(SIGNALS, str(files.starts), str(files.got), str(files.ready), mode, **kw)
    wait_until(lambda: lines(files.ready) == ["ready"], "the child installed its handler")
    return wrapper


# ── restarts ────────────────────────────────────────────────────────────────────────────────


def test_a_killed_service_is_restarted_until_it_finishes(supervise: Start, files: Files) -> None:
    wrapper = supervise(EXITS, str(files.starts), "137,137,0")
    assert wrapper.finish() == 0
    assert len(lines(files.starts)) == 3
    log = wrapper.output()
    assert "as if killed by SIGKILL" in log
    assert "failure 1 in a row" in log and "failure 2 in a row" in log
    assert "restart in 0.1 s" in log and "restart in 0.2 s" in log  # doubling backoff


def test_a_misconfigured_service_is_not_restarted(supervise: Start, files: Files) -> None:
    wrapper = supervise(EXITS, str(files.starts), "2,0")
    assert wrapper.finish() == 2
    assert len(lines(files.starts)) == 1
    assert "not restarting" in wrapper.output()


def test_a_service_that_finishes_at_once_is_started_once(supervise: Start, files: Files) -> None:
    wrapper = supervise(EXITS, str(files.starts), "0,137")
    assert wrapper.finish() == 0
    assert len(lines(files.starts)) == 1
    assert "it finished; not restarting" in wrapper.output()


# ── signals ─────────────────────────────────────────────────────────────────────────────────


def test_a_group_sigterm_reaches_the_service_exactly_once(supervise: Start, files: Files) -> None:
    wrapper = start_signalled(supervise, files, "once")
    wrapper.signal_group(signal.SIGTERM)
    assert wrapper.finish() == 0
    received = lines(files.got)
    assert len(received) == 1, received  # through the wrapper only, not also from the group
    assert received[0].split()[0] == str(int(signal.SIGTERM))
    assert len(lines(files.starts)) == 1  # a stop is not followed by a restart
    assert "forward signal 15" in wrapper.output()


def test_a_second_sigterm_is_forwarded_too(supervise: Start, files: Files) -> None:
    wrapper = start_signalled(supervise, files, "twice")
    wrapper.signal_group(signal.SIGTERM)
    wait_until(lambda: len(lines(files.got)) == 1, "the child got the first SIGTERM")
    assert wrapper.proc.poll() is None  # the child lives on, so does the wrapper
    wrapper.signal_group(signal.SIGTERM)
    assert wrapper.finish() == 0  # the child exited 143 = 128 + SIGTERM: a clean stop
    assert len(lines(files.got)) == 2
    assert len(lines(files.starts)) == 1


def test_the_stop_delay_holds_the_first_signal_back(supervise: Start, files: Files) -> None:
    wrapper = start_signalled(supervise, files, "once", options=["--stop-delay-s", "1.0"])
    sent_s = time.monotonic()  # CLOCK_MONOTONIC is one clock for every process on Linux
    wrapper.signal_group(signal.SIGTERM)
    assert wrapper.finish() == 0
    [line] = lines(files.got)
    held_s = float(line.split()[1]) - sent_s
    assert 0.9 <= held_s < 5.0, held_s
    assert "holding signal 15 for 1 s" in wrapper.output()
    assert len(lines(files.starts)) == 1


def test_a_sigkilled_wrapper_takes_its_service_along(supervise: Start, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    wrapper = supervise(SLEEPER, str(pid_file))
    wait_until(pid_file.exists, "the child wrote its pid")
    child = int(pid_file.read_text())
    assert not gone(child)
    wrapper.proc.kill()
    assert wrapper.finish() == -signal.SIGKILL
    wait_until(lambda: gone(child), f"the orphaned child {child} died", timeout_s=5.0)


def test_sigterm_during_a_backoff_ends_the_wrapper_promptly(supervise: Start, files: Files) -> None:
    wrapper = supervise(EXITS, str(files.starts), "5", options=["--backoff-s", "5"])
    wait_until(lambda: "restart in 5.0 s" in wrapper.output(), "the wrapper is in its backoff")
    sent_s = time.monotonic()
    wrapper.signal_group(signal.SIGTERM)
    assert wrapper.finish(timeout_s=5.0) == 0
    assert time.monotonic() - sent_s < 2.0
    assert len(lines(files.starts)) == 1  # no start after the stop
    assert "stopped while waiting to restart" in wrapper.output()


# ── usage ───────────────────────────────────────────────────────────────────────────────────


@pytest.mark.parametrize("tail", [["--"], [], ["--backoff-s", "0.1", "--"]])
def test_no_command_is_a_usage_error(tail: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "dd_queue.supervise", *tail],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert done.returncode == 2
    assert "no command given; put it after --" in done.stderr
