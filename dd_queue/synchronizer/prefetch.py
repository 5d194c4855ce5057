"""Reading contributions ahead of the loop that admits them: fetched here, decoded on a worker.

Reading one contribution (``ops.read_contribution``) is a GET of its payload, then checks, a
CRC-32 and a decode into a pooled fragment-sized buffer: an int8/int4 payload keeps its codes
and scales there (``codes=True``: a ``core.blockwise.Blockwise``, 1 B/element, which the merge
reads directly), any other codec is decoded to float32. For an RDA merge, Δ's per-segment
squared norms follow (``core.merge.segment_sq_norms``) while it is in cache, so the merge
reads it once instead of twice (once from memory just for the norms). All but the GET run
outside the GIL (zlib, numpy) and take most of the time, so a ``Prefetcher`` runs them for the
next entries on a worker thread while the synchronizer's loop admits, merges and commits the
ones before them.
The GET itself is made on the loop's thread, when an entry enters the read-ahead window, and
handed to the worker's ``read_contribution`` in place of the bus's ``get_blob``: a GET holds
and releases the GIL dozens of times per MB (socket reads, reply parsing), and from a second
thread that ping-pong slowed the merge's numpy loop ~2x (measured), while decoding beside it
costs the merge nothing. The GET is made only for a reference within ``max_blob_bytes`` (the
bound ``read_contribution`` checks before fetching), and its outcome (bytes, ``BlobMissing``,
any other error) is what ``read_contribution`` gets from ``get_blob`` at the same point of its
checks, so the checks, their order and their errors are unchanged.

Everything else stays on the loop's thread, in entry order: the loop asks for each entry's
result when it reaches the entry and gets exactly what an inline read returns, or raises what
it raises (``ProtocolError``, ``BlobMissing``, ``BusError``), so validation, dead-lettering,
admission and the fenced commits are unchanged. A read ahead of time may find a payload that an
earlier entry's commit deletes a moment later; only a duplicate or late twin of a merged entry
shares a payload, and admission settles such an entry by its outcome either way, never merging
it.

Without a worker (``threads=0``: ``MemoryBus`` and the deterministic in-process runner), an
entry is read when its result is asked for: the same calls in the same order as a plain loop.
Both ways run the same ``_read_now`` (read, decode, norms), so results are bit-identical.

With fetch processes (``processes > 0``; ``fetchers``, Linux) the GET, the checks, the
decode and the norms all run in child processes, each with its own interpreter and Redis
connection, and the child decodes into the very pooled array (in shared memory) that the loop then
merges from (codes and scales, or float32: ``codec.codes_view`` gives the loop the same
``Blockwise`` views of its buffer that the child wrote). The loop only sends requests and takes
replies, so neither side waits for the other's GIL; a reply is what ``_read_now`` returns or raises
for the entry (a payload of another size is read here, inline). A read that is discarded before its
reply keeps its array out of the pool (the child may still be writing into it).

Memory: at most ``window`` entries, and at most ``window_bytes`` of decoded float32, are read
ahead of the loop; further submitted entries wait (as references) for their turn.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NamedTuple, cast

from dd_queue.bus import BlobRef, Bus, Entry, ops
from dd_queue.core.blockwise import Delta
from dd_queue.core.codec import codes_view, keeps_codes
from dd_queue.core.fragments import Fragment
from dd_queue.core.merge import F32, F64, needs_norms, segment_sq_norms
from dd_queue.errors import DDQError
from dd_queue.messages import Contribution
from dd_queue.synchronizer import fetchers
from dd_queue.synchronizer.context import Context

__all__ = ["Decoded", "Prefetcher", "Read"]

log = logging.getLogger("dd_queue.synchronizer")


class Decoded(NamedTuple):
    """One read ``up`` entry: ``ops.read_contribution``'s message and Δ (float32, or an
    int8/int4 payload's codes: a ``Blockwise`` in a pooled buffer), and Δ's squared segment
    norms (``segment_sq_norms``; None for a mean merge, or a Δ of another size, which
    admission refuses)."""

    msg: Contribution
    delta: Delta
    sq_norms: F64 | None


Read = Callable[[Entry], Decoded]
"""Reads one ``up`` entry: its ``Decoded``, or ``ops.read_contribution``'s exception."""

WINDOW = 16
"""Most entries read ahead."""
WINDOW_BYTES = 128 << 20
"""Most decoded float32 bytes read ahead (4 B × elements per entry)."""

_Key = tuple[str, str]  # (stream, entry id)


class Prefetcher:
    """Reads ``up`` entries ahead of time in ``processes`` fetch processes, else on ``threads``
    worker threads (both 0: inline, when asked).

    Args:
        ctx: The synchronizer's context (bus, run id, limits, Redis settings).
        threads: Worker threads; 0 reads inline. Ignored when ``processes`` > 0.
        processes: Fetch processes (``fetchers``; needs a ``RedisBus`` made from a
            URL, and Linux).
        window: Most entries read ahead.
        window_bytes: Most decoded bytes read ahead.
    """

    def __init__(
        self,
        ctx: Context,
        *,
        threads: int,
        processes: int = 0,
        window: int = WINDOW,
        window_bytes: int = WINDOW_BYTES,
    ) -> None:
        if threads < 0 or processes < 0 or window < 1 or window_bytes < 1:
            raise ValueError(
                f"bad prefetch settings: {threads=}, {processes=}, {window=}, {window_bytes=}"
            )
        self._ctx = ctx
        self._window, self._window_bytes = window, window_bytes
        self._norms = needs_norms(ctx.sync.merge_rule)
        self._procs: fetchers.FetchProcesses | None = None
        self._pool: ThreadPoolExecutor | None = None
        if processes:
            if (address := ctx.bus.address) is None:
                raise ValueError("fetch processes need a bus other processes reach (Redis by URL)")
            self._procs = fetchers.FetchProcesses(
                processes,
                url=address.url,
                run_id=ctx.run_id,
                options=address.options,
                limits=ctx.limits,
                norms=self._norms,
                keyring=ctx.auth.keyring,
            )
            ctx.buffers.allocate_with(fetchers.shared_bytes)  # children decode into them
        elif threads:
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix=f"ddq-{ctx.owner}-fetch")
        self._waiting: OrderedDict[_Key, tuple[Entry, Fragment]] = OrderedDict()
        # a started read and its decoded bytes
        self._started: dict[_Key, tuple[Future[Decoded] | _InChild, int]] = {}
        self._started_bytes = 0
        self._tickets = itertools.count()

    @property
    def threaded(self) -> bool:
        """Whether entries are read ahead (on a worker thread or in fetch processes)."""
        return self._pool is not None or self._procs is not None

    def start(self) -> None:
        """Start the fetch processes now (else the first read does; they import for ~0.5 s)."""
        if self._procs is not None:
            self._procs.start()

    def submit(self, entries: Iterable[Entry], *, fragment: Fragment) -> None:
        """Queue entries to read ahead, in this order (a no-op without a worker).

        Args:
            entries: Entries the loop will ask for (not deleted, not yet offered).
            fragment: Their fragment (its size bounds memory; its segments, the norms).
        """
        if not self.threaded:
            return
        for entry in entries:
            key = (entry.stream, entry.id)
            if key not in self._started:
                self._waiting[key] = (entry, fragment)
        self._top_up()

    def read(self, entry: Entry, *, fragment: Fragment) -> Decoded:
        """The entry's contribution: read ahead if it was, else read now on this thread.

        Args:
            entry: The entry.
            fragment: Its fragment: a payload of its size is decoded into a pooled array
                (``ctx.buffers``; give it back when done with it).

        Raises:
            What ``ops.read_contribution`` raises for it.
        """
        key = (entry.stream, entry.id)
        started = self._started.pop(key, None)
        self._waiting.pop(key, None)
        if started is None:
            self._top_up()
            return self._read_now(entry, self._ctx.bus, fragment)
        read, nbytes = started
        self._started_bytes -= nbytes
        self._top_up()
        if isinstance(read, _InChild):
            return self._from_child(read, entry, fragment)
        return read.result()

    def discard(self, entries: Iterable[Entry]) -> None:
        """Forget entries the loop will not ask for (a read already running finishes alone)."""
        for entry in entries:
            key = (entry.stream, entry.id)
            self._waiting.pop(key, None)
            if (started := self._started.pop(key, None)) is not None:
                self._cancel(started[0])
                self._started_bytes -= started[1]
        self._top_up()

    def clear(self) -> None:
        """Forget everything submitted."""
        for read, _ in self._started.values():
            self._cancel(read)
        self._waiting.clear()
        self._started.clear()
        self._started_bytes = 0

    def close(self) -> None:
        """Forget everything and stop the worker (a running read finishes alone)."""
        self.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._procs is not None:
            self._procs.close()

    def _read_now(self, entry: Entry, bus: Bus, fragment: Fragment) -> Decoded:
        """``ops.read_contribution``, into a pooled array when the payload has the fragment's
        size (another size is left to it, and refused by the caller as incompatible, as
        before), then the norms of the decoded Δ while it is in cache."""
        ctx, elements = self._ctx, fragment.size
        out = parsed = None
        try:
            parsed = Contribution.from_fields(entry.fields, run_id=ctx.run_id, limits=ctx.limits)
        except DDQError:
            pass  # read_contribution raises it again, in its order
        else:
            header = parsed.tensor
            zero_copy = header.codec == "fp32" and not header.zstd and not header.shuffle
            if header.n_elements == elements and not zero_copy:  # fp32 decodes to a view
                out = ctx.buffers.take(elements)
        try:
            msg, delta = ops.read_contribution(
                bus,
                entry,
                run_id=ctx.run_id,
                limits=ctx.limits,
                out=out,
                parsed=parsed,
                codes=True,
                auth=ctx.auth,
            )
            norms = None
            if self._norms and delta.size == elements:
                norms = segment_sq_norms(delta, fragment)
            return Decoded(msg, delta, norms)
        except BaseException:
            if out is not None:
                ctx.buffers.give([out])
            raise

    def _from_child(self, read: _InChild, entry: Entry, fragment: Fragment) -> Decoded:
        """A fetch process's reply to ``read``, as ``_read_now`` would give it."""
        assert self._procs is not None
        try:
            reply = self._procs.result(read.ticket)
        except Exception:  # its reply, or its death: either way no child writes there now
            self._ctx.buffers.give([read.out])
            raise
        if isinstance(reply, str):  # "inline": another size than the fragment's; as before
            self._ctx.buffers.give([read.out])
            return self._read_now(entry, self._ctx.bus, fragment)
        msg, sq_norms = reply
        delta = codes_view(msg.tensor, read.out) if keeps_codes(msg.tensor) else read.out
        return Decoded(msg, delta, sq_norms)

    def _cancel(self, read: Future[Decoded] | _InChild) -> None:
        if isinstance(read, _InChild):
            assert self._procs is not None
            self._procs.forget(read.ticket)  # its array stays out of the pool: see module doc
        else:
            read.cancel()

    def _top_up(self) -> None:
        while self.threaded and self._waiting and len(self._started) < self._window:
            key, (entry, fragment) = next(iter(self._waiting.items()))
            nbytes = 4 * fragment.size
            if self._started and self._started_bytes + nbytes > self._window_bytes:
                return
            del self._waiting[key]
            self._started[key] = (self._start(entry, fragment), nbytes)
            self._started_bytes += nbytes

    def _start(self, entry: Entry, fragment: Fragment) -> Future[Decoded] | _InChild:
        if self._procs is not None:
            read = _InChild(next(self._tickets), self._ctx.buffers.take(fragment.size))
            try:
                self._procs.submit(read.ticket, entry, fragment, read.out)
            except BaseException:
                self._ctx.buffers.give([read.out])  # never sent
                raise
            return read
        assert self._pool is not None
        return self._pool.submit(self._read_now, entry, self._fetched(entry), fragment)

    def _fetched(self, entry: Entry) -> Bus:
        """The bus for the worker's read of ``entry``, its payload fetched now when allowed."""
        ctx = self._ctx
        try:
            ref = ops.blob_ref(entry)
        except DDQError:
            return ctx.bus  # read_contribution refuses the entry before fetching anything
        if ref.nbytes > ctx.limits.max_blob_bytes:
            return ctx.bus  # refused as too large before fetching
        try:
            outcome: bytes | DDQError = ctx.bus.get_blob(ref)
        except DDQError as exc:  # BlobMissing, CorruptPayload, BusError: raised in order later
            outcome = exc
        return cast(Bus, _Fetched(ctx.bus, ref, outcome))


class _InChild(NamedTuple):
    """A read started in a fetch process: its ticket and the array it decodes into."""

    ticket: int
    out: F32


class _Fetched:
    """The bus, except that ``get_blob`` of one reference answers what was fetched for it."""

    def __init__(self, bus: Bus, ref: BlobRef, outcome: bytes | DDQError) -> None:
        self._bus, self._ref, self._outcome = bus, ref, outcome

    def get_blob(self, ref: BlobRef) -> bytes:
        if ref != self._ref:
            return self._bus.get_blob(ref)
        if isinstance(self._outcome, DDQError):
            raise self._outcome
        return self._outcome

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bus, name)
