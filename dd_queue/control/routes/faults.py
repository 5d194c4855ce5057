"""``POST /api/faults`` (inject; bearer token) and ``GET /api/faults`` (the records)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, status

from dd_queue.control.deps import AdminDep, PlaneDep
from dd_queue.control.requests import FaultRequest
from dd_queue.control.schemas import ErrorView, FaultView
from dd_queue.control.views import fault_view

router = APIRouter(prefix="/api/faults", tags=["faults"])

WRITE_ERRORS: dict[int | str, dict[str, object]] = {
    400: {"model": ErrorView, "description": "The body could not be read as JSON."},
    401: {"model": ErrorView, "description": "Missing or wrong bearer token."},
    403: {"model": ErrorView, "description": "Mutating routes are disabled."},
    404: {"model": ErrorView, "description": "Unknown target."},
    409: {"model": ErrorView, "description": "Not possible now (target not live, ...)."},
    503: {"model": ErrorView, "description": "Redis is unreachable."},
}


@router.get("", summary="Injected faults with who, when, what and the observed effect")
def list_faults(
    plane: PlaneDep,
    limit: Annotated[int, Query(ge=1, le=500, description="How many (newest first).")] = 50,
) -> list[FaultView]:
    """Fault records from the run's event stream, newest first."""
    with plane.lock:
        return [fault_view(r) for r in plane.book.newest(limit)]


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    summary="Inject a fault into a learner or the synchronizer",
    responses=WRITE_ERRORS,
)
def inject_fault(plane: PlaneDep, client: AdminDep, body: FaultRequest) -> FaultView:
    """Send the fault through the target's control stream; it is applied at the target's next
    safe point. The record's ``effects`` fill in as the control plane observes them."""
    with plane.lock:
        record = plane.actions.inject(body, who=f"{body.by}@{client}")
        return fault_view(record)
