"""Balanced tensor fragmentation: coverage, the LPT bound, determinism, layout helpers."""

from __future__ import annotations

import itertools
import math
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dd_queue.core.fragments import (
    FragmentPlan,
    flatten_fragment,
    plan_fragments,
    plan_of_fragments,
    shapes_from_named,
    unflatten_fragment,
    unflatten_into,
)
from dd_queue.errors import CoreError

_NAMES = st.text(alphabet="abcdefgh._", min_size=1, max_size=6)
_SHAPE = st.lists(st.integers(1, 6), min_size=0, max_size=3).map(tuple)


@st.composite
def models(draw: st.DrawFn, max_tensors: int = 12) -> tuple[dict[str, tuple[int, ...]], int]:
    shapes = draw(st.dictionaries(_NAMES, _SHAPE, min_size=1, max_size=max_tensors))
    n_fragments = draw(st.integers(1, len(shapes)))
    return shapes, n_fragments


def _assert_exact_cover(plan: FragmentPlan, shapes: dict[str, tuple[int, ...]]) -> None:
    seen = [s.name for f in plan.fragments for s in f.segments]
    assert sorted(seen) == sorted(shapes)  # every tensor exactly once
    for f in plan.fragments:
        position = 0
        for seg in f.segments:  # no gap, no overlap inside the flat vector
            assert seg.start == position
            assert seg.size == math.prod(shapes[seg.name]) and seg.shape == shapes[seg.name]
            position = seg.stop
        assert f.size == position
    assert plan.n_elements == sum(math.prod(s) for s in shapes.values())
    assert [f.index for f in plan.fragments] == list(range(plan.n_fragments))


@settings(max_examples=60, deadline=None)
@given(models(), st.booleans())
def test_plan_covers_every_parameter_exactly_once(
    model: tuple[dict[str, tuple[int, ...]], int], isolate: bool
) -> None:
    shapes, n_fragments = model
    plan = plan_fragments(shapes, n_fragments, isolate_embeddings=isolate)
    assert plan.n_fragments == n_fragments
    assert min(plan.sizes) > 0
    _assert_exact_cover(plan, shapes)


def _optimal_makespan(sizes: list[int], n_bins: int) -> int:
    """Brute force over every assignment of tensors to bins (small cases only)."""
    assignment = np.array(list(itertools.product(range(n_bins), repeat=len(sizes))))
    loads = np.stack([((assignment == b) * np.array(sizes)).sum(axis=1) for b in range(n_bins)])
    return int(loads.max(axis=0).min())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 50), min_size=1, max_size=8), st.integers(1, 3))
def test_largest_fragment_is_within_the_lpt_bound_of_the_optimum(sizes: list[int], p: int) -> None:
    p = min(p, len(sizes))
    plan = plan_fragments({f"t{i}": (n,) for i, n in enumerate(sizes)}, p)
    optimum = _optimal_makespan(sizes, p)
    assert max(plan.sizes) <= (4 / 3 - 1 / (3 * p)) * optimum + 1e-9  # Graham's bound for LPT


@settings(max_examples=40, deadline=None)
@given(models(), st.randoms(use_true_random=False))
def test_plan_depends_only_on_the_set_of_names_and_shapes(
    model: tuple[dict[str, tuple[int, ...]], int], rnd: random.Random
) -> None:
    shapes, n_fragments = model
    items = list(shapes.items())
    rnd.shuffle(items)
    for isolate in (False, True):
        a = plan_fragments(shapes, n_fragments, isolate_embeddings=isolate)
        b = plan_fragments(dict(items), n_fragments, isolate_embeddings=isolate)
        assert a == b and a.digest == b.digest


def test_lpt_balances_a_transformer_like_model() -> None:
    shapes = {"tok_embeddings.weight": (1000, 64), "norm.weight": (64,)}
    for layer in range(8):
        shapes |= {f"layers.{layer}.attn.w": (64, 192), f"layers.{layer}.mlp.w": (64, 256)}
        shapes |= {f"layers.{layer}.ln.weight": (64,)}
    plan = plan_fragments(shapes, 4)
    assert plan.imbalance < 1.2
    frag, seg = plan.locate("layers.3.mlp.w")
    assert seg in plan.fragments[frag].segments and seg.shape == (64, 256)


def test_digest_identifies_the_layout() -> None:
    shapes = {"a": (4, 4), "b": (8,), "embed.w": (10, 2)}
    base = plan_fragments(shapes, 2)
    assert base.digest == plan_fragments(dict(reversed(shapes.items())), 2).digest
    assert base.digest != plan_fragments(shapes | {"b": (9,)}, 2).digest
    assert base.digest != plan_fragments(shapes, 3).digest
    assert base.digest != plan_fragments(shapes, 2, embedding_patterns=()).digest
    assert len(base.digest) == 64


def test_embedding_tensors_are_marked_and_can_be_isolated() -> None:
    shapes = {"wte.weight": (100, 8), "model.embed_tokens": (50, 8), "h.0.w": (8, 8)}
    shapes |= {"h.1.w": (8, 8), "h.2.w": (8, 8), "lm_head.weight": (100, 8)}
    plan = plan_fragments(shapes, 3, isolate_embeddings=True)
    kinds = [{s.is_embedding for s in f.segments} for f in plan.fragments]
    assert all(len(k) == 1 for k in kinds)  # no fragment mixes embeddings and the rest
    flagged = {s.name for f in plan.fragments for s in f.segments if s.is_embedding}
    assert flagged == {"wte.weight", "model.embed_tokens"}  # untied lm_head: not by default
    custom = plan_fragments(shapes, 3, embedding_patterns=("embed", "wte", "lm_head"))
    assert sum(s.is_embedding for f in custom.fragments for s in f.segments) == 3


def test_isolation_is_best_effort_with_one_fragment_or_one_kind() -> None:
    shapes = {"wte": (10, 4), "w": (4, 4)}
    assert plan_fragments(shapes, 1, isolate_embeddings=True).sizes == (56,)
    only_dense = {"a": (3,), "b": (2,)}
    assert plan_fragments(only_dense, 2, isolate_embeddings=True) == plan_fragments(only_dense, 2)


@pytest.mark.parametrize(
    ("shapes", "n_fragments", "match"),
    [
        ({}, 1, "no tensors"),
        ({"a": (0, 3)}, 1, "empty"),
        ({"a": (2,), "b": (3,)}, 0, "between 1 and 2"),
        ({"a": (2,), "b": (3,)}, 3, "between 1 and 2"),
        ({"a": (2,), "b": (0,)}, 2, "between 1 and 1"),
        ({"a": (2, -1)}, 1, "integers ≥ 0"),
        ({"a": (2.5,)}, 1, "integers ≥ 0"),
        ({"": (2,)}, 1, "non-empty strings"),
    ],
)
def test_invalid_plans_are_rejected(shapes: dict[str, Any], n_fragments: int, match: str) -> None:
    with pytest.raises(CoreError, match=match):
        plan_fragments(shapes, n_fragments)


def test_shapes_from_named_rejects_duplicates_and_accepts_torch_shapes() -> None:
    with pytest.raises(CoreError, match="twice"):
        shapes_from_named([("a", (2,)), ("a", (3,))])
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3))
    shapes = shapes_from_named((n, p.shape) for n, p in model.named_parameters())
    assert shapes == {"0.weight": (10, 4), "1.weight": (3, 4), "1.bias": (3,)}
    plan = plan_fragments(shapes, 2)
    params = {n: p.detach().numpy() for n, p in model.named_parameters()}
    flat = flatten_fragment(plan.fragments[0], params)
    back = unflatten_fragment(plan.fragments[0], flat)
    assert all(np.array_equal(back[n], params[n]) for n in back)


def test_flatten_unflatten_round_trip_into_preallocated_buffers() -> None:
    rng = np.random.default_rng(0)
    shapes = {"a": (3, 4), "b": (5,), "c": (), "d": (2, 0)}
    arrays = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    plan = plan_fragments(shapes, 2)
    for frag in plan.fragments:
        out = np.full(frag.size, np.nan, dtype=np.float32)
        assert flatten_fragment(frag, arrays, out=out) is out
        views = unflatten_fragment(frag, out)
        assert all(np.array_equal(views[n], arrays[n]) for n in frag.names)
        targets = {n: np.zeros(shapes[n], dtype=np.float32) for n in frag.names}
        unflatten_into(frag, out, targets)
        assert all(np.array_equal(targets[n], arrays[n]) for n in frag.names)
        views[frag.names[0]][...] = 7.0  # views write through to the flat vector
        assert out[frag.segments[0].start] == 7.0


def test_flatten_rejects_missing_or_misshapen_tensors() -> None:
    plan = plan_fragments({"a": (2, 2), "b": (3,)}, 1)
    frag = plan.fragments[0]
    with pytest.raises(CoreError, match="missing"):
        flatten_fragment(frag, {"a": np.zeros((2, 2))})
    with pytest.raises(CoreError, match="shape"):
        flatten_fragment(frag, {"a": np.zeros((4,)), "b": np.zeros(3)})
    with pytest.raises(CoreError, match="float32"):
        flatten_fragment(frag, {"a": np.zeros((2, 2)), "b": np.zeros(3)}, out=np.zeros(7))  # type: ignore[arg-type]
    with pytest.raises(CoreError, match="cannot write"):
        unflatten_into(frag, np.zeros(7, np.float32), {"a": np.zeros((2, 2)), "b": np.zeros(4)})


def test_locate_names_the_tensor_it_cannot_find() -> None:
    plan = plan_fragments({"a": (2,), "b": (3,)}, 2)
    with pytest.raises(
        CoreError, match=r"^tensor 'nope' is not in the fragment plan; check the model's names$"
    ):
        plan.locate("nope")


@pytest.mark.parametrize(
    ("shapes", "n_fragments", "message"),
    [
        ({}, 1, r"^the model has no tensors; nothing to fragment$"),
        ({"a": (0, 3)}, 1, r"^every tensor of the model is empty; nothing to fragment$"),
        (
            {"a": (2,), "b": (0,)},
            2,
            r"^n_fragments=2 must be between 1 and 1 \(the number of non-empty tensors\): whole "
            r"tensors are packed, so there cannot be more fragments$",
        ),
    ],
)
def test_plan_errors_give_the_full_reason(
    shapes: dict[str, Any], n_fragments: int, message: str
) -> None:
    with pytest.raises(CoreError, match=message):
        plan_fragments(shapes, n_fragments)


def test_unflatten_into_reports_the_target_shape_it_found() -> None:
    frag = plan_fragments({"a": (2, 2), "b": (3,)}, 1).fragments[0]
    flat = np.zeros(7, np.float32)
    with pytest.raises(
        CoreError, match=r"^cannot write tensor 'b': target shape None, plan \(3,\)$"
    ):
        unflatten_into(frag, flat, {"a": np.zeros((2, 2))})
    with pytest.raises(
        CoreError, match=r"^cannot write tensor 'b': target shape \(4,\), plan \(3,\)$"
    ):
        unflatten_into(frag, flat, {"a": np.zeros((2, 2)), "b": np.zeros(4)})


@pytest.mark.parametrize(
    ("shapes", "n_fragments", "n_embedding_fragments"),
    [
        ({"embed.a": (1,), "embed.b": (1,), "a": (10,), "b": (10,), "c": (10,)}, 3, 1),
        ({"embed.a": (10,), "embed.b": (10,), "a": (1,), "b": (1,), "c": (1,)}, 3, 2),
        ({"embed.a": (4,), "embed.b": (4,), "a": (4,), "b": (4,), "c": (4,)}, 4, 2),
        ({"embed.a": (3,), "embed.b": (3,), "a": (6,), "b": (6,), "c": (6,)}, 4, 1),
        ({"embed.a": (100,), "embed.b": (100,), "embed.c": (100,), "w": (1,)}, 3, 2),
        ({"embed": (100,), "a": (1,), "b": (1,)}, 3, 1),
        ({"embed.a": (100,), "embed.b": (0,), "a": (1,), "b": (1,)}, 3, 1),
        ({"embed.a": (1,), "embed.b": (1,), "embed.c": (1,), "w": (100,)}, 3, 2),
        ({"embed.a": (1,), "embed.b": (1,), "embed.c": (1,), "w": (100,), "z": (0,)}, 3, 2),
        ({"embed": (1,), "a": (5,), "b": (5,)}, 2, 1),
        ({"wte": (10,), "wte2": (1,), "b": (1,)}, 2, 1),
    ],
)
def test_isolated_embeddings_get_their_rounded_share_of_fragments(
    shapes: dict[str, tuple[int, ...]], n_fragments: int, n_embedding_fragments: int
) -> None:
    plan = plan_fragments(shapes, n_fragments, isolate_embeddings=True)
    _assert_exact_cover(plan, shapes)
    assert plan.n_fragments == n_fragments and min(plan.sizes) > 0
    kinds = [{s.is_embedding for s in f.segments} for f in plan.fragments]
    assert kinds == [{True}] * n_embedding_fragments + [{False}] * (
        n_fragments - n_embedding_fragments
    )


def test_isolation_with_only_embedding_tensors_is_the_plain_plan() -> None:
    shapes = {"wte": (3,), "embed": (2,)}
    isolated = plan_fragments(shapes, 2, isolate_embeddings=True)
    assert isolated == plan_fragments(shapes, 2)
    assert isolated.sizes == (3, 2)


def test_digest_of_non_ascii_names_is_a_stable_golden_value() -> None:
    plan = plan_fragments({"Θ.weight": (2, 3), "wte": (4,)}, 2)
    assert plan.digest == "da793c5b6047a4987c7c6313716bc0a93c2dd2d4fa2571f8891a6ed67f38734e"


@given(models())
def test_the_plan_of_a_plans_own_fragments_is_that_plan(model) -> None:
    """What a restarted synchronizer rebuilds from the committed states is the planned plan."""
    shapes, n = model
    plan = plan_fragments(shapes, n)
    assert plan_of_fragments(plan.fragments) == plan


def test_the_plan_of_fragments_needs_them_indexed_in_order() -> None:
    plan = plan_fragments({"a": (4,), "b": (3,), "c": (2,)}, 3)
    with pytest.raises(CoreError, match=r"indexed 0\.\.P-1 in order"):
        plan_of_fragments(plan.fragments[::-1])
    with pytest.raises(CoreError, match=r"indexed 0\.\.P-1 in order"):
        plan_of_fragments(())
    fewer = plan_of_fragments(plan.fragments[:2])  # a different plan: a different digest
    assert fewer.digest != plan.digest
