"""Merging the contributions of one fragment's round: weights, weighted mean, RDA, re-anchoring.

Decoupled DiLoCo (Douillard et al., arXiv 2604.21428), synchronizer step 3. Learner m sends the
outer gradient (pseudo-gradient, DiLoCo arXiv 2311.08105) of fragment p, a flat float32 vector
Δ_m = Θ_p(base_m) − θ_m, with the tokens and inner steps it trained since it last received p.

- **Token weights** ("quantity × quality"): w_m = tokens_m · (tokens_m / max(steps_m, 1)), in
  tokens²/step. ``weighting="uniform"`` gives w_m = 1. Only ratios matter: the merge uses
  a_m = w_m / Σ w, and when Σ w = 0 it returns ``kind="no_update"`` (never NaN).
- **Weighted mean**: Δ = Σ a_m Δ_m.
- **Radial-Directional Averaging**, per tensor segment s (our reading of the paper):
  RDA = r_s · φ(u_s), r_s = Σ a_m ‖Δ_m,s‖, u_s = Σ a_m φ(Δ_m,s), φ(x) = x/‖x‖, φ(0) = 0.
  Per-learner outer gradients are nearly orthogonal, so a mean shrinks like 1/√M; RDA keeps the
  norm. Embedding segments always use the weighted mean. When the directions cancel, i.e.
  ‖u_s‖ < ``min_direction_norm`` · Σ_{m: Δ_m,s ≠ 0} a_m (default 1e-3: the unit vectors cancel
  to under 0.1% of their combined weight, so φ(u_s) would amplify rounding error ~1000×), the
  segment falls back to the weighted mean and is listed in ``MergeResult.fallback_segments``.
- **Re-anchoring** of a Δ_m made against an older version lives in :mod:`dd_queue.core.anchor`.

Speed: no Python loop touches single elements. The flat vector is cut into pieces of at most
``CHUNK_ELEMENTS`` inside one segment; for each piece every contribution is scaled into a small
scratch buffer and added to ``out`` while both stay in cache. Squared norms are fp32 dots per piece
summed in fp64, in piece order. The pieces of that weighted sum may be shared between threads
(``workers``, ``core.workers``: numpy releases the GIL in each piece), with the same bits; a
merge that folds codes (below) stays on one thread.
With ``step`` (``core.outer.OuterStep``) the merge also takes the outer step. A fragment merged by
the weighted mean throughout steps each piece as soon as it is summed, in a scratch buffer, so
Δ never goes to memory and is not read back: two of the eight passes over memory of a merge
followed by ``nesterov_step`` (bench/bench_merge.py); the same bits. RDA scales a segment only
once it is summed whole, so there Δ is stored and then stepped.
Contributions with zero weight are never read (so they are not checked for NaN). RDA needs
every contribution's per-segment norms before it can scale anything, so a merge reads each Δ_m
twice, the first time only for its norms; a caller that has Δ_m in cache earlier (the
synchronizer, right after decoding it) computes them then with :func:`segment_sq_norms` and
passes them as ``ContributionData.sq_norms``: the same function on the same pieces, so the merge
is bit-identical either way, and reads each Δ_m once.

A Δ_m may also be a ``Blockwise`` (int8 or int4 codes and block scales, ``core.blockwise``):
its norms come from exact integer sums (``Blockwise.sq_sum``), and the contributions of one
block size are summed piece by piece by a ``CodesSum`` (block scales folded into a batched
matmul) before the float32 ones are added to the piece. Such a merge reads 1 B/element
instead of 4, is deterministic, and equals the merge of the decoded vectors to float32
rounding (~1e-7 relative), not bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, NoReturn, cast, get_args

import numpy as np
import numpy.typing as npt

from dd_queue.core.blockwise import (
    MAX_FOLDED_BLOCK,
    Blockwise,
    CodesSum,
    Delta,
    as_float32,
    shares_memory,
    values,
)
from dd_queue.core.fragments import Fragment, Segment
from dd_queue.core.outer import OuterStep
from dd_queue.core.workers import Workers, split_map
from dd_queue.errors import CoreError

CHUNK_ELEMENTS = 1 << 16  # 256 KiB of fp32: a piece, its scratch and ``out`` stay in L2
MIN_DIRECTION_NORM = 1e-3
_WIDE = 2.0**100  # fp32 factors stay within [2^-100, 2^100]: no overflow, no subnormals
_TINY_SQ = 2.0**-100  # an fp32 dot below this may have lost its squares to underflow

F32 = npt.NDArray[np.float32]
F64 = npt.NDArray[np.float64]
Rule = Literal["rda", "mean"]
"""The merge rules (``synchronizer.merge_rule``); a new rule is added here, to ``RULES`` and to
``merge_weighted``, and nowhere else."""
RULES: tuple[Rule, ...] = get_args(Rule)


def needs_norms(rule: Rule) -> bool:
    """Whether the rule scales by Δ's per-segment norms (then they are computed ahead, while a
    decoded Δ is in cache: ``segment_sq_norms``)."""
    return rule == "rda"


@dataclass(frozen=True, slots=True, eq=False)
class ContributionData:
    """One learner's decoded contribution to one fragment's round (compared by identity).

    Attributes:
        learner_id: e.g. ``"L3"``.
        delta: Δ_m = Θ_p(base_version) − θ_m, flat float32 of the fragment's size, or its
            blockwise codes (``core.blockwise.Blockwise``, dequantised piece by piece).
        tokens: Tokens trained since the learner last received this fragment (≥ 0).
        steps: Inner steps over the same span (≥ 0; clamped to ≥ 1 in the weight).
        base_version: Global version of the fragment that Δ_m is measured from.
        sq_norms: ``segment_sq_norms(delta, fragment)`` computed ahead (float64, one per
            segment of the fragment merged), or None to compute them in the merge. They must
            be of this very ``delta``: anything that changes it (re-anchoring) drops them.
    """

    learner_id: str
    delta: Delta
    tokens: int
    steps: int
    base_version: int
    sq_norms: F64 | None = None


@dataclass(frozen=True, slots=True, eq=False)
class MergeResult:
    """The merged pseudo-gradient of a round, with what the round record needs (holds an array,
    so compared by identity).

    Attributes:
        kind: ``"merged"``, or ``"no_update"`` when no contribution has weight; then ``delta`` is
            zeros and the caller must skip the outer step (momentum would still move Θ).
        delta: Merged Δ, float32 of the fragment's size; None when the merge took the outer
            step itself piece by piece and never stored Δ (``step=`` on a fragment merged
            by the weighted mean throughout).
        learner_ids: Contributors, in input order.
        weights: Normalised weights a_m (sum 1, or all 0 for ``no_update``), in input order.
        rule: Merge rule used for non-embedding segments.
        fallback_segments: RDA segments that used the weighted mean (directions cancelled).
        delta_norm: ‖Δ‖₂ of the merged vector.
        reason: One line for logs, the API and the dashboard.
    """

    kind: Literal["merged", "no_update"]
    delta: F32 | None
    learner_ids: tuple[str, ...]
    weights: tuple[float, ...]
    rule: Rule
    fallback_segments: tuple[str, ...]
    delta_norm: float
    reason: str


def token_weights(tokens: Sequence[float], steps: Sequence[float]) -> F64:
    """w_m = tokens_m · (tokens_m / max(steps_m, 1)), in tokens²/step (arXiv 2604.21428).

    Raises:
        CoreError: Lengths differ, or a count is negative or not finite.
    """
    t = _counts(tokens, "tokens")
    s = _counts(steps, "steps")
    if t.shape != s.shape:
        raise CoreError(f"{t.size} token counts but {s.size} step counts; give one of each")
    return t * (t / np.maximum(s, 1.0))


def uniform_weights(n: int) -> F64:
    """w_m = 1 for each of ``n`` contributions."""
    return np.ones(n, dtype=np.float64)


def weighted_mean(
    vectors: Sequence[Delta], weights: npt.ArrayLike, *, out: F32 | None = None
) -> F32:
    """Σ a_m v_m, a_m = w_m / Σ w, over whole flat vectors (zeros if every weight is 0)."""
    size = vectors[0].size if vectors else 0
    whole = Fragment(index=0, segments=(Segment("all", 0, size, (size,), False),), size=size)
    delta = merge_weighted(vectors, weights, whole, rule="mean", out=out).delta
    assert delta is not None  # stored whenever no step is taken
    return delta


def merge_fragment(
    contribs: Sequence[ContributionData],
    fragment: Fragment,
    *,
    rule: Rule = "rda",
    weighting: Literal["tokens", "uniform"] = "tokens",
    out: F32 | None = None,
    min_direction_norm: float = MIN_DIRECTION_NORM,
    workers: Workers | None = None,
    step: OuterStep | None = None,
) -> MergeResult:
    """Merge one round's contributions to ``fragment`` (synchronizer step 3, arXiv 2604.21428),
    and with ``step`` also take the outer step with the merged Δ (step 4).

    Args:
        contribs: At most one per learner, already anchored (see ``anchor_contributions``).
        fragment: The fragment's layout; its embedding segments always use the weighted mean.
        rule: ``"rda"`` or ``"mean"`` for the other segments.
        weighting: ``"tokens"`` (w_m = tokens²/steps) or ``"uniform"``.
        out: Preallocated float32 output of the fragment's size (must not overlap an input).
        min_direction_norm: RDA degeneracy threshold (module doc).
        workers: Threads to share the weighted sums with (``core.workers``); the same bits
            with any.
        step: The outer step (``core.outer.OuterStep``) to take with Δ, only when the result
            is ``"merged"``; the same bits as ``nesterov_step`` after the merge. A fragment
            merged by the weighted mean throughout steps each piece while it is in cache and
            never stores Δ (``out`` is left alone, ``delta`` is None); otherwise Δ is stored
            in ``out`` and then stepped. A ``CoreError`` (non-finite Δ) may come after some
            pieces were stepped: give the step an ``out`` when the old Θ_p must survive it.

    Returns:
        The merge result; ``kind == "no_update"`` when every weight is zero (no step taken).

    Raises:
        CoreError: Duplicate learner, bad counts, wrong shape/dtype, or non-finite values.
    """
    ids = tuple(c.learner_id for c in contribs)
    if len(set(ids)) != len(ids):
        raise CoreError(f"learners {ids} contribute more than once; dedupe before merging")
    if weighting not in ("tokens", "uniform"):
        raise CoreError(f"weighting must be 'tokens' or 'uniform', got {weighting!r}")
    tokens, steps = [c.tokens for c in contribs], [c.steps for c in contribs]
    w = token_weights(tokens, steps) if weighting == "tokens" else uniform_weights(len(ids))
    vectors = [c.delta for c in contribs]
    return merge_weighted(
        vectors,
        w,
        fragment,
        rule=rule,
        learner_ids=ids,
        out=out,
        min_direction_norm=min_direction_norm,
        sq_norms=[c.sq_norms for c in contribs],
        workers=workers,
        step=step,
    )


def merge_weighted(
    vectors: Sequence[Delta],
    weights: npt.ArrayLike,
    fragment: Fragment,
    *,
    rule: Rule = "rda",
    learner_ids: Sequence[str] | None = None,
    out: F32 | None = None,
    min_direction_norm: float = MIN_DIRECTION_NORM,
    sq_norms: Sequence[F64 | None] | None = None,
    workers: Workers | None = None,
    step: OuterStep | None = None,
) -> MergeResult:
    """Merge flat vectors with explicit weights w_m ≥ 0 (only their ratios matter).

    Same as :func:`merge_fragment` after the weights are chosen; ``learner_ids`` default to
    ``"0", "1", ...``; ``sq_norms`` (one per vector, each None or ``segment_sq_norms`` of it)
    spare the RDA merge its first pass over those vectors; ``workers`` and ``step`` as in
    :func:`merge_fragment`.

    Raises:
        CoreError: Bad weights, wrong shape/dtype, overlapping ``out``, a
            ``min_direction_norm`` that is not finite and > 0, non-finite values, or a merged
            delta beyond float32.
    """
    ids = tuple(learner_ids) if learner_ids is not None else tuple(map(str, range(len(vectors))))
    w, dst = _validated(vectors, weights, ids, rule, out, fragment.size)
    if step is not None:
        _check_step(step, vectors, dst, fragment.size)
    if not (math.isfinite(min_direction_norm) and min_direction_norm > 0):
        raise CoreError(f"min_direction_norm must be finite and > 0, got {min_direction_norm!r}")
    known = _known_norms(sq_norms, ids, len(fragment.segments))
    total = float(w.sum())
    if total <= 0.0:
        dst.fill(0.0)
        why = "no contributions" if not ids else f"all {len(ids)} contributions have zero weight"
        return MergeResult("no_update", dst, ids, (0.0,) * len(ids), rule, (), 0.0, why)
    a = w / total
    layout = _Layout.of(fragment.segments, rule)
    fused = step if step is not None and not layout.rda.any() else None
    with np.errstate(over="ignore", invalid="ignore"):
        fallback, sq = _merge(vectors, a, layout, dst, min_direction_norm, known, workers, fused)
    if not math.isfinite(sq):
        _raise_non_finite(vectors, a, ids)
    if fused is not None:
        fused.finish()
    elif step is not None:
        with np.errstate(over="ignore", invalid="ignore"):
            step.over(dst, workers)
    names = tuple(fragment.segments[s].name for s in fallback)
    shares = ", ".join(f"{i} {x:.3f}" for i, x in zip(ids[:8], a, strict=False))
    shares += f", +{len(ids) - 8} more" if len(ids) > 8 else ""
    reason = f"{rule} merge of {len(ids)} contributions ({shares})"
    n_emb = sum(1 for s in fragment.segments if s.is_embedding)
    if rule == "rda" and n_emb:
        reason += f"; {n_emb} embedding segments by weighted mean"
    if names:
        reason += f"; weighted mean where directions cancelled: {', '.join(names)}"
    weights_out = tuple(float(x) for x in a)
    stored = None if fused is not None else dst
    return MergeResult("merged", stored, ids, weights_out, rule, names, math.sqrt(sq), reason)


# ---------------------------------------------------------------------------------------------
# The merge engine
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Layout:
    rda: npt.NDArray[np.bool_]  # per segment: merged by RDA
    pieces: tuple[tuple[int, int, int], ...]  # (start, stop, segment), ≤ CHUNK_ELEMENTS each
    first: tuple[int, ...]  # pieces of segment s are pieces[first[s] : first[s + 1]]

    @staticmethod
    def of(segments: Sequence[Segment], rule: Rule) -> _Layout:
        rda = np.array([rule == "rda" and not s.is_embedding for s in segments], dtype=np.bool_)
        pieces: list[tuple[int, int, int]] = []
        first = [0]
        for i, seg in enumerate(segments):
            pieces += [
                (a, min(a + CHUNK_ELEMENTS, seg.stop), i)
                for a in range(seg.start, seg.stop, CHUNK_ELEMENTS)
            ]
            first.append(len(pieces))
        return _Layout(rda=rda, pieces=tuple(pieces), first=tuple(first))

    def of_segment(self, s: int) -> tuple[tuple[int, int, int], ...]:
        return self.pieces[self.first[s] : self.first[s + 1]]


def _merge(
    vectors: Sequence[Delta],
    a: F64,
    layout: _Layout,
    out: F32,
    min_dir: float,
    known: Sequence[F64 | None],
    workers: Workers | None,
    step: OuterStep | None = None,
) -> tuple[list[int], float]:
    """Fill ``out``; return (fallback segment indices, ‖Δ‖², NaN if an input is not finite).
    ``known[m]``: the squared segment norms of ``vectors[m]``, or None to compute them.
    ``step`` (a layout without RDA only): step each piece of Δ instead of storing it."""
    active = np.flatnonzero(a > 0)
    vs = [vectors[int(i)] for i in active]
    aa = a[active]
    mean_coef = np.repeat(aa[:, None], layout.rda.size, axis=1)  # (M_active, S)
    if not layout.rda.any():
        sq = _accumulate(out, vs, mean_coef, layout.pieces, layout.rda.size, workers, step)
        return [], float(sq.sum())
    sq_norms = [known[int(i)] for i in active]
    norms = np.sqrt(
        np.stack(
            [
                _sq_norms(v, layout.pieces, layout.rda.size) if k is None else k
                for v, k in zip(vs, sq_norms, strict=True)
            ]
        )
    )
    if not np.isfinite(norms).all():
        return [], math.nan
    inv = np.divide(1.0, norms, out=np.zeros_like(norms), where=norms > 0)
    coef = np.where(layout.rda, aa[:, None] * inv, mean_coef)
    target = aa @ norms  # r_s = Σ a_m ‖Δ_m,s‖
    live = aa @ (norms > 0)  # Σ a_m over contributions that are non-zero on s
    # A coefficient a_m/‖Δ_m,s‖ outside float32's comfortable range (a norm below ~1e-30 or
    # above ~1e30) would overflow or lose bits in the fp32 pass: such segments are merged in
    # float64 instead (_rda_wide), which is exact over the whole float32 range.
    wide = layout.rda & ((coef > _WIDE) | ((coef > 0) & (coef < 1.0 / _WIDE))).any(axis=0)
    narrow = [piece for piece in layout.pieces if not wide[piece[2]]]
    sq = _accumulate(out, vs, coef, narrow, layout.rda.size, workers)  # ‖u_s‖² where RDA
    fallback: list[int] = []
    for s in np.flatnonzero(layout.rda & (target > 0)):
        pieces = layout.of_segment(int(s))
        if wide[s]:
            sq[s] = _rda_wide(out, vs, aa, norms[:, s], target[s], min_dir * live[s], pieces)
        if math.isnan(sq[s]) or (not wide[s] and math.sqrt(sq[s]) < min_dir * live[s]):
            fallback.append(int(s))  # the directions cancelled: weighted mean
            sq[s] = _accumulate(out, vs, mean_coef, pieces, layout.rda.size)[s]
        elif not wide[s]:
            scale = target[s] / math.sqrt(sq[s])
            if 1.0 / _WIDE <= scale <= _WIDE:
                for start, stop, _ in pieces:
                    np.multiply(out[start:stop], np.float32(scale), out=out[start:stop])
            else:  # an fp32 factor would overflow or underflow: scale in float64
                for start, stop, _ in pieces:
                    out[start:stop] = out[start:stop].astype(np.float64) * scale
            # ‖out_s‖ = r_s, unless r_s is near float32's limit: then measure what was stored
            sq[s] = target[s] ** 2 if target[s] < _WIDE else _sq_pieces(out, pieces)
    return fallback, float(sq.sum())


def _rda_wide(
    out: F32,
    vs: Sequence[Delta],
    aa: F64,
    norms: F64,
    target: float,
    min_norm: float,
    pieces: Sequence[tuple[int, int, int]],
) -> float:
    """RDA of one segment in float64: ``out[segment] = r · φ(Σ a_m Δ_m/‖Δ_m‖)``; returns
    ‖out_s‖² (inf if the result does not fit float32), or NaN when ‖u‖ < ``min_norm``
    (the caller falls back to the weighted mean). The rare path of tiny or huge norms."""
    lo, hi = pieces[0][0], pieces[-1][1]
    u = np.zeros(hi - lo, dtype=np.float64)
    scratch = np.empty(CHUNK_ELEMENTS, dtype=np.float32)
    for m, v in enumerate(vs):
        if norms[m] > 0:
            for start, stop, _ in pieces:
                x = values(v, start, stop, scratch[: stop - start]).astype(np.float64)
                u[start - lo : stop - lo] += x / norms[m] * aa[m]
    u_norm = float(np.linalg.norm(u))
    if u_norm < min_norm:
        return math.nan
    out[lo:hi] = u * (target / u_norm)
    return _sq_pieces(out, pieces)


def _sq_pieces(x: F32, pieces: Iterable[tuple[int, int, int]]) -> float:
    return sum(_sq(x[start:stop]) for start, stop, _ in pieces)


def _accumulate(
    out: F32,
    vs: Sequence[Delta],
    coef: F64,
    pieces: Sequence[tuple[int, int, int]],
    n_seg: int,
    workers: Workers | None = None,
    step: OuterStep | None = None,
) -> F64:
    """out[piece] = Σ_m coef[m, segment] · vs[m][piece], piece by piece while it is in cache
    (the pieces shared between ``workers`` when no codes are folded); returns the squared
    norm of ``out`` per segment (0 for segments not in ``pieces``), summed in piece order
    whatever the workers. With ``step``, each piece is summed into a scratch buffer instead
    and stepped at once (``OuterStep.piece``): Δ never goes to memory, ``out`` is untouched.

    In each piece, blockwise codes are summed first, one ``CodesSum`` per block size (in order
    of first appearance), then the float32 vectors (and codes of unusual block sizes), in input
    order."""
    c32 = coef.astype(np.float32)
    groups: dict[int, list[int]] = {}
    for m, v in enumerate(vs):
        if isinstance(v, Blockwise) and v.block_size <= MAX_FOLDED_BLOCK:
            groups.setdefault(v.block_size, []).append(m)
    folded = {m for ms in groups.values() for m in ms}
    rest = [m for m in range(len(vs)) if m not in folded]

    def run(mine: Sequence[tuple[int, int, int]]) -> list[float]:
        scratch = np.empty(CHUNK_ELEMENTS, dtype=np.float32)  # per thread, as the CodesSums
        sums = [(CodesSum([cast(Blockwise, vs[m]) for m in ms]), ms) for ms in groups.values()]
        # with a step, Δ's piece goes to a scratch of its own and is stepped at once
        stepping = (
            (np.empty(CHUNK_ELEMENTS, dtype=np.float32), step, step.scratch()) if step else None
        )
        dots = []
        for start, stop, s in mine:
            dst = out[start:stop] if stepping is None else stepping[0][: stop - start]
            tmp = scratch[: stop - start]
            for i, (codes, ms) in enumerate(sums):
                codes.into(dst, c32[ms, s], start, stop, add=i > 0)
            for i, m in enumerate(rest):
                if i == 0 and not sums:
                    np.multiply(values(vs[m], start, stop, dst), c32[m, s], out=dst)
                else:
                    np.multiply(values(vs[m], start, stop, tmp), c32[m, s], out=tmp)
                    np.add(dst, tmp, out=dst)
            dots.append(_sq(dst))
            if stepping is not None:
                stepping[1].piece(start, stop, dst, stepping[2])
        return dots

    # Codes are summed in many small numpy calls (sub-pieces of a few thousand elements) that
    # hold the GIL between them: on two threads such a merge was slower (M = 16 int8, 1M
    # elements: 12.5-16.7 ms on one thread, 17.5-18.9 on two), so it stays on one.
    helpers = workers if not groups else None
    sq = np.zeros(n_seg, dtype=np.float64)
    for (_, _, s), d in zip(pieces, split_map(run, pieces, helpers), strict=True):
        sq[s] += d
    return sq


def segment_sq_norms(delta: Delta, fragment: Fragment) -> F64:
    """‖Δ_s‖² of every segment s of ``fragment`` (float64; NaN/Inf if ``delta`` holds them),
    exactly as the merge computes them: pass the result as ``ContributionData.sq_norms``.

    Raises:
        CoreError: ``delta`` is not a float32 vector (or ``Blockwise``) of the fragment's size.
    """
    size = fragment.size
    if not _fits(delta, size):
        raise CoreError(
            f"segment norms need a float32 vector of shape ({size},), got {_kind(delta)}"
        )
    with np.errstate(over="ignore", invalid="ignore"):
        return _sq_norms(
            delta, _Layout.of(fragment.segments, "mean").pieces, len(fragment.segments)
        )


def _sq_norms(v: Delta, pieces: Iterable[tuple[int, int, int]], n_seg: int) -> F64:
    """Squared L2 norm of ``v`` per segment."""
    sq = np.zeros(n_seg, dtype=np.float64)
    if isinstance(v, Blockwise):  # from the codes, exactly (Blockwise.sq_sum)
        scratch = np.empty(CHUNK_ELEMENTS, dtype=np.float32)
        for start, stop, s in pieces:
            sq[s] += v.sq_sum(start, stop, scratch)
        return sq
    for start, stop, s in pieces:
        sq[s] += _sq(v[start:stop])
    return sq


def _sq(x: F32) -> float:
    """‖x‖² of one piece: an fp32 dot (≤ CHUNK_ELEMENTS terms), redone in fp64 out of range."""
    d = float(np.dot(x, x))
    # fp32 squares overflow above ~1.8e19 (or there is a real NaN/Inf), and underflow below
    # ~1e-19: an update of tiny values must not read as zero. Both are redone in float64.
    if not _TINY_SQ <= d < math.inf:
        x64 = x.astype(np.float64)
        d = float(np.dot(x64, x64))
    return d


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def _counts(values: Sequence[float], what: str) -> F64:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if not np.isfinite(arr).all() or (arr < 0).any():
        raise CoreError(f"{what} must be finite and ≥ 0, got {list(values)}")
    return arr


def _validated(
    vectors: Sequence[Delta],
    weights: npt.ArrayLike,
    ids: Sequence[str],
    rule: str,
    out: F32 | None,
    size: int,
) -> tuple[F64, F32]:
    """Checked weights (finite, ≥ 0, one per vector) and the output buffer."""
    w = np.asarray(weights, dtype=np.float64).reshape(-1)
    if w.size != len(vectors) or len(ids) != len(vectors):
        raise CoreError(
            f"{len(vectors)} vectors, {w.size} weights, {len(ids)} ids: give one of each"
        )
    if not np.isfinite(w).all() or (w < 0).any() or not math.isfinite(float(w.sum())):
        raise CoreError(f"weights must be finite and ≥ 0, got {w.tolist()}")
    if rule not in RULES:
        raise CoreError(f"rule must be {' or '.join(map(repr, RULES))}, got {rule!r}")
    for who, v in zip(ids, vectors, strict=True):
        if not _fits(v, size):
            raise CoreError(
                f"contribution of {who} must be float32 of shape ({size},), got {_kind(v)}"
            )
    if out is None:
        return w, np.empty(size, dtype=np.float32)
    if out.dtype != np.float32 or out.shape != (size,):
        raise CoreError(f"out must be float32 of shape ({size},), got {out.dtype} {out.shape}")
    if any(shares_memory(out, v) for v in vectors):
        raise CoreError("out overlaps a contribution; pass a separate buffer")
    return w, out


def _check_step(step: OuterStep, vectors: Sequence[Delta], out: F32, size: int) -> None:
    """The step is of the fragment's size and writes into none of the merge's arrays."""
    if step.size != size:
        raise CoreError(f"the outer step is over {step.size} elements; the fragment has {size}")
    for a in step.writes():
        if np.may_share_memory(a, out) or any(shares_memory(a, v) for v in vectors):
            raise CoreError("the outer step writes into a contribution or out; separate them")


def _known_norms(
    sq_norms: Sequence[F64 | None] | None, ids: Sequence[str], n_seg: int
) -> list[F64 | None]:
    """Checked precomputed squared segment norms, one (or None) per contribution."""
    if sq_norms is None:
        return [None] * len(ids)
    if len(sq_norms) != len(ids):
        raise CoreError(f"{len(sq_norms)} sets of segment norms for {len(ids)} contributions")
    for who, k in zip(ids, sq_norms, strict=True):
        if k is not None and (
            not isinstance(k, np.ndarray) or k.dtype != np.float64 or k.shape != (n_seg,)
        ):
            got = f"{k.dtype} {k.shape}" if isinstance(k, np.ndarray) else type(k).__name__
            raise CoreError(
                f"segment norms of {who} must be float64 of shape ({n_seg},), got {got}"
            )
    return list(sq_norms)


def _fits(v: object, size: int) -> bool:
    """Whether ``v`` is a flat float32 vector, or ``Blockwise`` codes, of ``size`` elements."""
    if isinstance(v, Blockwise):
        return v.size == size
    return isinstance(v, np.ndarray) and v.dtype == np.float32 and v.shape == (size,)


def _kind(v: object) -> str:
    if isinstance(v, Blockwise):
        return f"blockwise codes of {v.size} elements"
    return f"{v.dtype} {v.shape}" if isinstance(v, np.ndarray) else type(v).__name__


def _raise_non_finite(vectors: Sequence[Delta], a: F64, ids: Sequence[str]) -> NoReturn:
    for who, v, x in zip(ids, vectors, a, strict=True):
        if x > 0 and not np.isfinite(as_float32(v)).all():
            raise CoreError(f"contribution of {who} has NaN or Inf; reject it before merging")
    raise CoreError("the merged delta overflowed float32; contributions are far too large")


__all__ = [
    "CHUNK_ELEMENTS",
    "MIN_DIRECTION_NORM",
    "ContributionData",
    "MergeResult",
    "Rule",
    "merge_fragment",
    "merge_weighted",
    "segment_sq_norms",
    "token_weights",
    "uniform_weights",
    "weighted_mean",
]
