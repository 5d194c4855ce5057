"""The start waits (``dd_queue.startup``) without a real Redis: ``unmet`` reports the run missing
until a real synchronizer created it, and the synchronizer missing until it beats and again once
its beat is older than ``membership.stalled_after_s``; an unreachable Redis is named without its
password; ``wait_for`` gives up after its timeout with the reason, ends early on a stop and
returns once met. Also ``refuse_if_live``: a learner id held by a dead pid on this host is taken
over, one held by a live pid or by another host is refused."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest

from dd_queue.bus import MemoryBus
from dd_queue.clock import FakeClock
from dd_queue.config import DDQConfig
from dd_queue.errors import ConfigError, NotReady
from dd_queue.learner.join import Identity, refuse_if_live
from dd_queue.startup import unmet, wait_for
from dd_queue.synchronizer import Synchronizer
from tests.synchronizer_support import beat, make_config, tiny_source

RUN = "t"


@pytest.fixture
def cfg() -> DDQConfig:
    return make_config(RUN)  # 2 fragments, stalled_after_s 1.0, dead_after_s 2.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock(1000.0)


@pytest.fixture
def bus(clock: FakeClock) -> MemoryBus:
    return MemoryBus(RUN, clock=clock)


@pytest.fixture
def start_sync(bus: MemoryBus, clock: FakeClock, cfg: DDQConfig) -> Iterator[Callable[[], None]]:
    """Starts a real synchronizer on the bus (creates the run, beats once); closed at the end."""
    started: list[Synchronizer] = []

    def start() -> None:
        sync = Synchronizer(
            cfg,
            bus=bus,
            clock=clock,
            synchronizer_id="sync-0",
            source=tiny_source(),
            wall=clock.now,
        )
        started.append(sync)
        sync.start()

    yield start
    for sync in started:
        sync.close()


def closed_port() -> int:
    """A loopback port nobody listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# ── unmet ───────────────────────────────────────────────────────────────────────────────────


def test_the_run_is_missing_until_a_synchronizer_creates_it(
    bus: MemoryBus, cfg: DDQConfig, start_sync: Callable[[], None]
) -> None:
    missing = unmet(["run"], cfg=cfg, bus=bus)
    assert missing is not None
    assert f"run {RUN!r} to be created" in missing and "0/2 fragments published" in missing
    start_sync()
    assert unmet(["run"], cfg=cfg, bus=bus) is None
    assert unmet(["redis", "run"], cfg=cfg, bus=bus) is None  # a memory bus counts as reachable


def test_the_synchronizer_is_missing_before_its_beat_and_after_it_goes_stale(
    bus: MemoryBus, clock: FakeClock, cfg: DDQConfig, start_sync: Callable[[], None]
) -> None:
    before = unmet(["synchronizer"], cfg=cfg, bus=bus)
    assert before is not None and "a live synchronizer" in before
    assert "last beat" not in before  # none was ever seen
    start_sync()
    assert unmet(["synchronizer"], cfg=cfg, bus=bus) is None
    clock.advance(cfg.membership.stalled_after_s)  # exactly at the limit: still fresh
    assert unmet(["synchronizer"], cfg=cfg, bus=bus) is None
    clock.advance(0.5)  # 1.5 s: stale, not yet expired (dead_after_s 2.0)
    stale = unmet(["synchronizer"], cfg=cfg, bus=bus)
    assert stale is not None and "the last beat 1.5 s ago" in stale
    assert "membership.stalled_after_s 1 s" in stale


def test_the_first_unmet_need_is_reported(
    bus: MemoryBus, clock: FakeClock, cfg: DDQConfig, start_sync: Callable[[], None]
) -> None:
    both = unmet(["run", "synchronizer"], cfg=cfg, bus=bus)
    assert both is not None and "fragments published" in both
    start_sync()
    clock.advance(1.5)
    only_sync = unmet(["run", "synchronizer"], cfg=cfg, bus=bus)
    assert only_sync is not None and "a live synchronizer" in only_sync


def test_a_learner_heartbeat_is_not_a_synchronizer(bus: MemoryBus, cfg: DDQConfig) -> None:
    beat(bus, cfg, "L0", host=socket.gethostname(), pid=1)
    assert unmet(["synchronizer"], cfg=cfg, bus=bus) is not None


def test_an_unreachable_redis_is_named_without_its_password() -> None:
    url = f"redis://alice:s3cr3t-pw@127.0.0.1:{closed_port()}/0"
    cfg = make_config(RUN, redis__url=url)
    missing = unmet(["redis"], cfg=cfg, bus=None)
    assert missing is not None and missing.startswith("Redis at ")
    assert "s3cr3t-pw" not in missing and "alice" not in missing
    port = url.rsplit(":", 1)[1].split("/")[0]
    assert f"redis://127.0.0.1:{port}/0" in missing
    assert "start redis-server" in missing


def test_unknown_needs_are_refused(cfg: DDQConfig, bus: MemoryBus) -> None:
    with pytest.raises(ValueError, match=r"unknown needs \['coffee'\]"):
        unmet(["redis", "coffee"], cfg=cfg, bus=bus)
    for bad in ("Run", "member:", "member:L:0", "member"):
        with pytest.raises(ValueError, match="unknown needs"):
            unmet([bad], cfg=cfg, bus=None)


def test_a_member_is_live_while_its_own_beat_is_fresh(
    bus: MemoryBus, clock: FakeClock, cfg: DDQConfig, start_sync: Callable[[], None]
) -> None:
    never = unmet(["member:L0"], cfg=cfg, bus=bus)
    assert never is not None and f"a live 'L0' in run {RUN!r}" in never and "last beat" not in never
    beat(bus, cfg, "L1")
    start_sync()  # other members' beats are not L0's
    assert unmet(["member:L0"], cfg=cfg, bus=bus) is not None
    assert unmet(["member:sync-0"], cfg=cfg, bus=bus) is None
    beat(bus, cfg, "L0")
    assert unmet(["member:L0", "member:L1"], cfg=cfg, bus=bus) is None
    clock.advance(1.5)  # stale (stalled_after_s 1.0), not yet expired
    stale = unmet(["member:L0"], cfg=cfg, bus=bus)
    assert stale is not None and "the last beat 1.5 s ago" in stale


# ── wait_for ────────────────────────────────────────────────────────────────────────────────


class TickingStop(threading.Event):
    """A stop event whose waits move the fake clock instead of real time; ``on_wait`` runs at
    every wait (a synchronizer starting meanwhile)."""

    def __init__(self, clock: FakeClock, on_wait: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.clock, self.on_wait, self.waits = clock, on_wait, 0

    def wait(self, timeout: float | None = None) -> bool:
        self.waits += 1
        self.clock.advance(timeout or 0.0)
        if self.on_wait is not None:
            self.on_wait(self.waits)
        return self.is_set()


def test_wait_for_gives_up_after_its_timeout_with_the_reason(
    bus: MemoryBus, clock: FakeClock, cfg: DDQConfig
) -> None:
    stop = TickingStop(clock)
    start_s = clock.now()
    with pytest.raises(NotReady) as caught:
        wait_for(["run"], cfg=cfg, bus=bus, role="evaluator", stop=stop, clock=clock, timeout_s=3.0)
    message = str(caught.value)
    assert message.startswith("evaluator: still waiting for run")
    assert "0/2 fragments published" in message and "after 3 s" in message
    assert "run.start_timeout_s" in message
    waited_s = clock.now() - start_s
    assert 3.0 <= waited_s < 3.0 + 0.5 and stop.waits == 6  # polled every 0.5 s


def test_wait_for_defaults_to_run_start_timeout_s(bus: MemoryBus, clock: FakeClock) -> None:
    cfg = make_config(RUN, run__start_timeout_s=2.0)
    start_s = clock.now()
    with pytest.raises(NotReady, match="after 2 s"):
        wait_for(["run"], cfg=cfg, bus=bus, role="r", stop=TickingStop(clock), clock=clock)
    assert clock.now() - start_s == pytest.approx(2.0)


def test_wait_for_returns_false_at_once_when_already_stopped(
    bus: MemoryBus, clock: FakeClock, cfg: DDQConfig
) -> None:
    stop = threading.Event()
    stop.set()
    met = wait_for(
        ["run", "synchronizer"], cfg=cfg, bus=bus, role="r", stop=stop, clock=clock, timeout_s=0
    )
    assert met is False and clock.now() == 1000.0


def test_wait_for_returns_true_once_met(
    bus: MemoryBus, clock: FakeClock, cfg: DDQConfig, start_sync: Callable[[], None]
) -> None:
    def synchronizer_starts(waits: int) -> None:
        if waits == 3:
            start_sync()

    stop = TickingStop(clock, synchronizer_starts)
    start_s = clock.now()
    met = wait_for(
        ["redis", "run", "synchronizer"],
        cfg=cfg,
        bus=bus,
        role="learner",
        stop=stop,
        clock=clock,
        timeout_s=60.0,
    )
    assert met is True and stop.waits == 3
    assert clock.now() - start_s == pytest.approx(1.5)


def test_wait_for_returns_true_at_once_when_met(
    bus: MemoryBus, clock: FakeClock, cfg: DDQConfig, start_sync: Callable[[], None]
) -> None:
    start_sync()
    stop = TickingStop(clock)
    assert wait_for(["run"], cfg=cfg, bus=bus, role="r", stop=stop, clock=clock, timeout_s=0)
    assert stop.waits == 0


# ── refuse_if_live ──────────────────────────────────────────────────────────────────────────


class Alive:
    """An injected ``alive`` that answers ``answer`` and records what it was asked."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.asked: list[int] = []

    def __call__(self, pid: int) -> bool:
        self.asked.append(pid)
        return self.answer


ME = Identity("L0", "here", 100)


def refuse(bus: MemoryBus, cfg: DDQConfig, alive: Alive) -> None:
    limits = cfg.wire.message_limits()
    refuse_if_live(bus, ME, limits=limits, ttl_s=cfg.membership.dead_after_s, alive=alive)


def test_a_free_id_or_our_own_beat_is_not_refused(bus: MemoryBus, cfg: DDQConfig) -> None:
    alive = Alive(True)
    refuse(bus, cfg, alive)
    beat(bus, cfg, "L0", host=ME.host, pid=ME.pid)
    refuse(bus, cfg, alive)
    beat(bus, cfg, "L1", host=ME.host, pid=7)  # another id: not ours to check
    refuse(bus, cfg, alive)
    assert alive.asked == []


def test_a_dead_pid_on_this_host_is_taken_over(bus: MemoryBus, cfg: DDQConfig) -> None:
    beat(bus, cfg, "L0", host=ME.host, pid=4242)
    alive = Alive(False)
    refuse(bus, cfg, alive)  # no error
    assert alive.asked == [4242]


def test_a_live_pid_on_this_host_is_refused(bus: MemoryBus, cfg: DDQConfig) -> None:
    beat(bus, cfg, "L0", host=ME.host, pid=4242)
    alive = Alive(True)
    with pytest.raises(ConfigError, match="is live on here pid 4242") as caught:
        refuse(bus, cfg, alive)
    assert "pick another --learner-id" in str(caught.value)
    assert alive.asked == [4242]


@pytest.mark.parametrize("answer", [True, False])
def test_another_host_is_refused_whatever_its_pid(
    bus: MemoryBus, cfg: DDQConfig, answer: bool
) -> None:
    beat(bus, cfg, "L0", host="elsewhere", pid=4242)
    alive = Alive(answer)
    with pytest.raises(ConfigError, match="is live on elsewhere pid 4242"):
        refuse(bus, cfg, alive)
    assert alive.asked == []  # a pid on another host cannot be checked here


def test_an_expired_beat_frees_the_id(bus: MemoryBus, clock: FakeClock, cfg: DDQConfig) -> None:
    beat(bus, cfg, "L0", host="elsewhere", pid=4242)
    clock.advance(cfg.membership.dead_after_s)
    refuse(bus, cfg, Alive(True))
