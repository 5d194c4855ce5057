"""Numeric kernels of the tensor codecs: float32 ↔ raw codec bytes, no headers and no I/O.

``dd_queue.core.codec`` owns sizes, headers, checksums, zstd and limits, and documents each
codec's error bound; this module turns a flat float32 vector into the raw bytes of a codec and
back. Every kernel works in chunks of 2¹⁶ elements so its temporaries stay in L2.

Raw layout (little-endian): fp32 = the values; bf16 = their uint16 top halves, rounded to
nearest even; int8/int4 = one float32 scale per block, then the integers q = rint(x·levels/absmax)
(levels 127 or 7; a partial last block is quantized zero-padded). int4 stores q + 8, two per
byte, low nibble first; an odd tail is padded with q = 0. ``shuffle`` stores fp32/bf16 bytes by
plane (byte 0 of every value, then byte 1, ...), which pays for deltas of bf16-stored weights
before zstd (research/redis-pipeline.md §C.1).

Scales are float32, not float16: outer gradients are ~1e-4..1e-2, so absmax/127 lands in
float16's subnormal range (< 6.1e-5), where it keeps only a few significant bits.

Pure: imports no redis, fastapi, asyncio, threading, time, os or socket.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

from dd_queue.core.blockwise import Blockwise
from dd_queue.errors import NonFiniteValues

__all__ = [
    "ITEMSIZE",
    "LEVELS",
    "absmax",
    "check_finite",
    "codes_into",
    "codes_nbytes",
    "decode_raw_into",
    "encode_raw",
    "raw_nbytes",
]

Float32Array = npt.NDArray[np.float32]
U8 = npt.NDArray[np.uint8]
_Words = npt.NDArray[np.uint16] | npt.NDArray[np.uint32]

LEVELS: Final = {"int8": 127, "int4": 7}
"""Largest |q| of each blockwise codec."""
ITEMSIZE: Final = {"fp32": 4, "bf16": 2}
"""Raw bytes per element of each element-wise codec."""

_BF16_OVERFLOW: Final = float(np.array([0x7F7F8000], dtype=np.uint32).view(np.float32)[0])
_F32_MAX: Final = float(np.finfo(np.float32).max)
_INF_BITS: Final = 0x7F800000
_BLOCKWISE_LIMIT_BITS: Final = 0x7E800000  # 2^126: larger values are rejected by int8/int4
_SAFE_ABSMAX: Final = 2.0**-100  # below it levels/absmax can overflow float32: use float64
_CHUNK_ELEMENTS: Final = 1 << 16  # 256 KiB of float32 per pass keeps temporaries in L2
_NIBBLES: Final = np.arange(256, dtype=np.int16)
# byte → its two signed nibbles (low first) as the two int8 bytes of a little-endian uint16
_INT4_PAIRS: Final = (((_NIBBLES & 0xF) - 8) & 0xFF | (((_NIBBLES >> 4) - 8) & 0xFF) << 8).astype(
    "<u2"
)


def raw_nbytes(codec: str, n_elements: int, block_size: int) -> int:
    """Raw bytes of ``n_elements`` elements of a known codec (``block_size`` for int8/int4)."""
    if codec in ITEMSIZE:
        return ITEMSIZE[codec] * n_elements
    n_blocks = -(-n_elements // block_size)
    return 4 * n_blocks + (n_elements if codec == "int8" else (n_elements + 1) // 2)


def absmax(a: Float32Array) -> float:
    """max |a| by two reductions (no temporary); NaN if ``a`` holds NaN; 0 when empty."""
    return float(np.maximum(a.max(), -a.min())) if a.size else 0.0


def check_finite(values: Float32Array) -> Float32Array:
    """Return ``values`` unchanged.

    Raises:
        NonFiniteValues: ``values`` holds NaN or Inf (a decoded payload that must not be merged).
    """
    if not np.isfinite(absmax(values.reshape(-1))):
        raise NonFiniteValues("decoded payload holds NaN or Inf; it must not be merged")
    return values


# ----------------------------------------------------------------------------- encode


def encode_raw(flat: Float32Array, codec: str, block_size: int, shuffle: bool) -> U8:
    """The raw codec bytes of a flat, C-contiguous float32 vector (a new array).

    Args:
        flat: The values.
        codec: ``fp32``, ``bf16``, ``int8`` or ``int4``.
        block_size: Elements per scale (int8/int4 only).
        shuffle: Store fp32/bf16 bytes by plane.

    Raises:
        NonFiniteValues: NaN or Inf in ``flat``, or values the codec would turn into Inf.
    """
    if codec in LEVELS:
        return _encode_blockwise(flat, codec, block_size)
    top = absmax(flat)
    if not np.isfinite(top):
        raise NonFiniteValues("input holds NaN or Inf; it must not be sent (never merged)")
    if codec == "bf16" and top >= _BF16_OVERFLOW:
        raise NonFiniteValues(f"|x| = {top:.4g} rounds to Inf in bf16; use fp32")
    words = flat.view(np.uint32) if codec == "fp32" else _bf16_words(flat)
    return _split_planes(words) if shuffle else words.view(np.uint8).copy()


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


def _encode_blockwise(flat: Float32Array, codec: str, block_size: int) -> U8:
    n = flat.size
    n_full, tail = divmod(n, block_size)
    n_blocks = n_full + (tail > 0)
    raw = np.empty(raw_nbytes(codec, n, block_size), dtype=np.uint8)
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
    levels = LEVELS[codec]
    scratch = scratch[: rows.shape[0]]
    # |x| as bits (sign cleared): integer order is float order, NaN/Inf bits are ≥ 0x7F800000,
    # and an integer max runs ~2× faster than a float max.
    absmax_bits = np.bitwise_and(rows.view(np.int32), 0x7FFFFFFF, out=scratch.view(np.int32))
    absmax_bits = absmax_bits.max(axis=1)
    if (top := absmax_bits.max()) >= _INF_BITS:
        raise NonFiniteValues("input holds NaN or Inf; it must not be sent (never merged)")
    if top >= _BLOCKWISE_LIMIT_BITS:
        raise NonFiniteValues(f"|x| ≥ 2^126 could decode to Inf with {codec}; use fp32")
    row_absmax = absmax_bits.view(np.float32)
    np.divide(row_absmax, np.float32(levels), out=scales)
    normal = row_absmax >= _SAFE_ABSMAX
    inv = np.zeros_like(row_absmax)
    np.divide(np.float32(levels), row_absmax, out=inv, where=normal)
    np.multiply(rows, inv[:, None], out=scratch)
    np.rint(scratch, out=scratch)
    if (tiny := ~normal & (row_absmax > 0)).any():  # rare: levels/absmax overflows float32
        scale_up = levels / row_absmax[tiny].astype(np.float64)
        scratch[tiny] = np.rint(rows[tiny].astype(np.float64) * scale_up[:, None])
    np.copyto(q, scratch, casting="unsafe")


def _split_planes(words: _Words) -> U8:
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


# ----------------------------------------------------------------------------- decode


def decode_raw_into(raw: U8, out: Float32Array, codec: str, block_size: int, shuffle: bool) -> None:
    """Rebuild the values from verified raw codec bytes, into the flat float32 ``out``.

    ``raw`` must hold exactly ``raw_nbytes(codec, out.size, block_size)`` bytes (the caller
    checked the header). An altered int8/int4 payload still decodes finite: every scale is
    checked against float32 max/(levels + 1) first.

    Raises:
        NonFiniteValues: The result would hold NaN or Inf.
    """
    if codec in LEVELS:
        _blockwise_into(raw, out, codec, block_size)  # finite by its scale check
        return
    if codec == "fp32" and shuffle:
        _merge_planes(raw, out.view(np.uint32))
    elif codec == "fp32":
        np.copyto(out.view(np.uint8), raw)
    else:
        halves = np.frombuffer(raw, dtype="<u2")
        if shuffle:
            _merge_planes(raw, halves := np.empty(out.size, np.uint16))
        _bf16_into(halves, out)
    check_finite(out)


def _merge_planes(raw: U8, words: _Words) -> None:
    """Inverse of ``_split_planes``, written into ``words``."""
    planes = raw.reshape(words.itemsize, words.size)
    for c0 in range(0, words.size, _CHUNK_ELEMENTS):
        w = words[c0 : c0 + _CHUNK_ELEMENTS]
        c1 = c0 + w.size
        np.copyto(w, planes[-1, c0:c1])
        for k in range(words.itemsize - 2, -1, -1):
            np.left_shift(w, 8, out=w)
            np.bitwise_or(w, planes[k, c0:c1], out=w)


def _bf16_into(halves: npt.NDArray[np.uint16], out: Float32Array) -> None:
    bits = out.view(np.uint32)
    for c0 in range(0, out.size, _CHUNK_ELEMENTS):
        dst = bits[c0 : c0 + _CHUNK_ELEMENTS]
        np.copyto(dst, halves[c0 : c0 + dst.size])
        np.left_shift(dst, 16, out=dst)


def _blockwise_into(raw: U8, out: Float32Array, codec: str, block_size: int) -> None:
    n = out.size
    n_blocks = -(-n // block_size)
    scales = _checked_scales(raw, codec, n_blocks)
    data = raw[4 * n_blocks :]
    q = data.view(np.int8) if codec == "int8" else _unpack_int4(data)[:n]
    # Per piece that stays in L2 (whole blocks): an int8 → float32 cast, then a float32 multiply
    # by each row's scale (``Blockwise.dequantize``, the one definition of a decoded value).
    # ~1.6x faster than one mixed-type multiply (which casts through small buffers), and the
    # multiply re-reads the piece from cache, not memory (which the merge is busy with).
    codes = Blockwise(q, scales, block_size)
    step = max(1, _CHUNK_ELEMENTS // block_size) * block_size
    for lo in range(0, n, step):
        hi = min(lo + step, n)
        codes.dequantize(lo, hi, out[lo:hi])


def _checked_scales(raw: U8, codec: str, n_blocks: int) -> Float32Array:
    """The block scales at the front of blockwise raw bytes, checked to keep q·s finite.

    Raises:
        NonFiniteValues: A scale is NaN, Inf or so large that some q·s would overflow.
    """
    scales = np.frombuffer(raw, dtype="<f4", count=n_blocks)
    levels = LEVELS[codec]
    # |q| ≤ levels + 1 even if altered (int8 −128, int4 nibble −8): this bound keeps q·s finite
    if not absmax(scales) <= _F32_MAX / (levels + 1):  # also False for NaN
        raise NonFiniteValues(f"a block scale is NaN, Inf or above float32 max/{levels + 1}")
    return scales


def codes_nbytes(n_elements: int, block_size: int) -> int:
    """Bytes of blockwise codes kept undecoded: the float32 scales, then one int8 per element
    (int4 nibbles unpacked; an odd count is padded by one)."""
    return 4 * -(-n_elements // block_size) + n_elements + n_elements % 2


def codes_into(
    raw: U8, into: U8, n_elements: int, codec: str, block_size: int
) -> tuple[npt.NDArray[np.int8], Float32Array]:
    """Verified int8/int4 raw bytes as (codes, scales) stored in ``into``: the scales first,
    then one int8 per element (``codes_nbytes``; ``into`` may already hold int8 raw bytes,
    which are their own layout). Value i decodes to ``float32(codes[i]) * scales[i // block]``,
    as ``decode_raw_into`` computes it.

    Raises:
        NonFiniteValues: A scale would let some value decode to NaN or Inf.
    """
    n_blocks = -(-n_elements // block_size)
    _checked_scales(raw, codec, n_blocks)
    head = 4 * n_blocks
    if codec == "int8":
        if raw.ctypes.data != into.ctypes.data:  # (zstd may have decompressed into it)
            np.copyto(into[: raw.size], raw)
    else:
        np.copyto(into[:head], raw[:head])
        pairs = into[head : head + 2 * (raw.size - head)].view("<u2")
        np.take(_INT4_PAIRS, raw[head:], mode="clip", out=pairs)
    codes = into[head : head + n_elements].view(np.int8)
    return codes, into[:head].view("<f4")


def _unpack_int4(data: U8) -> npt.NDArray[np.int8]:
    pairs: npt.NDArray[np.uint16] = np.take(_INT4_PAIRS, data, mode="clip")  # clip: no bounds pass
    return pairs.view(np.int8)
