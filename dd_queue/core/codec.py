"""Tensor payload codecs for flat float32 vectors, with bounded, checksummed decoding.

A payload is one fragment's tensors concatenated into a flat float32 vector (the caller keeps the
shapes). ``encode`` makes raw codec bytes, optionally byte-shuffled and zstd-compressed; ``decode``
checks every size against ``DecodeLimits`` before allocating, bounds decompression, verifies the
checksum, then rebuilds the vector (into the caller's buffer when given one).

Codecs and their per-element error bounds (x̂ = decode(encode(x)); absmax and s are per block):

- ``fp32``: 4 B/element, bit-exact (−0.0, subnormals and extremes included).
- ``bf16``: 2 B/element, round-to-nearest-even to bfloat16 (the top 16 bits of the float32):
  |x̂ − x| ≤ 2⁻⁸·|x| for normal x, ≤ 2⁻¹³⁴ for subnormal x. |x| ≥ 3.3961776e38 would round to Inf
  and is rejected.
- ``int8``: blocks of ``block_size`` elements, scale s = absmax/127 (float32), q = rint(x/s) in
  [−127, 127]: |x̂ − x| ≤ s/2 + 2⁻²¹·absmax + 2⁻¹⁴⁰; the last two terms are float32 rounding of
  the scale and product (2⁻¹⁴⁰ only matters when absmax is subnormal). 4 + block_size bytes per
  block: 1.016 B/element at block_size 256. |x| ≥ 2¹²⁶ (≈ 8.5e37) is rejected (q·s could
  round to Inf).
- ``int4``: as int8 with s = absmax/7, q in [−7, 7] stored as q + 8, two per byte (low nibble
  first); same bound with s = absmax/7. 4 + block_size/2 bytes per block: 0.5625 B/element at 64.
  ~11 % relative error per message: use it with error feedback (research/redis-pipeline.md).

Scales are float32, not float16: outer gradients are ~1e-4..1e-2, so absmax/127 lands in float16's
subnormal range (< 6.1e-5), where it keeps only a few significant bits.

Raw layout (little-endian): fp32 = the values; bf16 = their uint16 top halves; int8/int4 = one
float32 scale per block, then the integers. ``shuffle`` stores fp32/bf16 bytes by plane (byte 0 of
every value, then byte 1, ...) before zstd; it pays for deltas of bf16-stored weights
(research/redis-pipeline.md §C.1: ~1.0 B/element, lossless).

Checksum: CRC-32 (zlib) of the raw bytes as decompressed, seeded with codec, dtype, n_elements,
block_size, shuffle and raw_nbytes, so a flipped header field fails it too. zlib's crc32 runs at
~2–3 GB/s of raw bytes here: the largest single cost of fp32 decode.

Pure: imports no redis, fastapi, asyncio, threading, time, os or socket.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import numpy.typing as npt
import zstandard

from dd_queue.errors import (
    CoreError,
    CorruptPayload,
    IncompatibleMessage,
    NonFiniteValues,
    PayloadTooLarge,
)

__all__ = [
    "CODEC_NAMES",
    "CodecName",
    "CodecSpec",
    "DecodeLimits",
    "EncodedTensor",
    "TensorHeader",
    "check_header",
    "decode",
    "encode",
    "raw_nbytes_for",
]

CodecName = Literal["fp32", "bf16", "int8", "int4"]
CODEC_NAMES: Final[tuple[CodecName, ...]] = ("fp32", "bf16", "int8", "int4")
DTYPE: Final = "float32"
MIN_BLOCK_SIZE: Final = 8
MAX_BLOCK_SIZE: Final = 1 << 20
MAX_ZSTD_LEVEL: Final = 22

Float32Array = npt.NDArray[np.float32]
_U8 = npt.NDArray[np.uint8]
_Words = npt.NDArray[np.uint16] | npt.NDArray[np.uint32]
_LEVELS: Final = {"int8": 127, "int4": 7}
_ITEMSIZE: Final = {"fp32": 4, "bf16": 2}
_BF16_OVERFLOW: Final = float(np.array([0x7F7F8000], dtype=np.uint32).view(np.float32)[0])
_F32_MAX: Final = float(np.finfo(np.float32).max)
_INF_BITS: Final = 0x7F800000
_BLOCKWISE_LIMIT_BITS: Final = 0x7E800000  # 2^126: larger values are rejected by int8/int4
_SAFE_ABSMAX: Final = 2.0**-100  # below it levels/absmax can overflow float32: use float64
_CHUNK_ELEMENTS: Final = 1 << 16  # 256 KiB of float32 per pass keeps temporaries in L2
_MIN_WINDOW_BYTES: Final = 1 << 10
_MAX_WINDOW_BYTES: Final = 1 << 31
_NIBBLES: Final = np.arange(256, dtype=np.int16)
# byte → its two signed nibbles (low first) as the two int8 bytes of a little-endian uint16
_INT4_PAIRS: Final = (((_NIBBLES & 0xF) - 8) & 0xFF | (((_NIBBLES >> 4) - 8) & 0xFF) << 8).astype(
    "<u2"
)


@dataclass(frozen=True, slots=True)
class CodecSpec:
    """How to encode a payload (see the module docstring for each codec's error bound).

    Attributes:
        name: ``fp32``, ``bf16``, ``int8`` or ``int4``.
        block_size: Elements per scale for int8/int4, in [8, 2²⁰] (256 suits int8, 64 int4);
            ignored by fp32/bf16.
        zstd_level: zstandard level 1..22 after the codec; 0 or None = off.
        shuffle: Store fp32/bf16 bytes by plane before zstd (requires zstd).

    Raises:
        CoreError: On a value outside these ranges.
    """

    name: CodecName = "bf16"
    block_size: int = 256
    zstd_level: int | None = None
    shuffle: bool = False

    def __post_init__(self) -> None:
        if self.name not in CODEC_NAMES:
            raise CoreError(f"CodecSpec.name must be one of {CODEC_NAMES}, got {self.name!r}")
        if not _is_int(self.block_size) or not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            raise CoreError(
                f"CodecSpec.block_size must be an integer in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]"
                f", got {self.block_size!r}; 256 suits int8, 64 int4"
            )
        level = self.zstd_level
        if level is not None and (not _is_int(level) or not 0 <= level <= MAX_ZSTD_LEVEL):
            raise CoreError(
                f"CodecSpec.zstd_level must be 0..{MAX_ZSTD_LEVEL} or None, got {level!r}"
            )
        if self.shuffle and (self.name not in _ITEMSIZE or not level):
            raise CoreError(
                f"CodecSpec.shuffle needs fp32/bf16 and zstd_level ≥ 1 (got {self.name!r}, "
                f"level {level!r}); set shuffle=False"
            )

    @property
    def zstd_enabled(self) -> bool:
        """Whether zstandard compression follows the codec."""
        return bool(self.zstd_level)


@dataclass(frozen=True, slots=True)
class DecodeLimits:
    """Sizes every decode checks before allocating anything large.

    Attributes:
        max_payload_bytes: Largest payload accepted as received (compressed or not), bytes.
        max_decompressed_bytes: Largest raw codec byte count (bounds zstd output), bytes.
        max_elements: Largest decoded element count.

    Raises:
        CoreError: If a limit is not a positive integer.
    """

    max_payload_bytes: int = 2 << 30
    max_decompressed_bytes: int = 8 << 30
    max_elements: int = 1 << 31

    def __post_init__(self) -> None:
        for name in ("max_payload_bytes", "max_decompressed_bytes", "max_elements"):
            if not _is_int(value := getattr(self, name)) or value < 1:
                raise CoreError(f"DecodeLimits.{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True, slots=True)
class TensorHeader:
    """What a receiver needs to decode and verify a payload; it travels in the message envelope.

    Attributes:
        codec: ``fp32``, ``bf16``, ``int8`` or ``int4``.
        n_elements: float32 elements encoded.
        block_size: Elements per scale for int8/int4; 0 for fp32/bf16.
        zstd: Whether the payload is a zstandard frame of the raw bytes.
        shuffle: Whether the raw bytes are stored by byte plane.
        raw_nbytes: Raw codec bytes (after decompression), bytes.
        checksum: Seeded CRC-32 of the raw bytes (see the module docstring).
        dtype: Element type of the decoded vector; always ``float32``.
    """

    codec: str
    n_elements: int
    block_size: int
    zstd: bool
    shuffle: bool
    raw_nbytes: int
    checksum: int
    dtype: str = DTYPE


@dataclass(frozen=True, slots=True)
class EncodedTensor:
    """An encoded payload: ``header`` to send in the envelope, ``payload`` bytes to store.

    ``payload`` is a flat byte view that never aliases the encoded input.
    """

    header: TensorHeader
    payload: memoryview


def raw_nbytes_for(codec: str, n_elements: int, block_size: int) -> int:
    """Raw codec bytes (before zstd) of ``n_elements`` elements; ``block_size`` for int8/int4.

    Raises:
        IncompatibleMessage: If ``codec`` is unknown.
    """
    if codec in _ITEMSIZE:
        return _ITEMSIZE[codec] * n_elements
    if codec not in _LEVELS:
        raise IncompatibleMessage(f"unknown codec {codec!r}; this build knows {CODEC_NAMES}")
    n_blocks = -(-n_elements // block_size)
    return 4 * n_blocks + (n_elements if codec == "int8" else (n_elements + 1) // 2)


# ----------------------------------------------------------------------------- encode


def encode(x: Float32Array, spec: CodecSpec) -> EncodedTensor:
    """Encode a float32 vector.

    Args:
        x: float32 array of any shape (flattened in C order; copied only if not contiguous).
        spec: The codec.

    Returns:
        The header and the payload.

    Raises:
        CoreError: If ``x`` is not a float32 numpy array.
        NonFiniteValues: If ``x`` holds NaN or Inf (or, for bf16, values that round to Inf).
    """
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        got = x.dtype if isinstance(x, np.ndarray) else type(x).__name__
        raise CoreError(f"encode needs a float32 numpy array, got {got}; use x.astype(np.float32)")
    flat = np.ascontiguousarray(x).reshape(-1)
    block_size = spec.block_size if spec.name in _LEVELS else 0
    if block_size:
        raw = _encode_blockwise(flat, spec.name, block_size)
    else:
        absmax = _absmax(flat)
        if not np.isfinite(absmax):
            raise NonFiniteValues("input holds NaN or Inf; it must not be sent (never merged)")
        if spec.name == "bf16" and absmax >= _BF16_OVERFLOW:
            raise NonFiniteValues(f"|x| = {absmax:.4g} rounds to Inf in bf16; use fp32")
        words = flat.view(np.uint32) if spec.name == "fp32" else _bf16_words(flat)
        raw = _split_planes(words) if spec.shuffle else words.view(np.uint8).copy()
    seed = _seed(spec.name, flat.size, block_size, spec.shuffle, raw.nbytes)
    header = TensorHeader(
        codec=spec.name,
        n_elements=flat.size,
        block_size=block_size,
        zstd=spec.zstd_enabled,
        shuffle=spec.shuffle,
        raw_nbytes=raw.nbytes,
        checksum=zlib.crc32(raw.data, seed),
    )
    if spec.zstd_level:
        compressed = zstandard.ZstdCompressor(level=spec.zstd_level).compress(raw.data)
        return EncodedTensor(header, memoryview(compressed))
    return EncodedTensor(header, raw.data)


def _absmax(a: Float32Array) -> float:
    """max |a| by two reductions (no temporary); NaN if ``a`` holds NaN."""
    return float(np.maximum(a.max(), -a.min())) if a.size else 0.0


def _bf16_words(flat: Float32Array) -> npt.NDArray[np.uint16]:
    """Round to nearest even: add 0x7FFF plus the kept LSB, keep the top 16 bits."""
    words = np.empty(flat.size, dtype=np.uint16)
    bits = flat.view(np.uint32)
    scratch = np.empty(min(flat.size, _CHUNK_ELEMENTS), dtype=np.uint32)
    for c0 in range(0, flat.size, _CHUNK_ELEMENTS):
        u = bits[c0 : c0 + _CHUNK_ELEMENTS]
        t = scratch[: u.size]
        np.right_shift(u, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, 0x7FFF, out=t)
        np.add(t, u, out=t)  # finite |x| < 2^128: no carry into the sign bit
        np.right_shift(t, 16, out=t)
        np.copyto(words[c0 : c0 + u.size], t, casting="unsafe")
    return words


def _encode_blockwise(flat: Float32Array, codec: str, block_size: int) -> _U8:
    n = flat.size
    n_full, tail = divmod(n, block_size)
    n_blocks = n_full + (tail > 0)
    raw = np.empty(raw_nbytes_for(codec, n, block_size), dtype=np.uint8)
    scales = raw[: 4 * n_blocks].view("<f4")
    q = raw[4 * n_blocks :].view(np.int8) if codec == "int8" else np.empty(n + 1, np.int8)
    per_chunk = max(1, _CHUNK_ELEMENTS // block_size)
    scratch = np.empty((min(per_chunk, n_full), block_size), dtype=np.float32)
    for b0 in range(0, n_full, per_chunk):
        b1 = min(b0 + per_chunk, n_full)
        e0, e1 = b0 * block_size, b1 * block_size
        q_rows = q[e0:e1].reshape(-1, block_size)
        _quantize(flat[e0:e1].reshape(-1, block_size), codec, scales[b0:b1], q_rows, scratch)
    if tail:  # the last, partial block: quantize it zero-padded
        padded = np.zeros((1, block_size), dtype=np.float32)
        padded[0, :tail] = flat[n_full * block_size :]
        q_tail = np.empty((1, block_size), dtype=np.int8)
        _quantize(padded, codec, scales[n_full:], q_tail, np.empty_like(padded))
        q[n_full * block_size : n] = q_tail[0, :tail]
    if codec == "int4":  # two nibbles per byte, low first, as q + 8; an odd tail pads q = 0
        q[n] = 0
        pairs = q[: 2 * (raw.size - 4 * n_blocks)].view(np.uint8)
        np.add(pairs, 8, out=pairs)
        words = pairs.view("<u2")
        np.copyto(raw[4 * n_blocks :], words | (words >> 4), casting="unsafe")
    return raw


def _quantize(
    rows: Float32Array,
    codec: str,
    scales: Float32Array,
    q: npt.NDArray[np.int8],
    scratch: Float32Array,
) -> None:
    """q = rint(x · levels/absmax) per row; |x · levels/absmax| < levels + 0.5: no clip needed."""
    levels = _LEVELS[codec]
    scratch = scratch[: rows.shape[0]]
    # |x| as bits (sign cleared): integer order is float order, NaN/Inf bits are ≥ 0x7F800000,
    # and an integer max runs ~2× faster than a float max.
    absmax_bits = np.bitwise_and(rows.view(np.int32), 0x7FFFFFFF, out=scratch.view(np.int32))
    absmax_bits = absmax_bits.max(axis=1)
    if (top := absmax_bits.max()) >= _INF_BITS:
        raise NonFiniteValues("input holds NaN or Inf; it must not be sent (never merged)")
    if top >= _BLOCKWISE_LIMIT_BITS:
        raise NonFiniteValues(f"|x| ≥ 2^126 could decode to Inf with {codec}; use fp32")
    absmax = absmax_bits.view(np.float32)
    np.divide(absmax, np.float32(levels), out=scales)
    normal = absmax >= _SAFE_ABSMAX
    inv = np.zeros_like(absmax)
    np.divide(np.float32(levels), absmax, out=inv, where=normal)
    np.multiply(rows, inv[:, None], out=scratch)
    np.rint(scratch, out=scratch)
    if (tiny := ~normal & (absmax > 0)).any():  # rare: levels/absmax overflows float32
        scale_up = levels / absmax[tiny].astype(np.float64)
        scratch[tiny] = np.rint(rows[tiny].astype(np.float64) * scale_up[:, None])
    np.copyto(q, scratch, casting="unsafe")


def _split_planes(words: _Words) -> _U8:
    """Byte shuffle: plane k holds byte k (little-endian) of every word."""
    n, itemsize = words.size, words.itemsize
    planes = np.empty((itemsize, n), dtype=np.uint8)
    scratch = np.empty(min(n, _CHUNK_ELEMENTS), dtype=words.dtype)
    for c0 in range(0, n, _CHUNK_ELEMENTS):
        u = words[c0 : c0 + _CHUNK_ELEMENTS]
        c1 = c0 + u.size
        np.copyto(planes[0, c0:c1], u, casting="unsafe")  # the cast keeps the low byte
        for k in range(1, itemsize):
            np.right_shift(u, 8 * k, out=scratch[: u.size])
            np.copyto(planes[k, c0:c1], scratch[: u.size], casting="unsafe")
    return planes.reshape(-1)


def _merge_planes(raw: _U8, words: _Words) -> None:
    """Inverse of ``_split_planes``, written into ``words``."""
    planes = raw.reshape(words.itemsize, words.size)
    for c0 in range(0, words.size, _CHUNK_ELEMENTS):
        w = words[c0 : c0 + _CHUNK_ELEMENTS]
        c1 = c0 + w.size
        np.copyto(w, planes[-1, c0:c1])
        for k in range(words.itemsize - 2, -1, -1):
            np.left_shift(w, 8, out=w)
            np.bitwise_or(w, planes[k, c0:c1], out=w)


def _seed(codec: str, n: int, block_size: int, shuffle: bool, raw_nbytes: int) -> int:
    return zlib.crc32(f"ddq/{codec}/{DTYPE}/{n}/{block_size}/{int(shuffle)}/{raw_nbytes}".encode())


# ----------------------------------------------------------------------------- decode


def check_header(header: TensorHeader, limits: DecodeLimits) -> None:
    """Validate a header alone, e.g. before fetching its payload.

    Raises:
        IncompatibleMessage: Unknown codec, or a dtype other than float32.
        CorruptPayload: Mistyped or inconsistent fields (e.g. raw_nbytes vs n_elements).
        PayloadTooLarge: n_elements or raw_nbytes above ``limits``.
    """
    h = header
    if h.codec not in CODEC_NAMES:
        raise IncompatibleMessage(f"unknown codec {h.codec!r}; this build knows {CODEC_NAMES}")
    if h.dtype != DTYPE:
        raise IncompatibleMessage(f"dtype {h.dtype!r} is not supported; payloads are float32")
    ints = (h.n_elements, h.block_size, h.raw_nbytes, h.checksum)
    if not all(_is_int(v) and v >= 0 for v in ints) or h.checksum >= 1 << 32:
        raise CorruptPayload(f"header counts must be non-negative integers: {h}")
    if not isinstance(h.zstd, bool) or not isinstance(h.shuffle, bool):
        raise CorruptPayload(f"header zstd/shuffle must be booleans: {h}")
    if h.n_elements > limits.max_elements:
        raise PayloadTooLarge(f"{h.n_elements} elements exceed max_elements={limits.max_elements}")
    blockwise = h.codec in _LEVELS
    valid_block = (
        MIN_BLOCK_SIZE <= h.block_size <= MAX_BLOCK_SIZE if blockwise else not h.block_size
    )
    if not valid_block or (h.shuffle and (blockwise or not h.zstd)):
        raise CorruptPayload(f"block_size/shuffle/zstd are inconsistent with codec {h.codec}: {h}")
    if h.raw_nbytes != (expected := raw_nbytes_for(h.codec, h.n_elements, h.block_size)):
        raise CorruptPayload(f"raw_nbytes {h.raw_nbytes} != {expected} implied by {h}")
    if h.raw_nbytes > limits.max_decompressed_bytes:
        raise PayloadTooLarge(
            f"raw payload of {h.raw_nbytes} bytes exceeds "
            f"max_decompressed_bytes={limits.max_decompressed_bytes}"
        )


def decode(
    header: TensorHeader,
    payload: bytes | bytearray | memoryview,
    *,
    out: Float32Array | None = None,
    limits: DecodeLimits,
) -> Float32Array:
    """Decode a payload: sizes checked first, decompression bounded, checksum verified.

    Args:
        header: The payload's header (from the message envelope).
        payload: The payload bytes.
        out: C-contiguous, writable float32 array of ``n_elements`` elements (any shape) to
            decode into and return; its content is unspecified if decoding fails. Without it,
            fp32 without zstd returns a zero-copy view of ``payload`` (read-only if the payload
            is immutable).
        limits: Size limits, enforced before anything large is allocated.

    Returns:
        The decoded vector: ``out`` itself, or a new 1-D array (or view).

    Raises:
        IncompatibleMessage: Unknown codec or dtype.
        CorruptPayload: Inconsistent lengths, truncated or corrupt zstd data, checksum mismatch,
            or ``out`` with another element count (the message does not fit the receiver).
        PayloadTooLarge: A size above ``limits``, or zstd output beyond raw_nbytes.
        NonFiniteValues: The decoded values hold NaN or Inf.
        CoreError: ``payload`` is not bytes-like, or ``out`` is not a writable, C-contiguous
            float32 array.
    """
    check_header(header, limits)
    view = _byte_view(payload)
    if view.nbytes > limits.max_payload_bytes:
        raise PayloadTooLarge(f"payload of {view.nbytes} bytes exceeds {limits.max_payload_bytes}")
    target = _target(out, header.n_elements)
    if header.codec == "fp32" and not header.shuffle:
        return _decode_fp32(header, view, limits, target)
    raw = _verified_raw(header, view, limits, dest=None)
    result = target if target is not None else np.empty(header.n_elements, np.float32)
    flat = result.reshape(-1)
    if header.codec == "fp32":
        _merge_planes(raw, flat.view(np.uint32))
    elif header.codec == "bf16":
        halves = np.frombuffer(raw, dtype="<u2")
        if header.shuffle:
            _merge_planes(raw, halves := np.empty(header.n_elements, np.uint16))
        _bf16_into(halves, flat)
    else:
        _blockwise_into(header, raw, flat)  # finite by its scale check
        return result
    return _finite(result)


def _decode_fp32(
    header: TensorHeader, view: memoryview, limits: DecodeLimits, out: Float32Array | None
) -> Float32Array:
    if out is None and not header.zstd:  # zero-copy: a view of the payload
        return _finite(np.frombuffer(_verified_raw(header, view, limits, dest=None), dtype="<f4"))
    result = out if out is not None else np.empty(header.n_elements, np.float32)
    # decompress (or copy) straight into the result: the only copy made
    _verified_raw(header, view, limits, dest=result.reshape(-1).view(np.uint8))
    return _finite(result)


def _byte_view(payload: bytes | bytearray | memoryview) -> memoryview:
    try:
        view = memoryview(payload)
    except TypeError as exc:
        raise CoreError(f"payload must be bytes-like, got {type(payload).__name__}") from exc
    if not view.c_contiguous:
        raise CoreError("payload must be a contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _target(out: Float32Array | None, n: int) -> Float32Array | None:
    if out is None:
        return None
    if not isinstance(out, np.ndarray) or out.dtype != np.float32:
        raise CoreError("out must be a float32 numpy array")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise CoreError("out must be C-contiguous and writable")
    if out.size != n:
        raise CorruptPayload(
            f"payload holds {n} elements, out holds {out.size}: the message does not match "
            "the receiver's fragment size"
        )
    return out


def _verified_raw(
    header: TensorHeader, view: memoryview, limits: DecodeLimits, *, dest: _U8 | None
) -> _U8:
    """The raw codec bytes (the payload, or its bounded decompression), checksum verified."""
    if header.zstd:
        raw = dest if dest is not None else np.empty(header.raw_nbytes, dtype=np.uint8)
        _decompress_into(view, raw, limits.max_decompressed_bytes)
    elif view.nbytes != header.raw_nbytes:
        raise CorruptPayload(f"payload is {view.nbytes} bytes, header says {header.raw_nbytes}")
    else:
        raw = np.frombuffer(view, dtype=np.uint8)
        if dest is not None:
            dest[...] = raw
    h = header
    actual = zlib.crc32(
        raw.data, _seed(h.codec, h.n_elements, h.block_size, h.shuffle, h.raw_nbytes)
    )
    if actual != h.checksum:
        raise CorruptPayload(
            f"checksum {actual:#010x} != header {h.checksum:#010x}: payload or header altered"
        )
    return raw


def _decompress_into(view: memoryview, dest: _U8, max_decompressed_bytes: int) -> None:
    """Decompress a zstd frame into exactly ``dest``; never writes or allocates beyond it.

    A frame that declares more than ``max_decompressed_bytes``, or (without a declared size)
    produces more than ``dest`` holds, is a bomb: PayloadTooLarge. Other mismatches: corrupt.
    """
    size = dest.nbytes
    try:
        frame = zstandard.get_frame_parameters(view)
    except zstandard.ZstdError as exc:
        raise CorruptPayload(f"payload is not a zstd frame: {exc}") from exc
    declared = frame.content_size
    if declared != zstandard.CONTENTSIZE_UNKNOWN and declared != size:
        error = PayloadTooLarge if declared > max_decompressed_bytes else CorruptPayload
        raise error(f"zstd frame declares {declared} bytes, header says {size}")
    max_window = min(max(_MIN_WINDOW_BYTES, 1 << max(size - 1, 1).bit_length()), _MAX_WINDOW_BYTES)
    if frame.window_size > max_window:
        raise PayloadTooLarge(f"zstd window of {frame.window_size} bytes for {size} raw bytes")
    try:
        dctx = zstandard.ZstdDecompressor(max_window_size=max_window)
        with dctx.stream_reader(view, read_across_frames=True) as reader:
            filled = 0
            while filled < size:
                if not (got := reader.readinto(dest[filled:])):
                    raise CorruptPayload(f"zstd data ends after {filled} of {size} bytes")
                filled += got
            if reader.read(1):
                raise PayloadTooLarge(f"zstd data decompresses to more than raw_nbytes={size}")
    except zstandard.ZstdError as exc:
        raise CorruptPayload(f"zstd data is corrupt: {exc}") from exc


def _finite(values: Float32Array) -> Float32Array:
    if not np.isfinite(_absmax(values.reshape(-1))):
        raise NonFiniteValues("decoded payload holds NaN or Inf; it must not be merged")
    return values


def _bf16_into(halves: npt.NDArray[np.uint16], out: Float32Array) -> None:
    bits = out.view(np.uint32)
    for c0 in range(0, out.size, _CHUNK_ELEMENTS):
        dst = bits[c0 : c0 + _CHUNK_ELEMENTS]
        np.copyto(dst, halves[c0 : c0 + dst.size])
        np.left_shift(dst, 16, out=dst)


def _blockwise_into(header: TensorHeader, raw: _U8, out: Float32Array) -> None:
    n, block_size = header.n_elements, header.block_size
    n_full, tail = divmod(n, block_size)
    n_blocks = n_full + (tail > 0)
    scales = np.frombuffer(raw, dtype="<f4", count=n_blocks)
    levels = _LEVELS[header.codec]
    # |q| ≤ levels + 1 even if altered (int8 −128, int4 nibble −8): this bound keeps q·s finite
    if not _absmax(scales) <= _F32_MAX / (levels + 1):  # also False for NaN
        raise NonFiniteValues(f"a block scale is NaN, Inf or above float32 max/{levels + 1}")
    data = raw[4 * n_blocks :]
    q = data.view(np.int8) if header.codec == "int8" else _unpack_int4(data)
    per_chunk = max(1, _CHUNK_ELEMENTS // block_size)
    for b0 in range(0, n_full, per_chunk):
        e0, e1 = b0 * block_size, min(b0 + per_chunk, n_full) * block_size
        rows = out[e0:e1].reshape(-1, block_size)
        np.multiply(q[e0:e1].reshape(rows.shape), scales[b0 : b0 + rows.shape[0], None], out=rows)
    if tail:
        np.multiply(q[n_full * block_size : n], scales[n_full], out=out[n_full * block_size :])


def _unpack_int4(data: _U8) -> npt.NDArray[np.int8]:
    pairs: npt.NDArray[np.uint16] = np.take(_INT4_PAIRS, data, mode="clip")  # clip: no bounds pass
    return pairs.view(np.int8)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
