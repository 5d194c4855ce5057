"""Blob chunking: splitting payloads into ≤ chunk-size pieces without copying, putting them back
together, and the checks on a blob's size and chunk layout (``check_blob_size`` before a write,
``check_blob_ref`` before a read or delete by a reference).
"""

from __future__ import annotations

from collections.abc import Sequence

from dd_queue.bus.types import MAX_BLOB_BYTES, MAX_BLOB_CHUNKS, BlobData, BlobRef, Buffer
from dd_queue.errors import BlobMissing, CorruptPayload, InvalidArgument
from dd_queue.keys import Keys


def _as_byte_view(buffer: Buffer) -> memoryview:
    view = memoryview(buffer)
    if view.format == "B" and view.ndim == 1:
        return view
    try:
        return view.cast("B")
    except TypeError as exc:  # non-contiguous arrays cannot be viewed as flat bytes
        raise InvalidArgument(
            "blob buffers must be C-contiguous (pass numpy arrays through np.ascontiguousarray)"
        ) from exc


def split_chunks(data: BlobData, chunk_bytes: int) -> tuple[list[Buffer], int]:
    """Cut a payload into chunks of at most ``chunk_bytes``.

    A chunk that lies inside one input buffer is a ``memoryview`` slice of it (no copy); only a
    chunk that straddles buffer boundaries is joined, and then only that chunk is copied.

    Args:
        data: One buffer or a sequence of buffers, written back to back.
        chunk_bytes: Largest chunk, in bytes (``>= 1``).

    Returns:
        ``(chunks, total_bytes)``; an empty payload gives one empty chunk.
    """
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be >= 1, got {chunk_bytes}")
    buffers = _buffers(data)
    chunks: list[Buffer] = []
    pieces: list[memoryview] = []
    filled = 0
    total = 0
    for buffer in buffers:
        view = _as_byte_view(buffer)
        total += len(view)
        while len(view):
            take = min(chunk_bytes - filled, len(view))
            pieces.append(view[:take])
            view = view[take:]
            filled += take
            if filled == chunk_bytes:
                chunks.append(_close(pieces))
                pieces, filled = [], 0
    if pieces or not chunks:
        chunks.append(_close(pieces))
    return chunks, total


def _buffers(data: BlobData) -> Sequence[Buffer]:
    """One buffer, or several only when given as a list or tuple.

    Anything that exposes the buffer protocol (bytes, memoryview, a numpy array) is one buffer:
    iterating a numpy array instead would walk it element by element, ~1000x slower.
    """
    if isinstance(data, list | tuple):
        return data
    try:
        return [memoryview(data)]  # type: ignore[arg-type]  # any buffer-protocol object
    except TypeError as exc:
        raise InvalidArgument(
            f"blob data must be a buffer (bytes, memoryview, numpy array) or a list/tuple of "
            f"buffers, got {type(data).__name__}"
        ) from exc


def _close(pieces: list[memoryview]) -> Buffer:
    if not pieces:
        return b""
    if len(pieces) == 1:
        return pieces[0]
    return b"".join(pieces)


def join_chunks(ref: BlobRef, chunks: Sequence[bytes | None]) -> bytes:
    """Reassemble a blob from its chunk values (as read, ``None`` for a missing key).

    Raises:
        BlobMissing: A chunk key is gone (expired, deleted, or never written).
        CorruptPayload: The chunks do not add up to ``ref.nbytes``.
    """
    missing = [i for i, chunk in enumerate(chunks) if chunk is None]
    if missing:
        raise BlobMissing(
            f"blob {ref.key!r}: chunk(s) {missing} of {ref.n_chunks} missing (expired TTL, "
            "deleted, or the writer died mid-publish); treat the contribution as lost"
        )
    present = [chunk for chunk in chunks if chunk is not None]
    size = sum(len(chunk) for chunk in present)
    if size != ref.nbytes:
        raise CorruptPayload(
            f"blob {ref.key!r}: chunks hold {size} bytes, the reference says {ref.nbytes}; "
            "the key was overwritten by another writer"
        )
    return present[0] if len(present) == 1 else b"".join(present)


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    """Chunks a blob of ``nbytes`` occupies: ``max(1, ceil(nbytes / chunk_bytes))``."""
    return max(1, -(-nbytes // chunk_bytes))


def check_blob_ref(ref: BlobRef, keys: Keys, chunk_bytes: int) -> BlobRef:
    """Refuse a reference (e.g. taken from a stream entry) before reading or deleting by it.

    Raises:
        CorruptPayload: The key is not a blob key of this run (``Keys.is_blob_key``), the size
            is over :data:`MAX_BLOB_BYTES`, or the chunk count does not follow from the size
            and ``chunk_bytes`` (every process of a run must use the same ``blob_chunk_bytes``).
    """
    if not isinstance(ref.key, str) or not keys.is_blob_key(ref.key):
        raise CorruptPayload(
            f"blob reference names {str(ref.key)[:120]!r}, not a blob key of run "
            f"{keys.run_id!r}; refusing to read or delete it"
        )
    if not 0 <= ref.nbytes <= MAX_BLOB_BYTES:
        raise CorruptPayload(f"blob {ref.key!r}: size {ref.nbytes} is over {MAX_BLOB_BYTES}")
    expected = chunk_count(ref.nbytes, chunk_bytes)
    if ref.n_chunks != expected or expected > MAX_BLOB_CHUNKS:
        raise CorruptPayload(
            f"blob {ref.key!r}: {ref.n_chunks} chunks for {ref.nbytes} bytes, expected "
            f"{expected} of {chunk_bytes} bytes (at most {MAX_BLOB_CHUNKS}); a forged reference, "
            "or a writer with another blob_chunk_bytes"
        )
    return ref


def check_blob_size(key: str, nbytes: int, n_chunks: int) -> None:
    """Refuse to write a blob that readers would refuse (:func:`check_blob_ref` limits).

    Raises:
        InvalidArgument: More than :data:`MAX_BLOB_BYTES` or :data:`MAX_BLOB_CHUNKS`.
    """
    if nbytes > MAX_BLOB_BYTES or n_chunks > MAX_BLOB_CHUNKS:
        raise InvalidArgument(
            f"blob {key!r} of {nbytes} bytes in {n_chunks} chunks is over the limit of "
            f"{MAX_BLOB_BYTES} bytes / {MAX_BLOB_CHUNKS} chunks; raise blob_chunk_bytes"
        )
