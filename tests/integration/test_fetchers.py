"""Fetch processes (``synchronizer.fetchers``) against a real redis-server, with real processes.

What a child reads must be exactly what the synchronizer reads inline: the same message, the
same float32 bits, the same segment norms, or the same exception with the same message. A child
that dies fails its reads with ``BusError`` and is replaced; children exit with their parent,
also when the parent is killed with SIGKILL.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dd_queue.bus import Entry, RedisBus, RedisOptions
from dd_queue.clock import SystemClock
from dd_queue.core.blockwise import as_float32
from dd_queue.core.codec import CodecSpec, encode
from dd_queue.errors import BusError
from dd_queue.synchronizer import Synchronizer, fetchers
from dd_queue.synchronizer.buffers import BufferPool, framed
from dd_queue.synchronizer.prefetch import Prefetcher
from tests.integration.conftest import wait_until
from tests.redisproc import RedisProcess
from tests.synchronizer_support import contribute, make_config, tiny_source, with_nan

pytestmark = pytest.mark.skipif(not fetchers.available(), reason="fetch processes need Linux")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def bus(redis_server: RedisProcess) -> Iterator[RedisBus]:
    bus = RedisBus(
        redis_server.url, f"f{uuid.uuid4().hex[:8]}", options=RedisOptions(unavailable_after_s=5)
    )
    yield bus
    bus.close()


@pytest.fixture
def sync(bus: RedisBus) -> Iterator[Synchronizer]:
    cfg = make_config(bus.keys.run_id, quorum=1)
    sync = Synchronizer(cfg, bus=bus, clock=SystemClock(), source=tiny_source(), fetch_processes=0)
    sync.start()
    yield sync
    sync.close()


def outcome(read: Any, entry: Entry) -> tuple[Any, ...]:
    """What a read gives, in comparable form: the message, Δ's form (float32 or blockwise
    codes) and bits, and the norms, or the exception's type and message."""
    try:
        msg, delta, norms = read(entry)
    except Exception as exc:  # the exception is the outcome compared
        return ("error", type(exc).__name__, str(exc))
    bits = as_float32(delta).tobytes()
    return ("ok", msg, type(delta).__name__, bits, None if norms is None else norms.tobytes())


def test_a_fetch_process_reads_exactly_what_an_inline_read_gives(
    sync: Synchronizer, bus: RedisBus, redis_server: RedisProcess
) -> None:
    cfg, fragment = sync.ctx.cfg, sync.fragments[0].fragment
    size, rng = fragment.size, np.random.default_rng(0)
    delta = (rng.standard_normal(size) * 1e-3).astype(np.float32)
    int8 = encode(delta, CodecSpec("int8", block_size=64))
    bad_crc = dataclasses.replace(int8, header=dataclasses.replace(int8.header, checksum=7))
    cases = {
        "L0": {"delta": delta},  # fp32
        "L1": {"delta": delta, "encoded": int8},
        "L2": {"delta": delta, "encoded": encode(delta, CodecSpec("bf16", zstd_level=1))},
        "L3": {"delta": delta, "encoded": with_nan(size)},
        "L4": {"delta": delta, "encoded": bad_crc},
        "L5": {"delta": np.zeros(size + 3, np.float32)},  # another size: read inline
        "L6": {"delta": delta},  # its payload is deleted below
        "L7": {"delta": delta, "encoded": encode(delta, CodecSpec("int4", block_size=16))},
        "L8": {"delta": delta, "encoded": encode(delta, CodecSpec("int8", zstd_level=3))},
    }
    for learner, kw in cases.items():
        contribute(bus, cfg, learner_id=learner, fragment_id=0, round_id=0, base_version=0, **kw)
    client = redis_server.client()
    client.delete(*client.keys(f"*{bus.keys.run_id}*blob:up:*L6*"))
    client.close()
    entries = bus.read(bus.keys.up(0), after_id="0-0", count=100)
    assert len(entries) == len(cases)

    inline = Prefetcher(sync.ctx, threads=0)
    expected = [outcome(lambda e: inline.read(e, fragment=fragment), e) for e in entries]
    ahead = Prefetcher(sync.ctx, threads=0, processes=2)
    try:
        ahead.submit(entries, fragment=fragment)
        got = [outcome(lambda e: ahead.read(e, fragment=fragment), e) for e in entries]
    finally:
        ahead.close()
    assert got == expected
    kinds = [o[0] if o[0] == "ok" else o[1] for o in got]
    assert kinds == [
        *("ok", "ok", "ok", "NonFiniteValues", "CorruptPayload", "ok", "BlobMissing", "ok", "ok")
    ]
    forms = [o[2] for o in got if o[0] == "ok"]  # int8 and int4 stay codes, in shared memory
    assert forms == ["ndarray", "Blockwise", "ndarray", "ndarray", "Blockwise", "Blockwise"]


def test_a_dead_fetch_process_fails_its_reads_and_is_replaced(
    sync: Synchronizer, bus: RedisBus, caplog: pytest.LogCaptureFixture
) -> None:
    fragment = sync.fragments[0].fragment
    a, b, c = published(sync, bus, 0.5, 3)
    pool = BufferPool()
    pool.allocate_with(fetchers.shared_bytes)
    procs = one_child(sync, bus, norms=True)
    try:
        out = pool.take(fragment.size)
        procs.submit("a", a, fragment, out)
        msg, norms = procs.result("a")
        assert msg.learner_id == "L0" and norms is not None and (out == 0.5).all()
        [pid] = procs.pids
        os.kill(pid, signal.SIGSTOP)  # b is sent to it, then it dies before replying
        procs.submit("b", b, fragment, pool.take(fragment.size))
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(BusError, match="fetch process"):
            procs.result("b")
        assert not alive(pid) and not procs.pending("b")
        assert f"fetch.lost process {pid}" in caplog.text and "1 reads fail" in caplog.text
        procs.submit("c", c, fragment, out)  # a new child
        msg, _ = procs.result("c")
        assert msg.learner_id == "L2" and procs.pids != (pid,)
    finally:
        procs.close()
    assert procs.pids == ()


def test_a_forgotten_read_leaves_nothing_behind(sync: Synchronizer, bus: RedisBus) -> None:
    fragment = sync.fragments[0].fragment
    a, b = published(sync, bus, 0.25, 2)
    procs = one_child(sync, bus, norms=False)
    try:
        procs.submit(1, a, fragment, fetchers.shared_bytes(4 * fragment.size).view(np.float32))
        procs.forget(1)
        out = fetchers.shared_bytes(4 * fragment.size).view(np.float32)
        procs.submit(2, b, fragment, out)
        msg, norms = procs.result(2)
        assert msg.learner_id == "L1" and norms is None and (out == 0.25).all()
        assert not procs.pending(1) and not procs.pending(2)
        with pytest.raises(KeyError):
            procs.result(1)
    finally:
        procs.close()


def test_fetch_processes_exit_when_their_parent_is_killed(redis_server: RedisProcess) -> None:
    script = textwrap.dedent(
        f"""
        import sys, time
        from dd_queue.bus import RedisOptions
        from dd_queue.config import DDQConfig
        from dd_queue.synchronizer.fetchers import FetchProcesses
        procs = FetchProcesses(
            2, url={redis_server.url!r}, run_id="k", options=RedisOptions(),
            limits=DDQConfig().wire.message_limits(), norms=False,
        )
        procs.start()
        print(*procs.pids, flush=True)
        time.sleep(120)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert parent.stdout is not None
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        parent.kill()
        parent.wait()
        wait_until(lambda: not any(alive(p) for p in pids), 10.0, "the children's exit")
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close() if parent.stdout else None


def test_pooled_arrays_in_shared_memory_frame_and_come_back() -> None:
    pool = BufferPool()
    pool.allocate_with(fetchers.shared_bytes)
    a = pool.take(1000)
    a[:] = np.arange(1000, dtype=np.float32)
    view = framed(a, b"head")
    assert view is not None and bytes(view[:4]) == b"head"
    assert np.array_equal(np.frombuffer(view[4:], dtype="<f4"), np.arange(1000, dtype=np.float32))
    pool.give([a])
    assert pool.take(1000) is a


def published(sync: Synchronizer, bus: RedisBus, value: float, n: int) -> list[Entry]:
    """``n`` contributions of learners L0, L1, ... to fragment 0, every element ``value``."""
    delta = np.full(sync.fragments[0].fragment.size, value, np.float32)
    for m in range(n):
        contribute(
            bus, sync.ctx.cfg, learner_id=f"L{m}", fragment_id=0, round_id=0, base_version=0,
            delta=delta,
        )  # fmt: skip
    return bus.read(bus.keys.up(0), after_id="0-0", count=n)


def one_child(sync: Synchronizer, bus: RedisBus, *, norms: bool) -> fetchers.FetchProcesses:
    return fetchers.FetchProcesses(
        1, url=bus.url or "", run_id=bus.keys.run_id, options=bus.options,
        limits=sync.ctx.limits, norms=norms,
    )  # fmt: skip


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, waiting to be reaped, has exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def test_a_child_unmaps_the_arrays_the_parent_frees(sync: Synchronizer, bus: RedisBus) -> None:
    fragment = sync.fragments[0].fragment
    a, b = published(sync, bus, 1.0, 2)
    procs = one_child(sync, bus, norms=False)
    try:
        first = fetchers.shared_bytes(4 * fragment.size).view(np.float32)
        procs.submit(1, a, fragment, first)
        procs.result(1)
        [pid] = procs.pids
        assert buffers_mapped(pid) == 1
        del first
        gc.collect()
        second = fetchers.shared_bytes(4 * fragment.size).view(np.float32)
        procs.submit(2, b, fragment, second)  # carries "forget the first"
        procs.result(2)
        assert buffers_mapped(pid) == 1 and (second == 1.0).all()
    finally:
        procs.close()


def buffers_mapped(pid: int) -> int:
    """How many shared arrays process ``pid`` maps."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return sum(1 for line in maps if "memfd:ddq-buffer" in line)
