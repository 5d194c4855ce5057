"""Balanced tensor fragmentation: which parameter tensors form each of the P fragments.

Decoupled DiLoCo (Douillard et al., arXiv 2604.21428) syncs the model fragment by fragment, as
Streaming DiLoCo does (arXiv 2501.18512). Its fragments come from *balanced tensor
fragmentation*: whole tensors are bin-packed, largest first, into P groups of near-equal size. We
use Graham's LPT rule (longest processing time first): sort tensors by element count descending,
ties broken by name, and put each one into the currently lightest fragment (ties: lowest index).
Its largest fragment is at most (4/3 − 1/(3P)) times the best possible one.

The plan depends only on the *set* of (name, shape) pairs, never on the order they were given in,
so every learner and synchronizer, on any machine, derives the same plan; ``FragmentPlan.digest``
(sha256 of a canonical description) lets them check it. Segments inside a fragment are ordered by
name and laid out contiguously in one flat float32 vector of ``Fragment.size`` elements.

Decisions:
- P must be between 1 and the number of non-empty tensors: an empty fragment would open rounds
  that merge nothing, so it is an error rather than an option.
- Tensors whose name contains one of ``embedding_patterns`` (plain substrings) are marked
  ``is_embedding``; the merge averages them with the weighted mean, never RDA. With
  ``isolate_embeddings=True`` they also get fragments of their own (best effort: not when P = 1,
  or when the model has only one kind of tensor). A tied ``lm_head`` is listed by
  ``named_parameters()`` under the embedding's name, so the default patterns cover it; add
  ``"lm_head"`` to treat an untied output layer as an embedding too.

This module is pure: no I/O, no torch (see :func:`shapes_from_named` for the learner's boundary).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dd_queue.errors import CoreError

DEFAULT_EMBEDDING_PATTERNS: tuple[str, ...] = ("embed", "wte", "tok_embeddings")
_PLAN_FORMAT = "ddq.fragment_plan.v1"


@dataclass(frozen=True, slots=True)
class Segment:
    """One tensor's place in its fragment's flat vector: elements ``[start, stop)``."""

    name: str
    start: int
    stop: int
    shape: tuple[int, ...]
    is_embedding: bool

    @property
    def size(self) -> int:
        """Number of elements (``stop − start``)."""
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Fragment:
    """One fragment: its index, its segments (ordered by name) and its size in elements."""

    index: int
    segments: tuple[Segment, ...]
    size: int

    @property
    def names(self) -> tuple[str, ...]:
        """Tensor names in layout order."""
        return tuple(s.name for s in self.segments)


@dataclass(frozen=True, slots=True)
class FragmentPlan:
    """The P fragments of a model, and a digest that identifies the plan across processes.

    Attributes:
        fragments: The fragments, indexed 0..P−1.
        digest: sha256 (hex) of the canonical JSON of every fragment's (name, shape,
            is_embedding) list; equal digests mean identical layouts.
    """

    fragments: tuple[Fragment, ...]
    digest: str

    @property
    def n_fragments(self) -> int:
        """P, the number of fragments."""
        return len(self.fragments)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Elements per fragment."""
        return tuple(f.size for f in self.fragments)

    @property
    def n_elements(self) -> int:
        """Elements in the whole model."""
        return sum(self.sizes)

    @property
    def imbalance(self) -> float:
        """Largest over smallest fragment size (1.0 is perfect balance)."""
        return max(self.sizes) / min(self.sizes)

    def locate(self, name: str) -> tuple[int, Segment]:
        """Return ``(fragment index, segment)`` of tensor ``name``.

        Raises:
            CoreError: No tensor of that name is in the plan.
        """
        for fragment in self.fragments:
            for segment in fragment.segments:
                if segment.name == name:
                    return fragment.index, segment
        raise CoreError(f"tensor {name!r} is not in the fragment plan; check the model's names")


def shapes_from_named(named: Iterable[tuple[str, Sequence[int]]]) -> dict[str, tuple[int, ...]]:
    """Collect ``(name, shape)`` pairs, e.g. ``(n, p.shape) for n, p in model.named_parameters()``.

    Raises:
        CoreError: A name appears twice.
    """
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in named:
        if name in shapes:
            raise CoreError(f"tensor name {name!r} appears twice; parameter names must be unique")
        shapes[name] = tuple(int(d) for d in shape)
    return shapes


def plan_fragments(
    shapes: Mapping[str, Sequence[int]],
    n_fragments: int,
    *,
    isolate_embeddings: bool = False,
    embedding_patterns: Sequence[str] = DEFAULT_EMBEDDING_PATTERNS,
    embedding_names: Collection[str] = (),
) -> FragmentPlan:
    """Split a model into P fragments by balanced tensor fragmentation (greedy LPT).

    Args:
        shapes: Tensor name → shape. Order does not matter.
        n_fragments: P, between 1 and the number of tensors with at least one element.
        isolate_embeddings: Give embedding tensors fragments of their own; their number is
            P·E/T rounded (E embedding elements, T all elements), kept within what both
            kinds can fill.
        embedding_patterns: Substrings that mark a tensor name as an embedding.
        embedding_names: Tensors that are embeddings whatever their names (the model
            builder finds them by module type: ``models.builder.embedding_names``).

    Returns:
        The frozen plan.

    Raises:
        CoreError: Empty model, bad name or shape, or P outside [1, non-empty tensors].
    """
    sizes = _validated_sizes(shapes)
    n_nonempty = sum(1 for size in sizes.values() if size > 0)
    if n_fragments < 1 or n_fragments > n_nonempty:
        raise CoreError(
            f"n_fragments={n_fragments} must be between 1 and {n_nonempty} (the number of "
            "non-empty tensors): whole tensors are packed, so there cannot be more fragments"
        )
    emb = {n for n in sizes if n in embedding_names or any(p in n for p in embedding_patterns)}
    groups = _isolated_groups(sizes, emb, n_fragments) if isolate_embeddings else None
    if groups is None:
        bins = _lpt(sizes, n_fragments)
    else:
        (emb_names, k_emb), (other_names, k_other) = groups
        bins = _lpt({n: sizes[n] for n in emb_names}, k_emb)
        bins += _lpt({n: sizes[n] for n in other_names}, k_other)
    fragments = tuple(_layout(i, sorted(names), shapes, emb) for i, names in enumerate(bins))
    return FragmentPlan(fragments=fragments, digest=_digest(fragments))


def plan_of_fragments(fragments: Sequence[Fragment]) -> FragmentPlan:
    """The plan these fragments (indexed 0..P−1, as a run's committed states hold them) make,
    with its digest: equal to the digest ``plan_fragments`` gave them.

    Raises:
        CoreError: No fragments, or they are not indexed 0..P−1 in order.
    """
    if not fragments or [f.index for f in fragments] != list(range(len(fragments))):
        raise CoreError(
            f"fragments must be indexed 0..P-1 in order, got {[f.index for f in fragments]}"
        )
    return FragmentPlan(fragments=tuple(fragments), digest=_digest(tuple(fragments)))


def flatten_fragment(
    fragment: Fragment,
    arrays: Mapping[str, npt.ArrayLike],
    *,
    out: npt.NDArray[np.float32] | None = None,
) -> npt.NDArray[np.float32]:
    """Copy a fragment's tensors into one flat float32 vector (into ``out`` when given).

    Raises:
        CoreError: A tensor is missing or has the wrong shape, or ``out`` has the wrong size.
    """
    flat = _check_flat(fragment, np.empty(fragment.size, np.float32) if out is None else out)
    for seg in fragment.segments:
        if seg.name not in arrays:
            raise CoreError(f"fragment {fragment.index} needs tensor {seg.name!r}; it is missing")
        src = np.asarray(arrays[seg.name])
        if src.shape != seg.shape:
            raise CoreError(f"tensor {seg.name!r} has shape {src.shape}; the plan says {seg.shape}")
        np.copyto(flat[seg.start : seg.stop], src.reshape(-1), casting="same_kind")
    return flat


def unflatten_fragment(
    fragment: Fragment, flat: npt.NDArray[np.float32]
) -> dict[str, npt.NDArray[np.float32]]:
    """Views of each tensor inside the flat vector (no copy; writing them writes ``flat``)."""
    flat = _check_flat(fragment, flat)
    return {s.name: flat[s.start : s.stop].reshape(s.shape) for s in fragment.segments}


def unflatten_into(
    fragment: Fragment, flat: npt.NDArray[np.float32], arrays: Mapping[str, npt.NDArray[np.generic]]
) -> None:
    """Copy the flat vector back into existing arrays (e.g. numpy views of model parameters).

    Raises:
        CoreError: A tensor is missing or has the wrong shape.
    """
    views = unflatten_fragment(fragment, flat)
    for name, view in views.items():
        dst = arrays.get(name)
        if dst is None or dst.shape != view.shape:
            got = None if dst is None else dst.shape
            raise CoreError(f"cannot write tensor {name!r}: target shape {got}, plan {view.shape}")
        np.copyto(dst, view, casting="same_kind")


# ---------------------------------------------------------------------------------------------
# Internals
# ---------------------------------------------------------------------------------------------


def _validated_sizes(shapes: Mapping[str, Sequence[int]]) -> dict[str, int]:
    if len(shapes) == 0:
        raise CoreError("the model has no tensors; nothing to fragment")
    sizes: dict[str, int] = {}
    for name, shape in shapes.items():
        if not isinstance(name, str) or not name:
            raise CoreError(f"tensor names must be non-empty strings, got {name!r}")
        dims = tuple(shape)
        if any(isinstance(d, bool) or not isinstance(d, int | np.integer) or d < 0 for d in dims):
            raise CoreError(f"tensor {name!r} has shape {dims}; dimensions must be integers ≥ 0")
        sizes[name] = math.prod(int(d) for d in dims)
    if sum(sizes.values()) == 0:
        raise CoreError("every tensor of the model is empty; nothing to fragment")
    return sizes


def _lpt(sizes: Mapping[str, int], n_bins: int) -> list[list[str]]:
    """Longest-processing-time bin packing; deterministic given the set of (name, size)."""
    bins: list[list[str]] = [[] for _ in range(n_bins)]
    loads = [0] * n_bins
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        i = min(range(n_bins), key=lambda b: (loads[b], b))  # lightest, then lowest index
        bins[i].append(name)
        loads[i] += sizes[name]
    return bins


def _isolated_groups(
    sizes: Mapping[str, int], emb: set[str], n_fragments: int
) -> tuple[tuple[list[str], int], tuple[list[str], int]] | None:
    """Embedding and other tensors with their fragment counts, or None when not separable."""
    emb_names = [n for n in sizes if n in emb]
    other_names = [n for n in sizes if n not in emb]
    n_emb = sum(1 for n in emb_names if sizes[n] > 0)
    n_other = sum(1 for n in other_names if sizes[n] > 0)
    if n_fragments == 1 or n_emb == 0 or n_other == 0:
        return None
    share = n_fragments * sum(sizes[n] for n in emb_names) / sum(sizes.values())
    low, high = max(1, n_fragments - n_other), min(n_emb, n_fragments - 1)
    k_emb = min(high, max(low, math.floor(share + 0.5)))
    return (emb_names, k_emb), (other_names, n_fragments - k_emb)


def _layout(
    index: int, names: list[str], shapes: Mapping[str, Sequence[int]], emb: set[str]
) -> Fragment:
    segments: list[Segment] = []
    start = 0
    for name in names:
        shape = tuple(int(d) for d in shapes[name])
        stop = start + math.prod(shape)
        segments.append(Segment(name, start, stop, shape, name in emb))
        start = stop
    return Fragment(index=index, segments=tuple(segments), size=start)


def _digest(fragments: tuple[Fragment, ...]) -> str:
    canonical = {
        "format": _PLAN_FORMAT,
        "fragments": [
            [[s.name, list(s.shape), s.is_embedding] for s in f.segments] for f in fragments
        ],
    }
    text = json.dumps(canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _check_flat(fragment: Fragment, flat: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    if flat.dtype != np.float32 or flat.shape != (fragment.size,):
        raise CoreError(
            f"fragment {fragment.index} vector must be float32 of shape ({fragment.size},); "
            f"got {flat.dtype} {flat.shape}"
        )
    return flat


__all__ = [
    "DEFAULT_EMBEDDING_PATTERNS",
    "Fragment",
    "FragmentPlan",
    "Segment",
    "flatten_fragment",
    "plan_fragments",
    "plan_of_fragments",
    "shapes_from_named",
    "unflatten_fragment",
    "unflatten_into",
]
