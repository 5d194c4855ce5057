"""``GET /healthz`` (the process is up) and ``GET /readyz`` (Redis answers and a synchronizer
heartbeat is fresh)."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from dd_queue.control.deps import StalePlaneDep
from dd_queue.control.schemas import Health, Readiness
from dd_queue.errors import BusError

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="The control plane process is up")
def healthz(plane: StalePlaneDep) -> Health:
    """Always 200 while the process serves requests (no Redis call)."""
    return Health(uptime_s=plane.clock.now() - plane.started_s)


@router.get(
    "/readyz",
    summary="Redis is reachable and a synchronizer heartbeat is fresh",
    responses={503: {"model": Readiness, "description": "Not ready; the reason says why."}},
)
def readyz(plane: StalePlaneDep, response: Response) -> Readiness:
    """200 when ready, else 503; both with the reason."""
    fresh_s = plane.cfg.membership.stalled_after_s
    try:
        plane.refresh()
    except BusError as exc:
        response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
        return Readiness(ready=False, reason=f"redis unreachable: {exc}")
    syncs = plane.members.synchronizers
    fresh = [s for s in syncs if s.heartbeat_age_s <= fresh_s]
    if fresh:
        best = min(fresh, key=lambda s: s.heartbeat_age_s)
        why = f"synchronizer {best.synchronizer_id} heartbeat {best.heartbeat_age_s:.1f} s old"
        return Readiness(ready=True, reason=why)
    response.status_code = status.HTTP_503_SERVICE_UNAVAILABLE
    if syncs:
        age = min(s.heartbeat_age_s for s in syncs)
        return Readiness(
            ready=False,
            reason=f"synchronizer heartbeat {age:.1f} s old > stalled_after_s {fresh_s:g} s",
        )
    return Readiness(ready=False, reason="no synchronizer heartbeat: is a synchronizer running?")
