"""Fetch processes: contributions read and decoded in child processes, into shared memory.

Reading a contribution is a GET of ~1 MB (int8), a CRC and a decode (an int8/int4 payload's codes
and scales are kept, ``core.blockwise``; other codecs become float32), then its segment norms. In
threads of the synchronizer's own process that work and the loop's merge share one GIL: every numpy
call hands the GIL over, and measured on 2 vCPUs the merge's wall time doubled (16 → 30–37 ms a
round, for 13–15 ms of CPU) and each GET took 1.5–2× longer than alone, with 40% of the machine
idle (bench/bench_synchronizer.py; BENCHMARKS.md). A child process has its own interpreter:
``FetchProcesses`` runs ``ops.read_contribution`` and ``segment_sq_norms`` there, with the child's
own Redis connection, and the child writes the result straight into the array the loop will merge
from. That array lives in shared memory (``shared_bytes``: a memfd, mapped by both processes), so
nothing is copied between processes.

Protocol (a ``SOCK_SEQPACKET`` socket pair, one pickled message per packet, trusted: the child
is ours). Request: ``(ticket, entry, fragment index, layout, offset, forget)`` with the memfd of
the array to decode into as ancillary data; ``layout`` is the fragment's ``Fragment`` the first
time a child needs it (else None); ``offset`` is the array's byte offset in the memfd; ``forget``
lists arrays the parent has freed, which the child unmaps (it keeps at most
``CHILD_MAPPINGS`` mapped in any case).
Reply: ``(ticket, ok, payload)``: ``(msg, sq_norms)`` on success, or the exception that
``read_contribution`` raised (``ProtocolError``, ``BlobMissing``, ``BusError``), which the parent
raises in its place, so admission and dead-lettering see exactly what an inline read gives. A
payload whose size is not the fragment's is not decoded by the child (reply ``"inline"``): the
parent reads it itself, as before (it is refused as incompatible either way).

Lifecycle: children start all at once (``start``, or the first read; ~0.5 s of imports) and hold
no state the parent needs. If one dies, or does not reply within Redis's
``unavailable_after_s`` + 60 s (it is then killed), its pending reads raise ``BusError`` (the
synchronizer then drops its fragments and rebuilds them from Redis, as for any bus error) and
the next read starts a new child. A child exits when its socket closes: when the parent closes
it, exits, or is killed with SIGKILL. Ctrl-C is the parent's to handle (children ignore SIGINT).

Linux only (memfd, SEQPACKET, fd passing); elsewhere ``available()`` is False and the
synchronizer reads in a thread (``prefetch``).
"""

from __future__ import annotations

import logging
import mmap
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import weakref
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from dd_queue.auth import Auth, KeyRing
from dd_queue.bus import Entry, RedisBus, RedisOptions, ops
from dd_queue.core.fragments import Fragment
from dd_queue.core.merge import F32, F64, segment_sq_norms
from dd_queue.errors import BusError
from dd_queue.messages import Contribution, MessageLimits

__all__ = ["FetchProcesses", "Reply", "available", "shared_bytes"]

log = logging.getLogger("dd_queue.synchronizer")

MAX_PACKET = 1 << 20
"""Largest message (a pickled entry, fragment layout or exception is a few KB)."""
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[1])
CHILD_MAPPINGS = 512
"""Most shared arrays a child keeps mapped (least recently used are unmapped first)."""

Reply = tuple[Contribution, F64 | None] | str
"""A successful read: the message and Δ's squared segment norms, or ``"inline"``."""


def available() -> bool:
    """Whether fetch processes work here (Linux: memfd, SEQPACKET sockets, fd passing)."""
    return sys.platform == "linux" and hasattr(os, "memfd_create") and hasattr(socket, "send_fds")


class _SharedMap(mmap.mmap):
    """A memfd mapping that keeps its fd (to pass to children) until it is collected."""

    fd: int


class _FreedLog:
    """Inodes of shared arrays the parent collected, for children to unmap (the newest
    ``maxlen``: a child that missed older ones keeps those mappings until its LRU drops them)."""

    def __init__(self, maxlen: int = 4096) -> None:
        self._inodes: deque[int] = deque(maxlen=maxlen)
        self.total = 0
        self._lock = threading.RLock()  # a finalizer may run inside since() on this thread

    def add(self, inode: int) -> None:
        with self._lock:
            self._inodes.append(inode)
            self.total += 1

    def since(self, seen: int) -> tuple[list[int], int]:
        """Inodes added after the first ``seen``, and the new count seen."""
        if seen == self.total:
            return [], seen
        with self._lock:
            new = min(self.total - seen, len(self._inodes))
            return list(self._inodes)[len(self._inodes) - new :], self.total


_FREED = _FreedLog()


def _freed(inode: int, fd: int) -> None:
    os.close(fd)
    _FREED.add(inode)


def shared_bytes(nbytes: int) -> npt.NDArray[np.uint8]:
    """A writable uint8 array of ``nbytes`` in shared memory (a memfd a child can map).

    A ``BufferPool`` allocator: the pool's float32 arrays are views of such arrays.
    """
    fd = os.memfd_create("ddq-buffer", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        mapped = _SharedMap(fd, max(nbytes, 1))
    except BaseException:
        os.close(fd)
        raise
    mapped.fd = fd
    weakref.finalize(mapped, _freed, os.fstat(fd).st_ino, fd)
    return np.frombuffer(mapped, dtype=np.uint8, count=nbytes)


def _shared_fd(array: np.ndarray) -> int | None:
    """The memfd behind ``array`` (a view of ``shared_bytes``), or None."""
    base: Any = array
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview):
        base = base.obj
    return base.fd if isinstance(base, _SharedMap) else None


class _Child:
    """One fetch process and its socket."""

    def __init__(self, settings: tuple[Any, ...], reply_timeout_s: float) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for end in (parent, child):  # room for a big fragment layout in one packet
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_PACKET)
        env = dict(os.environ)  # find this dd_queue even when it is not installed
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_PACKAGE_ROOT, env.get("PYTHONPATH")]))
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "dd_queue.synchronizer.fetchers", str(child.fileno())],
                pass_fds=(child.fileno(),),
                stdin=subprocess.DEVNULL,
                env=env,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        self.sock = parent
        self.sock.settimeout(reply_timeout_s)
        self.seen = _FREED.total  # the child maps nothing yet
        self.fragments: dict[int, Fragment] = {}  # layouts it has been sent
        self.sock.sendall(pickle.dumps(settings))

    def send(self, message: tuple[Any, ...], fd: int) -> None:
        self.sock.sendmsg([pickle.dumps(message)], [_fds(fd)])

    def receive(self) -> tuple[Any, bool, Any]:
        try:
            data = self.sock.recv(MAX_PACKET)
        except TimeoutError:
            data, why = b"", f"no reply within {self.sock.gettimeout()} s; stopped"
        except OSError as exc:  # reset: it died with requests unread
            data, why = b"", f"{exc}"
        else:
            why = "closed its socket"
        if not data:
            raise BusError(f"fetch process {self.proc.pid} died before replying ({why})")
        reply: tuple[Any, bool, Any] = pickle.loads(data)
        return reply

    def close(self) -> None:
        self.sock.close()  # the child exits at EOF
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _fds(fd: int) -> tuple[int, int, bytes]:
    return (socket.SOL_SOCKET, socket.SCM_RIGHTS, np.array([fd], dtype=np.int32).tobytes())


class FetchProcesses:
    """``count`` child processes that read ``up`` entries into shared arrays, round robin.

    Args:
        count: Child processes (≥ 1).
        url: The Redis URL the children connect to.
        run_id: The run.
        options: Redis client options.
        limits: Message limits (``WireConfig.message_limits()``).
        norms: Compute Δ's squared segment norms (an RDA merge) after decoding it.
        keyring: The run's public keys: children check each contribution's signatures
            (``dd_queue.auth``); None checks none.
    """

    def __init__(
        self,
        count: int,
        *,
        url: str,
        run_id: str,
        options: RedisOptions,
        limits: MessageLimits,
        norms: bool,
        keyring: KeyRing | None = None,
    ) -> None:
        if count < 1:
            raise ValueError(f"fetch processes must be ≥ 1, got {count}")
        if not available():
            raise RuntimeError("fetch processes need Linux (memfd and SEQPACKET sockets)")
        self._settings = (url, run_id, options, limits, norms, keyring)
        # a read retries Redis for up to unavailable_after_s, then replies with the error
        self._reply_timeout_s = options.unavailable_after_s + 60.0
        self._children: list[_Child | None] = [None] * count
        # an owner that is dropped without close() still stops its children
        self._finalizer = weakref.finalize(self, _close_children, self._children)
        self._next = 0
        self._where: dict[Any, int] = {}  # ticket → child, until its reply is taken
        self._replies: dict[Any, tuple[bool, Any]] = {}
        self._orphans: set[Any] = set()  # tickets whose reply nobody will take

    @property
    def pids(self) -> tuple[int, ...]:
        """Process ids of the running children."""
        return tuple(c.proc.pid for c in self._children if c is not None)

    def start(self) -> None:
        """Start every child that is not running (reads start them too)."""
        for i in range(len(self._children)):
            self._child(i)

    def submit(self, ticket: Any, entry: Entry, fragment: Fragment, out: np.ndarray) -> None:
        """Start reading ``entry`` into ``out`` (a float32 view of ``shared_bytes``).

        Raises:
            ValueError: ``out`` is not in shared memory.
            BusError: A fetch process could not be started or reached.
        """
        fd = _shared_fd(out)
        if fd is None or out.dtype != np.float32 or out.size != fragment.size:
            raise ValueError("out must be a float32 array of the fragment's size from shared_bytes")
        index = self._next
        self._next = (index + 1) % len(self._children)
        try:
            child = self._child(index)
            forget, child.seen = _FREED.since(child.seen)
            offset = out.ctypes.data - _map_address(out)
            layout = None if child.fragments.get(fragment.index) == fragment else fragment
            child.send((ticket, entry, fragment.index, layout, offset, forget), fd)
            child.fragments[fragment.index] = fragment
        except OSError as exc:
            self._lost(index)
            raise BusError(f"fetch process unreachable: {exc}") from exc
        self._where[ticket] = index

    def result(self, ticket: Any) -> Reply:
        """The reply for ``ticket`` (waits for it): ``(msg, sq_norms)`` or ``"inline"``.

        Raises:
            What ``ops.read_contribution`` raised for the entry, or ``BusError`` if the
            fetch process died.
        """
        while ticket not in self._replies:
            index = self._where.get(ticket)
            if index is None:
                raise KeyError(f"no read was started for {ticket!r}")
            self._receive(index)
        self._where.pop(ticket, None)
        ok, payload = self._replies.pop(ticket)
        if not ok:
            raise payload
        reply: Reply = payload
        return reply

    def forget(self, ticket: Any) -> None:
        """Drop ``ticket``'s reply, now or when it comes."""
        if self._replies.pop(ticket, None) is None and ticket in self._where:
            self._orphans.add(ticket)

    def pending(self, ticket: Any) -> bool:
        """Whether the child may still write into ``ticket``'s array."""
        return ticket in self._where and ticket not in self._replies

    def close(self) -> None:
        """Stop every child (each exits once its socket closes)."""
        _close_children(self._children)
        self._where.clear()
        self._replies.clear()
        self._orphans.clear()

    def _child(self, index: int) -> _Child:
        """Child ``index``, (re)started if needed; the first call starts them all, so that no
        read waits for a child's start-up (imports, ~0.5 s) after the first."""
        if all(c is None for c in self._children):
            for i in range(len(self._children)):
                self._children[i] = _Child(self._settings, self._reply_timeout_s)
            log.info("fetch.started %d fetch processes, pids %s", len(self._children), self.pids)
        child = self._children[index]
        if child is None or child.proc.poll() is not None:
            if child is not None:
                self._lost(index)
            child = self._children[index] = _Child(self._settings, self._reply_timeout_s)
        return child

    def _receive(self, index: int) -> None:
        child = self._children[index]
        try:
            if child is None:
                raise BusError("fetch process gone")
            ticket, ok, payload = child.receive()
        except BusError as exc:
            self._lost(index, exc)  # each of its reads now has this error as its reply
            return
        if ticket in self._orphans:
            self._orphans.discard(ticket)
            self._where.pop(ticket, None)
        else:
            self._replies[ticket] = (ok, payload)

    def _lost(self, index: int, err: BusError | None = None) -> None:
        """Fail every read of child ``index`` (its reply will never come) and forget it."""
        child, self._children[index] = self._children[index], None
        if child is not None:
            child.sock.close()
            if child.proc.poll() is None:
                child.proc.kill()
            child.proc.wait()
        err = err or BusError("fetch process died before replying")
        failed = [t for t, i in self._where.items() if i == index]
        if child is not None:
            log.warning(
                "fetch.lost process %d: %s; %d reads fail", child.proc.pid, err, len(failed)
            )
        for ticket in failed:
            del self._where[ticket]
            if ticket in self._orphans:
                self._orphans.discard(ticket)
            else:
                self._replies[ticket] = (False, err)


def _close_children(children: list[_Child | None]) -> None:
    for i, child in enumerate(children):
        if child is not None:
            child.close()
            children[i] = None


def _map_address(array: np.ndarray) -> int:
    base: Any = array
    while isinstance(base, np.ndarray) and isinstance(base.base, np.ndarray):
        base = base.base
    return int(base.ctypes.data)


# ---------------------------------------------------------------------------------- child


def _serve(sock: socket.socket) -> None:
    """The child: read requests until the parent closes the socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the parent; EOF stops this
    settings = sock.recv(MAX_PACKET)
    if not settings:
        return  # the parent went away before it said anything
    url, run_id, options, limits, norms, keyring = pickle.loads(settings)
    auth = Auth(keyring=keyring)
    bytearray(8 << 20)  # glibc keeps ~1 MB payload buffers on its heap from now on
    bus = RedisBus(url, run_id, options=options)
    maps: OrderedDict[int, mmap.mmap] = OrderedDict()  # inode → mapping
    layouts: dict[int, Fragment] = {}
    while True:
        try:
            data, fds, _, _ = socket.recv_fds(sock, MAX_PACKET, 1)
        except ConnectionResetError:  # the parent closed with requests unread
            return
        if not data:
            return
        ticket, entry, index, layout, offset, forget = pickle.loads(data)
        if layout is not None:
            layouts[index] = layout
        fragment = layouts[index]
        for inode in forget:
            if (gone := maps.pop(inode, None)) is not None:
                gone.close()
        reply: tuple[Any, bool, Any]
        try:
            read = _read(bus, entry, fragment, maps, fds, offset, limits, norms, auth)
            reply = (ticket, True, read)
        except Exception as exc:  # every error goes back to the parent, which raises it
            reply = (ticket, False, exc)
        sock.send(pickle.dumps(reply))


def _read(
    bus: RedisBus,
    entry: Entry,
    fragment: Fragment,
    maps: OrderedDict[int, mmap.mmap],
    fds: list[int],
    offset: int,
    limits: MessageLimits,
    norms: bool,
    auth: Auth,
) -> Reply:
    """``read_contribution`` into the shared array and the norms, or ``"inline"`` for another
    size. No view of a mapping outlives the call (the next request may unmap it)."""
    run_id = bus.keys.run_id
    out = _mapped(maps, fds[0], offset, fragment.size)

    parsed = Contribution.from_fields(entry.fields, run_id=run_id, limits=limits)
    if parsed.tensor.n_elements != fragment.size:
        return "inline"
    msg, delta = ops.read_contribution(
        bus, entry, run_id=run_id, limits=limits, out=out, parsed=parsed, codes=True, auth=auth
    )
    return msg, (segment_sq_norms(delta, fragment) if norms else None)


def _mapped(maps: OrderedDict[int, mmap.mmap], fd: int, offset: int, elements: int) -> F32:
    try:
        inode = os.fstat(fd).st_ino
        mapping = maps.get(inode)
        if mapping is None:
            mapping = maps[inode] = mmap.mmap(fd, os.fstat(fd).st_size)
            if len(maps) > CHILD_MAPPINGS:
                maps.popitem(last=False)[1].close()
        maps.move_to_end(inode)
    finally:
        os.close(fd)
    return np.frombuffer(mapping, dtype=np.float32, count=elements, offset=offset)


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
