"""``GET /api/learners`` and ``GET /api/learners/{learner_id}``: membership and progress."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, status

from dd_queue.control.deps import PlaneDep
from dd_queue.control.requests import NAME_PATTERN
from dd_queue.control.schemas import ErrorView, LearnerView
from dd_queue.control.views import learner_view

router = APIRouter(prefix="/api/learners", tags=["learners"])


@router.get("", summary="Every learner seen: state, reason, progress, contributions")
def list_learners(plane: PlaneDep) -> list[LearnerView]:
    """Learners sorted by id; dead and departed ones stay listed until a restart of the
    control plane."""
    with plane.lock:
        return [learner_view(plane, obs) for obs in plane.members.learners]


@router.get(
    "/{learner_id}",
    summary="One learner",
    responses={404: {"model": ErrorView, "description": "No such learner."}},
)
def get_learner(
    plane: PlaneDep, learner_id: Annotated[str, Path(pattern=NAME_PATTERN)]
) -> LearnerView:
    """One learner by id."""
    with plane.lock:
        obs = plane.members.learner(learner_id)
        if obs is None:
            known = ", ".join(o.learner_id for o in plane.members.learners) or "none"
            raise HTTPException(
                status.HTTP_404_NOT_FOUND, f"unknown learner {learner_id!r} (known: {known})"
            )
        return learner_view(plane, obs)
