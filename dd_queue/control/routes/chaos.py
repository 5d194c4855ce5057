"""``POST /api/chaos`` (start / stop / replay a seeded schedule; bearer token) and
``GET /api/chaos``."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body

from dd_queue.control.deps import AdminDep, PlaneDep
from dd_queue.control.requests import ChaosRequest, ChaosStart, ChaosStop
from dd_queue.control.routes.faults import WRITE_ERRORS
from dd_queue.control.schemas import ChaosView
from dd_queue.control.views import chaos_view

router = APIRouter(prefix="/api/chaos", tags=["chaos"])


@router.get("", summary="The running chaos schedule and the stored ones")
def get_chaos(plane: PlaneDep) -> ChaosView:
    """Chaos status; stored schedules come from the run's event stream."""
    with plane.lock:
        return chaos_view(plane)


@router.post("", summary="Start, stop or replay a seeded chaos schedule", responses=WRITE_ERRORS)
def post_chaos(
    plane: PlaneDep, client: AdminDep, body: Annotated[ChaosRequest, Body()]
) -> ChaosView:
    """``start``: plan Poisson faults from the seed and rates, store the schedule and play it;
    ``stop``: stop playing; ``replay``: play a stored schedule again (same faults)."""
    with plane.lock:
        who = f"{body.by}@{client}"
        if isinstance(body, ChaosStart):
            plane.actions.start(body, who=who)
        elif isinstance(body, ChaosStop):
            plane.actions.stop(who=who)
        else:
            plane.actions.replay(body.schedule_id, who=who)
        return chaos_view(plane)
