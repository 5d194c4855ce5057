"""Outer Nesterov step: equality with torch, the exact special cases of algorithm.md, state I/O."""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Literal

import numpy as np
import pytest

from dd_queue.core.fragments import plan_fragments
from dd_queue.core.merge import ContributionData, Rule, merge_fragment
from dd_queue.core.outer import (
    CHUNK_ELEMENTS,
    NesterovState,
    nesterov_step,
    state_from_bytes,
    state_from_dict,
    state_parts,
    state_to_bytes,
    state_to_dict,
)
from dd_queue.errors import CoreError

# ---------------------------------------------------------------------------------------------
# (c) Nesterov equals torch.optim.SGD(nesterov=True), step for step
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lr", "momentum", "weight_decay", "size"),
    [
        (0.7, 0.9, 0.0, 1000),
        (0.3, 0.5, 0.01, 257),
        (1.0, 0.0, 0.0, 100),  # μ = 0: plain SGD
        (0.7, 0.9, 0.0, 2 * CHUNK_ELEMENTS + 5),  # several chunks
    ],
)
def test_nesterov_matches_torch_sgd_for_100_steps(
    lr: float, momentum: float, weight_decay: float, size: int
) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    theta = rng.standard_normal(size).astype(np.float32)
    param = torch.nn.Parameter(torch.from_numpy(theta.copy()))
    kwargs = {"momentum": momentum, "nesterov": True} if momentum else {}
    opt = torch.optim.SGD([param], lr=lr, weight_decay=weight_decay, **kwargs)
    state = NesterovState.zeros(size)
    for _ in range(100):
        delta = (rng.standard_normal(size) * 0.05).astype(np.float32)
        param.grad = torch.from_numpy(delta.copy())
        opt.step()
        nesterov_step(theta, delta, state, lr=lr, momentum=momentum, weight_decay=weight_decay)
    ref = param.detach().numpy()
    # torch fuses a + α·b into one FMA, numpy rounds α·b first: equal to fp32 rounding.
    np.testing.assert_allclose(theta, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max())
    assert state.step == 100
    if momentum:
        buf = opt.state[param]["momentum_buffer"].numpy()
        np.testing.assert_allclose(
            state.momentum_buffer, buf, rtol=1e-6, atol=1e-6 * np.abs(buf).max()
        )


def test_first_step_initialises_the_buffer_with_the_gradient() -> None:
    theta = np.zeros(3, np.float32)
    state = NesterovState(momentum_buffer=np.full(3, 5.0, np.float32), step=0)
    delta = np.array([1.0, 2.0, 3.0], np.float32)
    nesterov_step(theta, delta, state, lr=0.5, momentum=0.9)
    np.testing.assert_array_equal(state.momentum_buffer, delta)  # b = Δ, as torch's clone(grad)
    np.testing.assert_allclose(theta, -0.5 * (delta + 0.9 * delta), rtol=1e-7)
    nesterov_step(theta, delta, state, lr=0.5, momentum=0.9)
    np.testing.assert_allclose(state.momentum_buffer, 1.9 * delta, rtol=1e-7)


# ---------------------------------------------------------------------------------------------
# (a) one learner, outer SGD(lr 1, μ 0): the global fragment equals the learner's model
# ---------------------------------------------------------------------------------------------


def _one_learner_rounds(
    theta_global: np.ndarray, steps: list[np.ndarray], rule: Rule
) -> list[tuple[np.ndarray, np.ndarray]]:
    fragment = plan_fragments({"w": (theta_global.size,)}, 1).fragments[0]
    state = NesterovState.zeros(theta_global.size)
    learner = theta_global.copy()
    history = []
    for version, inner_update in enumerate(steps):
        learner -= inner_update  # the learner trains (any change of θ will do)
        delta = theta_global - learner  # Δ = Θ(base) − θ, sent against the current version
        contrib = ContributionData("L0", delta, tokens=100, steps=4, base_version=version)
        merged = merge_fragment([contrib], fragment, rule=rule)
        nesterov_step(theta_global, merged.delta, state, lr=1.0, momentum=0.0)
        history.append((theta_global.copy(), learner.copy()))
        learner[:] = theta_global  # the learner receives the new global fragment
    return history


def test_one_learner_with_outer_sgd_1_is_plain_training_bit_for_bit() -> None:
    # Θ_new = Θ − 1·(Θ − θ). When Θ and θ are within a factor 2 of each other (same sign), Θ − θ
    # is exact (Sterbenz's lemma) and so is Θ − (Θ − θ) = θ: small training updates meet this.
    rng = np.random.default_rng(0)
    theta = (1.0 + rng.random(500)).astype(np.float32)
    steps = [(rng.standard_normal(500) * 1e-2).astype(np.float32) for _ in range(5)]
    for global_after, learner in _one_learner_rounds(theta, steps, "mean"):
        np.testing.assert_array_equal(global_after, learner)


@pytest.mark.parametrize("rule", ["mean", "rda"])
def test_one_learner_with_outer_sgd_1_equals_the_learner_model(rule: Rule) -> None:
    # Arbitrary values: Θ − θ rounds once (≤ ½ ulp of the difference), then Θ − (Θ − θ) rounds
    # once more, so the error is within 1 ulp of max(|Θ|, |θ|). RDA with one learner rescales Δ by
    # ‖Δ‖/‖Δ‖ computed in fp32, adding a relative 1e-7 of Δ.
    rng = np.random.default_rng(1)
    theta = rng.standard_normal(500).astype(np.float32)
    steps = [rng.standard_normal(500).astype(np.float32) for _ in range(5)]
    ulps = 1 if rule == "mean" else 4
    prev = theta.copy()
    for global_after, learner in _one_learner_rounds(theta, steps, rule):
        bound = ulps * np.spacing(np.maximum(np.abs(prev), np.abs(learner)))
        assert np.all(np.abs(global_after - learner) <= bound)
        prev = global_after


# ---------------------------------------------------------------------------------------------
# (b) M learners, equal tokens, weighted mean, outer SGD(lr 1): Θ_new is the mean of the models
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("weighting", ["tokens", "uniform"])
def test_equal_tokens_mean_and_sgd_1_give_the_mean_of_learner_models(
    weighting: Literal["tokens", "uniform"],
) -> None:
    rng = np.random.default_rng(2)
    plan = plan_fragments({"embed": (30, 4), "w": (50,), "b": (7,)}, 2)
    for fragment in plan.fragments:
        theta = rng.standard_normal(fragment.size).astype(np.float32)
        models = [theta - rng.standard_normal(fragment.size).astype(np.float32) for _ in range(5)]
        contribs = [
            ContributionData(f"L{m}", theta - model, tokens=4096, steps=8, base_version=0)
            for m, model in enumerate(models)
        ]
        merged = merge_fragment(contribs, fragment, rule="mean", weighting=weighting)
        nesterov_step(theta, merged.delta, NesterovState.zeros(fragment.size), lr=1.0, momentum=0.0)
        expected = np.mean(np.stack(models).astype(np.float64), axis=0)
        np.testing.assert_allclose(theta, expected, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# State round trips and validation
# ---------------------------------------------------------------------------------------------


def _trained_state(size: int = 10) -> NesterovState:
    rng = np.random.default_rng(4)
    theta, state = np.zeros(size, np.float32), NesterovState.zeros(size)
    for _ in range(3):
        nesterov_step(
            theta, rng.standard_normal(size).astype(np.float32), state, lr=0.7, momentum=0.9
        )
    return state


def test_state_round_trips_through_bytes_and_dict() -> None:
    state = _trained_state()
    for back in (
        state_from_bytes(state_to_bytes(state), size=10),
        state_from_dict(state_to_dict(state), size=10),
    ):
        assert back.step == 3 and np.array_equal(back.momentum_buffer, state.momentum_buffer)
        assert back.momentum_buffer.flags.writeable and back.momentum_buffer.dtype == np.float32
    assert len(state_to_bytes(state)) == 28 + 4 * 10
    empty = NesterovState.zeros(0)
    assert state_from_bytes(state_to_bytes(empty)).momentum_buffer.size == 0


def test_corrupt_or_mismatched_state_is_rejected() -> None:
    blob = state_to_bytes(_trained_state())
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: state_from_bytes(blob, size=11), "fragment has 11"),
        (lambda: state_from_bytes(blob[:-1]), "holds"),
        (lambda: state_from_bytes(b"XXXX" + blob[4:]), "magic"),
        (lambda: state_from_bytes(blob[:10]), "header"),
        (lambda: state_from_bytes(blob[:4] + b"\x02" + blob[5:]), "version 2"),
        (lambda: state_from_dict({"step": 1}), "lacks"),
        (lambda: state_from_dict(state_to_dict(_trained_state()) | {"format": "x"}), "format"),
        (lambda: state_from_dict(state_to_dict(_trained_state()) | {"size": 3}), "holds"),
        (lambda: state_from_dict(state_to_dict(_trained_state()) | {"step": -1}), "step"),
    ]
    for load, match in cases:
        with pytest.raises(CoreError, match=match):
            load()


def test_invalid_step_arguments_raise_core_error() -> None:
    theta, delta, state = np.zeros(4, np.float32), np.zeros(4, np.float32), NesterovState.zeros(4)
    with pytest.raises(CoreError, match="shapes differ"):
        nesterov_step(theta, np.zeros(5, np.float32), state, lr=1.0, momentum=0.9)
    with pytest.raises(CoreError, match="float32"):
        nesterov_step(theta.astype(np.float64), delta, state, lr=1.0, momentum=0.9)
    with pytest.raises(CoreError, match="lr"):
        nesterov_step(theta, delta, state, lr=-1.0, momentum=0.9)
    with pytest.raises(CoreError, match="momentum"):
        nesterov_step(theta, delta, state, lr=1.0, momentum=1.0)
    with pytest.raises(CoreError, match="weight_decay"):
        nesterov_step(theta, delta, state, lr=1.0, momentum=0.9, weight_decay=float("nan"))
    with pytest.raises(CoreError, match="size"):
        NesterovState.zeros(-1)
    assert state.step == 0  # nothing moved


@pytest.mark.parametrize(("momentum", "weight_decay"), [(0.9, 0.0), (0.0, 0.0), (0.9, 0.01)])
def test_a_step_into_new_arrays_gives_the_in_place_bits_and_leaves_the_inputs(
    momentum: float, weight_decay: float
) -> None:
    rng = np.random.default_rng(5)
    n = 200_003  # several chunks and a ragged end
    theta = rng.standard_normal(n).astype(np.float32)
    state = NesterovState(rng.standard_normal(n).astype(np.float32), step=3)
    kw = {"lr": 0.7, "momentum": momentum, "weight_decay": weight_decay}
    for _ in range(2):  # a later step, then a first one (b initialised with the gradient)
        delta = rng.standard_normal(n).astype(np.float32)
        before = (theta.copy(), state.momentum_buffer.copy(), state.step)
        new = (np.empty_like(theta), NesterovState(np.empty_like(theta), step=-7))
        nesterov_step(theta, delta, state, out=new, **kw)
        in_place = (theta.copy(), NesterovState(state.momentum_buffer.copy(), state.step))
        nesterov_step(*in_place[:1], delta, in_place[1], **kw)
        assert new[0].tobytes() == in_place[0].tobytes()
        assert new[1].momentum_buffer.tobytes() == in_place[1].momentum_buffer.tobytes()
        assert new[1].step == in_place[1].step == before[2] + 1
        assert theta.tobytes() == before[0].tobytes()  # the inputs are as they were
        assert state.momentum_buffer.tobytes() == before[1].tobytes() and state.step == before[2]
        state = NesterovState(state.momentum_buffer, step=0)


def test_a_step_into_arrays_that_overlap_its_inputs_is_refused() -> None:
    theta, delta = np.ones(8, np.float32), np.ones(8, np.float32)
    state = NesterovState.zeros(8)
    for out in [
        (theta, NesterovState.zeros(8)),
        (np.empty(8, np.float32), NesterovState(delta)),
        (np.empty(8, np.float32), NesterovState(np.empty(7, np.float32))),
    ]:
        with pytest.raises(CoreError):
            nesterov_step(theta, delta, state, lr=0.5, momentum=0.9, out=out)
    shared = np.empty(8, np.float32)
    with pytest.raises(CoreError, match="separate"):
        nesterov_step(
            theta, delta, state, lr=0.5, momentum=0.9, out=(shared, NesterovState(shared))
        )


@pytest.mark.parametrize(
    ("momentum", "weight_decay", "step"),
    [(0.9, 0.01, 2), (0.9, 0.01, 0), (0.9, 0.0, 2), (0.0, 0.01, 2)],
)
def test_step_arithmetic_is_float32_operation_by_operation(
    momentum: float, weight_decay: float, step: int
) -> None:
    rng = np.random.default_rng(8)
    theta, delta, buf = (rng.standard_normal(1000).astype(np.float32) for _ in range(3))
    g = delta + np.float32(weight_decay) * theta if weight_decay else delta
    if momentum:
        b = g if step == 0 else np.float32(momentum) * buf + g
        u = g + np.float32(momentum) * b
    else:
        b, u = buf, g
    expected = theta - np.float32(0.7) * u
    state = NesterovState(buf.copy(), step=step)
    nesterov_step(theta, delta, state, lr=0.7, momentum=momentum, weight_decay=weight_decay)
    assert theta.tobytes() == expected.tobytes() and theta.dtype == np.float32
    assert state.momentum_buffer.tobytes() == b.tobytes() and state.step == step + 1


def test_zero_lr_is_allowed_and_moves_only_the_buffer() -> None:
    theta, delta = np.ones(4, np.float32), np.full(4, 2.0, np.float32)
    state = NesterovState.zeros(4)
    nesterov_step(theta, delta, state, lr=0.0, momentum=0.5)
    np.testing.assert_array_equal(theta, np.ones(4, np.float32))
    np.testing.assert_array_equal(state.momentum_buffer, delta)
    assert state.step == 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": float("inf")}, r"^outer lr must be finite and ≥ 0, got inf$"),
        ({"momentum": -0.1}, r"^outer momentum must be in \[0, 1\), got -0\.1$"),
        (
            {"weight_decay": float("inf")},
            r"^outer weight_decay must be finite and ≥ 0, got inf$",
        ),
        ({"weight_decay": -0.5}, r"^outer weight_decay must be finite and ≥ 0, got -0\.5$"),
    ],
)
def test_out_of_range_hyperparameters_are_named_with_their_value(
    kwargs: dict[str, float], message: str
) -> None:
    theta, delta, state = np.zeros(4, np.float32), np.zeros(4, np.float32), NesterovState.zeros(4)
    args = {"lr": 1.0, "momentum": 0.9} | kwargs
    with pytest.raises(CoreError, match=message):
        nesterov_step(theta, delta, state, **args)


def test_array_argument_errors_give_the_full_reason() -> None:
    theta, delta, state = np.zeros(4, np.float32), np.zeros(4, np.float32), NesterovState.zeros(4)
    with pytest.raises(
        CoreError, match=r"^params, delta and momentum buffer must be flat float32 arrays$"
    ):
        nesterov_step(theta.reshape(2, 2), delta, state, lr=1.0, momentum=0.9)
    with pytest.raises(
        CoreError,
        match=r"^params, delta and momentum buffer shapes differ: \[\(4,\), \(5,\), \(4,\)\]$",
    ):
        nesterov_step(theta, np.zeros(5, np.float32), state, lr=1.0, momentum=0.9)


def test_out_argument_errors_give_the_full_reason() -> None:
    theta, delta, state = np.ones(8, np.float32), np.ones(8, np.float32), NesterovState.zeros(8)
    cases: list[tuple[tuple[np.ndarray, NesterovState], str]] = [
        (
            (np.empty(8, np.float32), NesterovState(np.empty(7, np.float32))),
            r"^out arrays must be float32 of shape \(8,\)$",
        ),
        (
            (np.empty(8, np.float64), NesterovState.zeros(8)),
            r"^out arrays must be float32 of shape \(8,\)$",
        ),
        (
            (theta, NesterovState.zeros(8)),
            r"^out arrays must not overlap Θ_p, Δ or the momentum buffer$",
        ),
        (
            (np.empty(8, np.float32), NesterovState(state.momentum_buffer)),
            r"^out arrays must not overlap Θ_p, Δ or the momentum buffer$",
        ),
    ]
    shared = np.empty(8, np.float32)
    cases.append(
        ((shared, NesterovState(shared)), r"^out Θ_p and momentum buffer must be separate arrays$")
    )
    for out, message in cases:
        with pytest.raises(CoreError, match=message):
            nesterov_step(theta, delta, state, lr=0.5, momentum=0.9, out=out)


def test_state_parts_header_is_three_uint64_and_body_is_a_view_of_the_buffer() -> None:
    buf = np.array([-1.0, 0.5, 2.0], np.float32)
    state = NesterovState(buf, step=2**63 + 5)
    header, body = state_parts(state)
    assert header == b"DDQN" + struct.pack("<3Q", 1, 2**63 + 5, 3)
    assert body.format == "B" and body.readonly
    assert body.tolist() == list(buf.tobytes())
    assert np.shares_memory(np.frombuffer(body, np.float32), buf)
    assert state_from_bytes(header + bytes(body), size=3).step == 2**63 + 5


def test_truncated_bytes_report_the_body_length_they_hold() -> None:
    blob = state_to_bytes(_trained_state())
    with pytest.raises(CoreError, match=r"^outer state says 10 elements but holds 39 bytes$"):
        state_from_bytes(blob[:-1])


@pytest.mark.parametrize("step", [True, 1.5, "3"])
def test_state_dict_step_must_be_a_plain_integer(step: object) -> None:
    d = state_to_dict(_trained_state()) | {"step": step}
    with pytest.raises(CoreError, match=r"^outer state step must be an integer ≥ 0, got "):
        state_from_dict(d)


def test_state_dict_is_checked_against_the_fragment_size() -> None:
    d = state_to_dict(_trained_state())
    with pytest.raises(
        CoreError, match=r"^outer state has 10 elements; fragment has 11\. Wrong fragment\?$"
    ):
        state_from_dict(d, size=11)
    assert state_from_dict(d, size=10).momentum_buffer.size == 10


@pytest.mark.parametrize("step", [-1, 2**64])
def test_a_state_whose_step_does_not_fit_the_header_is_refused_in_words(step: int) -> None:
    state = NesterovState(momentum_buffer=np.zeros(3, np.float32), step=step)
    with pytest.raises(CoreError, match=r"outer step must be in \[0, 2\^64\), got "):
        state_to_bytes(state)
