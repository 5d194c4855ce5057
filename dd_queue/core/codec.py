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

Here: specs, headers, limits, checksum, zstd framing. The raw layout and the float32 ↔ raw kernels
(bf16 rounding, blockwise quantization, nibble packing, byte shuffle) are ``core.quantize``.
``shuffle`` pays for bf16-stored weight deltas (research/redis-pipeline.md §C.1: ~1.0 B/element).

Checksum: CRC-32 (zlib's polynomial and values) of the raw bytes as decompressed, seeded with
codec, dtype, n_elements, block_size, shuffle and raw_nbytes, so a flipped header field fails it
too. It is computed by ISA-L (the ``isal`` package; carry-less multiply): ~50 GB/s here, where
zlib's own crc32 runs at ~1.7 GB/s and was the largest single cost of decoding a payload (9 of
~180 ms of CPU per synchronizer round in bench/bench_synchronizer.py). Where no ``isal`` wheel
exists, zlib's crc32 gives the same values, only slower.

Pure: imports no redis, fastapi, asyncio, threading, time, os or socket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

import numpy as np
import zstandard

try:
    from isal.isal_zlib import crc32 as _crc32
except ImportError:  # no isal wheel for this platform: the same CRC-32, ~30x slower
    from zlib import crc32 as _crc32

from dd_queue.core import quantize
from dd_queue.core.blockwise import Blockwise
from dd_queue.core.quantize import U8, check_finite
from dd_queue.core.quantize import Float32Array as Float32Array  # re-exported
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
    "codes_view",
    "decode",
    "decode_delta",
    "encode",
    "encode_fp32_view",
    "keeps_codes",
    "raw_nbytes_for",
]

CodecName = Literal["fp32", "bf16", "int8", "int4"]
CODEC_NAMES: Final[tuple[CodecName, ...]] = ("fp32", "bf16", "int8", "int4")
DTYPE: Final = "float32"
MIN_BLOCK_SIZE: Final = 8
MAX_BLOCK_SIZE: Final = 1 << 20
MAX_ZSTD_LEVEL: Final = 22

_MIN_WINDOW_BYTES: Final = 1 << 10
_MAX_WINDOW_BYTES: Final = 1 << 31


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
        if self.shuffle and (self.name not in quantize.ITEMSIZE or not level):
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
    if codec not in CODEC_NAMES:
        raise IncompatibleMessage(f"unknown codec {codec!r}; this build knows {CODEC_NAMES}")
    return quantize.raw_nbytes(codec, n_elements, block_size)


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
    block_size = spec.block_size if spec.name in quantize.LEVELS else 0
    raw = quantize.encode_raw(flat, spec.name, block_size, spec.shuffle)
    header = TensorHeader(
        codec=spec.name,
        n_elements=flat.size,
        block_size=block_size,
        zstd=spec.zstd_enabled,
        shuffle=spec.shuffle,
        raw_nbytes=raw.nbytes,
        checksum=_checksum(raw, spec.name, flat.size, block_size, spec.shuffle),
    )
    if spec.zstd_level:
        compressed = zstandard.ZstdCompressor(level=spec.zstd_level).compress(raw.data)
        return EncodedTensor(header, memoryview(compressed))
    return EncodedTensor(header, raw.data)


def encode_fp32_view(x: Float32Array) -> EncodedTensor:
    """``encode(x, CodecSpec("fp32"))`` without the copy: the payload is a read-only view of
    ``x``'s bytes. Same header, checksum and checks; the caller must not change ``x`` while
    the payload is in use (e.g. until the blob holding it is written).

    Raises:
        CoreError: ``x`` is not a C-contiguous float32 numpy array.
        NonFiniteValues: ``x`` holds NaN or Inf.
    """
    if not isinstance(x, np.ndarray) or x.dtype != np.float32 or not x.flags.c_contiguous:
        raise CoreError("encode_fp32_view needs a C-contiguous float32 numpy array")
    flat = x.reshape(-1)
    if not np.isfinite(quantize.absmax(flat)):
        raise NonFiniteValues("input holds NaN or Inf; it must not be sent (never merged)")
    raw = flat.view(np.uint8)
    header = TensorHeader(
        codec="fp32",
        n_elements=flat.size,
        block_size=0,
        zstd=False,
        shuffle=False,
        raw_nbytes=raw.nbytes,
        checksum=_checksum(raw, "fp32", flat.size, 0, False),
    )
    return EncodedTensor(header, raw.data.toreadonly())


def _checksum(raw: U8, codec: str, n_elements: int, block_size: int, shuffle: bool) -> int:
    """CRC-32 of the raw bytes, seeded with the header fields (see the module docstring)."""
    seed = f"ddq/{codec}/{DTYPE}/{n_elements}/{block_size}/{int(shuffle)}/{raw.nbytes}"
    return _crc32(raw.data, _crc32(seed.encode()))


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
    blockwise = h.codec in quantize.LEVELS
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
    view, target = _checked_input(header, payload, out, limits)
    if header.codec == "fp32" and not header.shuffle:
        return _decode_fp32(header, view, limits, target)
    raw = _verified_raw(header, view, limits, dest=None)
    result = target if target is not None else np.empty(header.n_elements, np.float32)
    quantize.decode_raw_into(
        raw, result.reshape(-1), header.codec, header.block_size, header.shuffle
    )
    return result


def keeps_codes(header: TensorHeader) -> bool:
    """Whether ``decode_delta`` keeps this payload's codes: a blockwise codec (int8, int4)
    whose codes and scales fit in the bytes of its float32 vector (all but 1 element)."""
    h = header
    return (
        h.codec in quantize.LEVELS
        and isinstance(h.block_size, int)
        and isinstance(h.n_elements, int)
        and h.block_size >= 1
        and quantize.codes_nbytes(h.n_elements, h.block_size) <= 4 * h.n_elements
    )


def decode_delta(
    header: TensorHeader,
    payload: bytes | bytearray | memoryview,
    *,
    out: Float32Array | None = None,
    limits: DecodeLimits,
) -> Float32Array | Blockwise:
    """``decode``, except that a payload that ``keeps_codes`` is returned as its codes and
    scales (``Blockwise``, values bit-identical to the decoded ones), stored in the bytes of
    ``out`` when given (else in a new array): ``Blockwise.buffer`` is that array, and
    ``codes_view(header, buffer)`` gives the same views again.

    Checks, their order and their errors are ``decode``'s.
    """
    view, target = _checked_input(header, payload, out, limits)
    if not keeps_codes(header):
        return decode(header, payload, out=out, limits=limits)
    buffer = target if target is not None else np.empty(header.n_elements, np.float32)
    store = buffer.reshape(-1).view(np.uint8)
    # int8's raw bytes are its codes' layout: decompress or copy them straight into the store
    dest = store[: header.raw_nbytes] if header.codec == "int8" else None
    raw = _verified_raw(header, view, limits, dest=dest)
    quantize.codes_into(raw, store, header.n_elements, header.codec, header.block_size)
    return codes_view(header, buffer)


def codes_view(header: TensorHeader, buffer: Float32Array) -> Blockwise:
    """The ``Blockwise`` that ``decode_delta`` stored in ``buffer`` for ``header``'s payload
    (one that ``keeps_codes``): views of ``buffer``'s bytes, with ``buffer`` as its buffer."""
    n, b = header.n_elements, header.block_size
    store = buffer.reshape(-1).view(np.uint8)
    head = 4 * -(-n // b)
    return Blockwise(store[head : head + n].view(np.int8), store[:head].view("<f4"), b, buffer)


def _decode_fp32(
    header: TensorHeader, view: memoryview, limits: DecodeLimits, out: Float32Array | None
) -> Float32Array:
    if out is None and not header.zstd:  # zero-copy: a view of the payload
        raw = _verified_raw(header, view, limits, dest=None)
        return check_finite(np.frombuffer(raw, dtype="<f4"))
    result = out if out is not None else np.empty(header.n_elements, np.float32)
    # decompress (or copy) straight into the result: the only copy made
    _verified_raw(header, view, limits, dest=result.reshape(-1).view(np.uint8))
    return check_finite(result)


def _checked_input(
    header: TensorHeader,
    payload: bytes | bytearray | memoryview,
    out: Float32Array | None,
    limits: DecodeLimits,
) -> tuple[memoryview, Float32Array | None]:
    """The header checked, the payload's bytes within the limit, and ``out`` checked."""
    check_header(header, limits)
    view = _byte_view(payload)
    if view.nbytes > limits.max_payload_bytes:
        raise PayloadTooLarge(f"payload of {view.nbytes} bytes exceeds {limits.max_payload_bytes}")
    return view, _target(out, header.n_elements)


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
    header: TensorHeader, view: memoryview, limits: DecodeLimits, *, dest: U8 | None
) -> U8:
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
    if (actual := _checksum(raw, h.codec, h.n_elements, h.block_size, h.shuffle)) != h.checksum:
        raise CorruptPayload(
            f"checksum {actual:#010x} != header {h.checksum:#010x}: payload or header altered"
        )
    return raw


def _decompress_into(view: memoryview, dest: U8, max_decompressed_bytes: int) -> None:
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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
