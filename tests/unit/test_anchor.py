"""Version ring and re-anchoring: edge sizes, who each outcome is about, and refusals in words."""

from __future__ import annotations

import numpy as np
import pytest

from dd_queue.core.anchor import Anchoring, VersionRing, anchor_contributions, re_anchor
from dd_queue.core.merge import ContributionData
from dd_queue.errors import CoreError


def ring_of(n_versions: int, *, capacity: int, size: int = 2) -> VersionRing:
    ring = VersionRing(capacity=capacity, size=size)
    for v in range(n_versions):
        ring.push(v, np.full(size, float(v), np.float32))
    return ring


def contribution(base_version: int, size: int = 2) -> ContributionData:
    return ContributionData("L7", np.ones(size, np.float32), 1, 1, base_version=base_version)


def test_a_ring_of_empty_fragments_is_allowed() -> None:
    ring = VersionRing(capacity=2, size=0)
    ring.push(0, np.empty(0, np.float32))
    got = ring.get(0)
    assert got is not None and got.shape == (0,)


@pytest.mark.parametrize(
    ("capacity", "size"), [(0, 3), (1, -1)], ids=["no-capacity", "negative-size"]
)
def test_a_ring_that_cannot_hold_a_version_is_refused(capacity: int, size: int) -> None:
    with pytest.raises(CoreError) as err:
        VersionRing(capacity=capacity, size=size)
    assert str(err.value) == (
        f"VersionRing needs capacity ≥ 1 and size ≥ 0, got {capacity}, {size}"
    )


@pytest.mark.parametrize(
    ("base", "dropped", "reason"),
    [
        (3, False, "L7: base v3 is current"),
        (2, False, "L7: re-anchored from v2 to v3"),
        (1, True, "L7: base v1 left the ring (holds v2..v3); dropped as too stale"),
        (4, True, "L7: base v4 is newer than current v3; dropped"),
    ],
    ids=["current", "re-anchored", "too-stale", "future"],
)
def test_every_outcome_names_its_learner(base: int, dropped: bool, reason: str) -> None:
    outcome = re_anchor(contribution(base), ring_of(4, capacity=2))
    assert (outcome.learner_id, outcome.dropped, outcome.reason) == ("L7", dropped, reason)


def test_learner_anchoring_keeps_each_contribution_and_names_its_learner() -> None:
    contrib = contribution(0)
    kept, outcomes = anchor_contributions([contrib], None, anchor="learner")
    assert kept == (contrib,)
    assert outcomes == (Anchoring("L7", contrib, "L7: learner anchoring"),)


@pytest.mark.parametrize(
    "out",
    [np.empty(2, np.float64), np.empty(3, np.float32), np.empty((2, 2), np.float32)],
    ids=["float64", "too-long", "2-d"],
)
def test_an_unusable_out_buffer_is_refused(out: np.ndarray) -> None:
    with pytest.raises(CoreError) as err:
        re_anchor(contribution(1), ring_of(3, capacity=3), out=out)
    assert str(err.value) == "L7: out must be a separate float32 buffer of shape (2,)"


def test_anchoring_without_a_version_says_what_to_do() -> None:
    with pytest.raises(CoreError) as err:
        re_anchor(contribution(0), VersionRing(capacity=1, size=2))
    assert str(err.value) == "the version ring is empty; push the current global version first"
    with pytest.raises(CoreError) as err:
        anchor_contributions([contribution(0)], None)
    assert str(err.value) == "synchronizer anchoring needs the fragment's VersionRing"
