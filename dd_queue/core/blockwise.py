"""A blockwise-quantised outer gradient kept as its codes: Δ without 4 B/element of float32.

An int8 (int4) contribution is 1.02 (0.56) B/element on the wire. Decoding it to float32 is an
int8 → float32 cast and a multiply by each block's scale, and that broadcast multiply is
numpy's slowest pass here (~2.5x a plain multiply); the synchronizer decoded every contribution
so, took its norms, and merged from the decoded copy. A ``Blockwise`` keeps the codes q (int8,
one per element; int4 nibbles unpacked) and the float32 block scales s instead
(``codec.decode_delta``: for int8 a copy of the payload), and every consumer works from them:

- ``dequantize``: a range as float32, ``float32(q[i]) * s[i // block_size]``, the very
  operations of the codec's decode, so the bits are the decoded vector's (re-anchoring and
  ``add_into`` use it: their results are bit-identical to the decoded path's);
- ``sq_sum``: Σ x² from exact integer sums of q² per block (no dequantisation);
- ``CodesSum``: the merge's weighted sum Σ_g c_g·Δ_g, with the scales folded into one batched
  matmul per sub-piece.

The last two round differently from the decoded path (relative differences ~1e-7, well below
int8's own error of ~0.7%) and are deterministic: a merge from codes is the same every time
and in every process (the fetch processes compute the norms the loop's merge would), so
replays and takeovers agree. Speed-ups against decoding first, measured by
bench/bench_merge.py, are in BENCHMARKS.md.

``Delta`` is either form; ``values`` gives a piece of either as float32.

Pure: imports no redis, fastapi, asyncio, threading, time, os or socket.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
import numpy.typing as npt

from dd_queue.errors import CoreError

__all__ = [
    "EXACT_SQ_BLOCK",
    "MAX_FOLDED_BLOCK",
    "Blockwise",
    "CodesSum",
    "Delta",
    "add_into",
    "as_float32",
    "shares_memory",
    "values",
]

F32 = npt.NDArray[np.float32]
I8 = npt.NDArray[np.int8]

_PIECE = 1 << 16  # elements per pass of whole-vector helpers (256 KiB of float32: stays in L2)
_SUB_BYTES = 1 << 20  # float32 codes of one CodesSum sub-piece, all contributions: in L2
EXACT_SQ_BLOCK = 1024
"""Largest block whose Σ q² (≤ 1024 · 128² = 2²⁴) is exact in float32."""
MAX_FOLDED_BLOCK = 4096
"""Largest block size ``CodesSum`` folds (larger blocks would need huge sub-pieces)."""


@dataclass(frozen=True, slots=True, eq=False)
class Blockwise:
    """A flat float32 vector of ``codes.size`` elements as blockwise codes and scales.

    Attributes:
        codes: q, one int8 per element (C-contiguous).
        scales: s, one float32 per block of ``block_size`` elements (the last may be partial).
        block_size: Elements per scale (≥ 1).
        buffer: The pooled float32 array whose bytes hold ``codes`` and ``scales``, if any (so
            that its owner can reuse it once the contribution is merged); None otherwise.

    Raises:
        CoreError: Arrays of the wrong dtype, layout or count.
    """

    codes: I8
    scales: F32
    block_size: int
    buffer: F32 | None = None

    def __post_init__(self) -> None:
        q, s, b = self.codes, self.scales, self.block_size
        if not isinstance(q, np.ndarray) or q.dtype != np.int8 or q.ndim != 1:
            raise CoreError("Blockwise.codes must be a flat int8 array")
        if not isinstance(s, np.ndarray) or s.dtype != np.float32 or s.ndim != 1:
            raise CoreError("Blockwise.scales must be a flat float32 array")
        if not isinstance(b, int) or b < 1 or s.size != -(-q.size // b):
            raise CoreError(
                f"{q.size} codes in blocks of {b!r} need {-(-q.size // max(b, 1))} scales, "
                f"got {s.size}"
            )

    @property
    def size(self) -> int:
        """Elements of the vector."""
        return int(self.codes.size)

    @property
    def shape(self) -> tuple[int]:
        """``(size,)``, as the decoded vector's."""
        return (self.size,)

    def dequantize(self, start: int, stop: int, out: F32) -> F32:
        """Elements ``start:stop`` as float32, written into ``out`` (that many elements) and
        returned; the codec's decode would give the same bits there.

        Raises:
            CoreError: A range outside the vector, or ``out`` of another size or dtype.
        """
        if not 0 <= start <= stop <= self.size:
            raise CoreError(f"range {start}:{stop} is outside a vector of {self.size} elements")
        if out.dtype != np.float32 or out.shape != (stop - start,):
            raise CoreError(f"out must be float32 of shape ({stop - start},), got {out.shape}")
        np.copyto(out, self.codes[start:stop], casting="unsafe")
        b = self.block_size
        head = min(-(-start // b) * b, stop)  # the end of start's block, or stop
        if head > start:  # a partial first block
            np.multiply(out[: head - start], self.scales[start // b], out=out[: head - start])
        n_full = (stop - head) // b
        if n_full:
            rows = out[head - start : head - start + n_full * b].reshape(n_full, b)
            np.multiply(rows, self.scales[head // b : head // b + n_full, None], out=rows)
        tail = head + n_full * b
        if tail < stop:  # a partial last block
            np.multiply(out[tail - start :], self.scales[tail // b], out=out[tail - start :])
        return out

    def sq_sum(self, start: int, stop: int, scratch: F32) -> float:
        """Σ x_i² over elements ``start:stop`` of the values q·s taken exactly (float64).

        Whole blocks add s_b² · Σ q_i², whose integer sums are exact in float32 for blocks up
        to ``EXACT_SQ_BLOCK`` (float64 beyond), so no value is dequantised: ~30% faster than
        dequantising and taking an fp32 dot (bench/bench_merge.py). ``scratch``: float32 of
        at least one block, reused for the codes.
        """
        b = self.block_size
        a0 = min(-(-start // b) * b, stop)
        a1 = max(a0, stop // b * b)
        total = 0.0
        for lo, hi in ((start, a0), (a1, stop)):  # partial blocks
            if hi > lo:
                x = self.codes[lo:hi].astype(np.float64) * float(self.scales[lo // b])
                total += float(np.dot(x, x))
        rows = max(1, scratch.size // b)
        work = scratch if b <= EXACT_SQ_BLOCK else np.empty(rows * b, dtype=np.float64)
        for lo in range(a0, a1, rows * b):
            hi = min(lo + rows * b, a1)
            q = work[: hi - lo].reshape(-1, b)
            np.copyto(q, self.codes[lo:hi].reshape(q.shape), casting="unsafe")
            per_block = np.einsum("ij,ij->i", q, q).astype(np.float64)
            s64 = self.scales[lo // b : hi // b].astype(np.float64)
            total += float(np.dot(s64 * s64, per_block))
        return total


Delta: TypeAlias = F32 | Blockwise
"""An outer gradient: a flat float32 vector, or its blockwise codes."""


def values(delta: Delta, start: int, stop: int, scratch: F32) -> F32:
    """Elements ``start:stop`` of ``delta`` as float32: a view of a float32 vector, or a
    ``Blockwise`` dequantised into ``scratch`` (exactly ``stop - start`` elements)."""
    if isinstance(delta, Blockwise):
        return delta.dequantize(start, stop, scratch)
    return delta[start:stop]


class CodesSum:
    """``dst (+)= Σ_g c_g · Δ_g`` over element ranges, for ``Blockwise`` Δ_g of one block size.

    The scale multiply is folded into the contraction: per block b, Σ_g (c_g · s_g,b) · q_g,
    one batched matmul (BLAS) per sub-piece of the codes cast to float32, where dequantising
    first costs a broadcast multiply per element and contribution, the slowest of numpy's
    passes here (bench/bench_merge.py). Sub-pieces start at multiples of their length (a whole
    number of blocks), so only a range's own ends can cut a block; such a part block is one
    (1 × G) · (G × its length) product with its block's factors. The result is deterministic
    but rounds differently from merging the decoded vectors (c·s is rounded once, the sum
    over g runs in BLAS order): relative differences ~1e-7.

    Args:
        group: The contributions (same ``block_size`` ≤ ``MAX_FOLDED_BLOCK``, same size).
    """

    def __init__(self, group: Sequence[Blockwise]) -> None:
        b = group[0].block_size
        if any(d.block_size != b or d.size != group[0].size for d in group):
            raise CoreError("CodesSum needs codes of one block size and one length")
        if b > MAX_FOLDED_BLOCK:
            raise CoreError(f"block size {b} is above {MAX_FOLDED_BLOCK}; dequantise instead")
        self.group, self.block_size = tuple(group), b
        # elements per sub-piece: the codes of all of them as float32 stay within _SUB_BYTES
        self._sub = max(1, _SUB_BYTES // (4 * b * len(group))) * b
        self._codes = np.empty((len(group), self._sub), dtype=np.float32)
        self._factors = np.empty((len(group), self._sub // b), dtype=np.float32)
        self._tmp = np.empty(self._sub, dtype=np.float32)

    def into(self, dst: F32, coefs: F32, start: int, stop: int, *, add: bool) -> None:
        """``dst = Σ_g coefs[g] · Δ_g[start:stop]`` (``+=`` with ``add``); ``dst`` has
        ``stop - start`` elements, ``coefs`` one float32 per contribution."""
        b, sub = self.block_size, self._sub
        cuts = [start, *range((start // sub + 1) * sub, stop, sub), stop]
        for lo, hi in itertools.pairwise(cuts):
            a0 = min(-(-lo // b) * b, hi)  # whole blocks of [lo, hi): [a0, a1)
            a1 = max(a0, hi // b * b)
            for x0, x1 in ((lo, a0), (a0, a1), (a1, hi)):
                if x1 > x0:
                    self._folded(dst[x0 - start : x1 - start], coefs, x0, x1, add=add)

    def _folded(self, dst: F32, coefs: F32, lo: int, hi: int, *, add: bool) -> None:
        """[lo, hi): whole blocks, or a part of one block."""
        b, n, g = self.block_size, hi - lo, len(self.group)
        first, rows = lo // b, max(1, n // b)  # a part block is one row of n elements
        width = n // rows
        codes, factors = self._codes[:, :n], self._factors[:, :rows]
        for k, d in enumerate(self.group):
            np.copyto(codes[k], d.codes[lo:hi], casting="unsafe")
            np.multiply(d.scales[first : first + rows], coefs[k], out=factors[k])
        target = self._tmp[:n] if add else dst
        np.matmul(
            factors.T[:, None, :],  # (rows, 1, G)
            codes.reshape(g, rows, width).transpose(1, 0, 2),  # (rows, G, width)
            out=target.reshape(rows, 1, width),
        )
        if add:
            np.add(dst, target, out=dst)


def add_into(dst: F32, delta: Delta) -> None:
    """``dst += delta`` element-wise (``delta`` of ``dst``'s size), one piece at a time."""
    if not isinstance(delta, Blockwise):
        np.add(dst, delta, out=dst)
        return
    if dst.shape != delta.shape:
        raise CoreError(f"cannot add {delta.size} elements to an array of shape {dst.shape}")
    scratch = np.empty(min(_PIECE, delta.size), dtype=np.float32)
    for start in range(0, delta.size, _PIECE):
        stop = min(start + _PIECE, delta.size)
        piece = delta.dequantize(start, stop, scratch[: stop - start])
        np.add(dst[start:stop], piece, out=dst[start:stop])


def as_float32(delta: Delta) -> F32:
    """``delta`` as one float32 vector (itself, or the ``Blockwise`` dequantised anew)."""
    if not isinstance(delta, Blockwise):
        return delta
    out = np.empty(delta.size, dtype=np.float32)
    return delta.dequantize(0, delta.size, out)


def shares_memory(array: np.ndarray, delta: Delta) -> bool:
    """Whether ``array`` may overlap ``delta`` (its codes or scales, for a ``Blockwise``)."""
    parts = (delta.codes, delta.scales) if isinstance(delta, Blockwise) else (delta,)
    return any(np.may_share_memory(array, part) for part in parts)
