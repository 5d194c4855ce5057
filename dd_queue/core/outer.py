"""The outer optimizer: SGD with Nesterov momentum on one fragment's global parameters.

DiLoCo (Douillard et al., arXiv 2311.08105) applies Nesterov SGD to the averaged outer gradient;
Streaming DiLoCo (arXiv 2501.18512) and Decoupled DiLoCo (arXiv 2604.21428, synchronizer step 4)
do so per fragment p, with the merged pseudo-gradient Δ as the gradient:

    g = Δ + λ·Θ                        (λ = weight_decay, usually 0)
    b ← g                 on the first step (torch initialises the buffer with the gradient)
    b ← μ·b + g           afterwards       (dampening 0)
    Θ ← Θ − lr·(g + μ·b)                  (Nesterov look-ahead)

This is ``torch.optim.SGD(lr=lr, momentum=μ, nesterov=True, weight_decay=λ)`` step for step.
With μ = 0 this is plain SGD, Θ ← Θ − lr·g, as ``torch.optim.SGD(lr=lr)`` (torch refuses
``nesterov=True`` without momentum); the buffer is then left alone.
Units: Θ, Δ and b are in parameter units; lr and μ are dimensionless.

Arithmetic is float32 like torch's, but torch's CPU kernels fuse ``a + α·b`` into one FMA while
numpy rounds the product first, so the two agree to fp32 rounding (≈1e-7 relative per step), not
bit for bit. Everything is in place on preallocated arrays, chunk by chunk so the temporaries stay
in cache; the chunks may be shared between threads (``workers``, ``core.workers``), each
element's arithmetic unchanged. The state (b and the step count) round-trips through bytes or a
plain dict for storage in Redis.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from dd_queue.core.workers import Workers, split_map
from dd_queue.errors import CoreError

F32 = npt.NDArray[np.float32]
CHUNK_ELEMENTS = 1 << 16  # 256 KiB of fp32 per temporary: stays in L2
STATE_FORMAT = "ddq.nesterov.v1"
_MAGIC = b"DDQN"  # then 3 little-endian uint64: format version, step, number of elements
_HEADER_BYTES = len(_MAGIC) + 3 * 8
_LE_F32 = np.dtype("<f4")
_LE_U64 = np.dtype("<u8")


@dataclass(slots=True, eq=False)
class NesterovState:
    """Outer-optimizer state of one fragment. Mutable (``nesterov_step`` updates it in place) and
    compared by identity.

    Attributes:
        momentum_buffer: b, float32 of the fragment's size.
        step: Outer steps taken so far (0 = the next step initialises b with the gradient).
    """

    momentum_buffer: F32
    step: int = 0

    @classmethod
    def zeros(cls, size: int) -> NesterovState:
        """Fresh state for a fragment of ``size`` elements."""
        if size < 0:
            raise CoreError(f"fragment size must be ≥ 0, got {size}")
        return cls(momentum_buffer=np.zeros(size, dtype=np.float32), step=0)


class OuterStep:
    """One outer step on Θ_p and its state, taken piece by piece as Δ's pieces become known:
    by :func:`nesterov_step` over a whole Δ, or by the merge itself while each merged piece is
    still in cache (``core.merge.merge_fragment(step=...)``, which then never stores Δ).

    Every element's arithmetic is the same whatever the pieces, so the result is bit-identical
    to one pass over the whole Δ. Pieces must be disjoint; they may run on several threads,
    each with its own :meth:`scratch`. Call :meth:`finish` once after the last piece.

    Args:
        params: Θ_p, float32, updated in place (read only with ``out``).
        state: Momentum buffer and step count, updated in place (read only with ``out``).
        lr: Outer learning rate (≥ 0; DiLoCo used 0.7).
        momentum: μ in [0, 1) (DiLoCo used 0.9); 0 is plain SGD.
        weight_decay: λ ≥ 0, added to the gradient as λ·Θ (torch's coupled decay).
        out: New Θ_p and state to write instead (arrays of the same shape that overlap
            none of the inputs; their content is ignored): the same values as in place,
            without first copying Θ_p and b to keep the old ones.

    Raises:
        CoreError: Shapes or dtypes differ, ``out`` overlaps an input, or a hyperparameter
            is out of range.
    """

    __slots__ = (
        "_b_out",
        "_buf",
        "_first",
        "_p_out",
        "_s_out",
        "lr",
        "momentum",
        "params",
        "state",
        "weight_decay",
    )

    def __init__(
        self,
        params: F32,
        state: NesterovState,
        *,
        lr: float,
        momentum: float,
        weight_decay: float = 0.0,
        out: tuple[F32, NesterovState] | None = None,
    ) -> None:
        _check_step_args(params, None, state, lr=lr, momentum=momentum, weight_decay=weight_decay)
        self.params, self.state = params, state
        self.lr, self.momentum, self.weight_decay = lr, momentum, weight_decay
        self._p_out, self._s_out = out if out is not None else (params, state)
        if out is not None:
            _check_out(self._p_out, self._s_out, (params, state.momentum_buffer))
        self._first = state.step == 0
        self._buf, self._b_out = state.momentum_buffer, self._s_out.momentum_buffer

    @property
    def size(self) -> int:
        """Elements of Θ_p."""
        return int(self.params.size)

    def writes(self) -> tuple[F32, F32]:
        """The arrays the step writes (Θ_p and b, or ``out``'s): a Δ must overlap neither."""
        return self._p_out, self._b_out

    def scratch(self) -> tuple[F32, F32]:
        """Two temporaries of one piece (``CHUNK_ELEMENTS``), for one thread's pieces."""
        n = min(CHUNK_ELEMENTS, self.size)
        return np.empty(n, dtype=np.float32), np.empty(n, dtype=np.float32)

    def piece(self, start: int, stop: int, g: F32, scratch: tuple[F32, F32]) -> None:
        """Step elements [start, stop) with their Δ piece ``g`` (``stop - start`` ≤
        ``CHUNK_ELEMENTS`` elements; read only)."""
        n, (g_tmp, u_tmp) = stop - start, scratch
        p, b = self.params[start:stop], self._buf[start:stop]
        pn, bn = self._p_out[start:stop], self._b_out[start:stop]
        momentum, lr = self.momentum, self.lr
        if self.weight_decay:
            g = np.add(g, np.multiply(p, self.weight_decay, out=g_tmp[:n]), out=g_tmp[:n])
        u = g
        if momentum:
            if self._first:
                np.copyto(bn, g)
            else:
                np.multiply(b, momentum, out=bn)
                np.add(bn, g, out=bn)
            u = np.add(g, np.multiply(bn, momentum, out=u_tmp[:n]), out=u_tmp[:n])
        elif bn is not b:
            np.copyto(bn, b)  # plain SGD leaves the buffer alone
        np.subtract(p, np.multiply(u, lr, out=u_tmp[:n]), out=pn)

    def finish(self) -> None:
        """Count the step (after every piece is done)."""
        self._s_out.step = self.state.step + 1

    def over(self, delta: F32, workers: Workers | None = None) -> None:
        """The whole step with a stored Δ (read only, same shape), its chunks shared between
        ``workers``; then :meth:`finish`."""
        if delta.dtype != np.float32 or delta.shape != self.params.shape:
            raise CoreError(
                f"delta must be float32 of shape {self.params.shape}, got "
                f"{delta.dtype} {delta.shape}"
            )

        def chunks(starts: Sequence[int]) -> list[None]:
            scratch = self.scratch()
            for start in starts:
                stop = min(start + CHUNK_ELEMENTS, self.size)
                self.piece(start, stop, delta[start:stop], scratch)
            return [None] * len(starts)

        split_map(chunks, range(0, self.size, CHUNK_ELEMENTS), workers)
        self.finish()


def nesterov_step(
    params: F32,
    delta: F32,
    state: NesterovState,
    *,
    lr: float,
    momentum: float,
    weight_decay: float = 0.0,
    out: tuple[F32, NesterovState] | None = None,
    workers: Workers | None = None,
) -> None:
    """One outer step, in place on ``params`` and ``state`` (formulas in the module doc), or
    into ``out``: :class:`OuterStep` over the whole ``delta``.

    Args:
        params: Θ_p, float32, updated in place (read only with ``out``).
        delta: The merged pseudo-gradient Δ (read only), same shape.
        state: Momentum buffer and step count, updated in place (read only with ``out``).
        lr, momentum, weight_decay, out: As :class:`OuterStep`.
        workers: Threads to share the chunks with (``core.workers``); the same bits with any.

    Raises:
        CoreError: Shapes or dtypes differ, ``out`` overlaps an input, or a hyperparameter
            is out of range.
    """
    _check_step_args(params, delta, state, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if out is not None:
        _check_out(out[0], out[1], (params, delta, state.momentum_buffer))
    step = OuterStep(params, state, lr=lr, momentum=momentum, weight_decay=weight_decay, out=out)
    step.over(delta, workers)


def state_to_bytes(state: NesterovState) -> bytes:
    """Serialise: 28-byte header (b"DDQN", then version, step, n as uint64) + n float32, all LE."""
    return b"".join(state_parts(state))


def state_parts(state: NesterovState) -> tuple[bytes, memoryview]:
    """``state_to_bytes`` as two buffers written back to back: the header, and the momentum
    buffer's own bytes (a view, not a copy, on a little-endian machine; do not change the
    buffer while the view is in use)."""
    buf = state.momentum_buffer
    if not 0 <= state.step < 2**64:
        raise CoreError(f"outer step must be in [0, 2^64), got {state.step}")
    header = _MAGIC + np.array([1, state.step, buf.size], dtype=_LE_U64).tobytes()
    body = np.ascontiguousarray(buf.astype(_LE_F32, copy=False).reshape(-1))
    return header, body.data.cast("B").toreadonly()


def state_from_bytes(data: bytes, *, size: int | None = None) -> NesterovState:
    """Inverse of :func:`state_to_bytes`; returns a writable copy.

    Args:
        data: The serialised state.
        size: Expected fragment size in elements (checked when given).

    Raises:
        CoreError: Wrong magic or version, truncated data, or a size mismatch.
    """
    if len(data) < _HEADER_BYTES or data[: len(_MAGIC)] != _MAGIC:
        raise CoreError(f"not a {STATE_FORMAT} blob: bad magic or shorter than its header")
    version, step, n = (int(x) for x in np.frombuffer(data, _LE_U64, 3, len(_MAGIC)))
    if version != 1:
        raise CoreError(f"outer state format version {version}; this code reads version 1")
    if len(data) != _HEADER_BYTES + 4 * n:
        raise CoreError(
            f"outer state says {n} elements but holds {len(data) - _HEADER_BYTES} bytes"
        )
    buf = np.frombuffer(data, dtype=_LE_F32, count=n, offset=_HEADER_BYTES)
    return _validated(buf, step, size)


def state_to_dict(state: NesterovState) -> dict[str, Any]:
    """Plain dict (msgpack/JSON-able): format, step, size and the buffer as little-endian bytes."""
    buf = state.momentum_buffer.astype(_LE_F32, copy=False)
    return {"format": STATE_FORMAT, "step": state.step, "size": buf.size, "momentum": buf.tobytes()}


def state_from_dict(d: dict[str, Any], *, size: int | None = None) -> NesterovState:
    """Inverse of :func:`state_to_dict`; returns a writable copy.

    Raises:
        CoreError: Wrong format, missing keys, inconsistent size, or a size mismatch.
    """
    try:
        fmt, step, n, raw = d["format"], d["step"], d["size"], d["momentum"]
    except (KeyError, TypeError) as exc:
        raise CoreError(f"outer state dict lacks {exc}; expected format {STATE_FORMAT}") from exc
    if fmt != STATE_FORMAT or not isinstance(raw, bytes | bytearray | memoryview):
        raise CoreError(f"outer state has format {fmt!r}; expected {STATE_FORMAT} with bytes")
    if not isinstance(n, int) or len(raw) != 4 * n:
        raise CoreError(f"outer state says {n} elements but holds {len(raw)} bytes")
    return _validated(np.frombuffer(raw, dtype=_LE_F32), step, size)


def _validated(buf: npt.NDArray[Any], step: Any, size: int | None) -> NesterovState:
    if size is not None and buf.size != size:
        raise CoreError(
            f"outer state has {buf.size} elements; fragment has {size}. Wrong fragment?"
        )
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise CoreError(f"outer state step must be an integer ≥ 0, got {step!r}")
    return NesterovState(momentum_buffer=buf.astype(np.float32), step=step)


def _check_out(params: F32, state: NesterovState, inputs: tuple[F32, ...]) -> None:
    for a in (params, state.momentum_buffer):
        if a.dtype != np.float32 or a.shape != inputs[0].shape:
            raise CoreError(f"out arrays must be float32 of shape {inputs[0].shape}")
        if any(np.may_share_memory(a, x) for x in inputs):
            raise CoreError("out arrays must not overlap Θ_p, Δ or the momentum buffer")
    if np.may_share_memory(params, state.momentum_buffer):
        raise CoreError("out Θ_p and momentum buffer must be separate arrays")


def _check_step_args(
    params: F32,
    delta: F32 | None,
    state: NesterovState,
    *,
    lr: float,
    momentum: float,
    weight_decay: float,
) -> None:
    """Flat float32 arrays of one shape (Δ too, when given) and hyperparameters in range."""
    arrays = (
        (params, state.momentum_buffer) if delta is None else (params, delta, state.momentum_buffer)
    )
    names = "params and momentum buffer" if delta is None else "params, delta and momentum buffer"
    if any(a.dtype != np.float32 or a.ndim != 1 for a in arrays):
        raise CoreError(f"{names} must be flat float32 arrays")
    if len({a.shape for a in arrays}) > 1:
        shapes = [a.shape for a in arrays]
        raise CoreError(f"{names} shapes differ: {shapes}")
    if not (math.isfinite(lr) and lr >= 0):
        raise CoreError(f"outer lr must be finite and ≥ 0, got {lr}")
    if not 0.0 <= momentum < 1.0:
        raise CoreError(f"outer momentum must be in [0, 1), got {momentum}")
    if not (math.isfinite(weight_decay) and weight_decay >= 0):
        raise CoreError(f"outer weight_decay must be finite and ≥ 0, got {weight_decay}")


__all__ = [
    "STATE_FORMAT",
    "NesterovState",
    "OuterStep",
    "nesterov_step",
    "state_from_bytes",
    "state_from_dict",
    "state_to_bytes",
    "state_to_dict",
]
