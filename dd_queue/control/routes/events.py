"""``GET /api/snapshot`` (what the dashboard shows) and ``GET /api/events`` (the same, live,
as Server-Sent Events: one ``snapshot`` event per refresh)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated

import anyio
from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from dd_queue.control.deps import PlaneDep, StalePlaneDep
from dd_queue.control.plane import ControlPlane
from dd_queue.control.schemas import DashboardSnapshot
from dd_queue.control.views import (
    alert_views,
    event_views,
    fault_view,
    learner_view,
    round_view,
    state_view,
    token_fate_views,
)
from dd_queue.errors import DDQError

router = APIRouter(prefix="/api", tags=["events"])


def snapshot(plane: ControlPlane, *, writes_enabled: bool, rounds: int = 40) -> DashboardSnapshot:
    """The dashboard's view of the plane (call after a refresh)."""
    with plane.lock:
        return DashboardSnapshot(
            generation=plane.generation,
            at_s=plane.wall(),
            learners=[learner_view(plane, obs) for obs in plane.members.learners],
            state=state_view(plane, writes_enabled=writes_enabled),
            rounds=[round_view(plane, r) for r in plane.log.newest_rounds(rounds)],
            faults=[fault_view(r) for r in plane.book.newest(20)],
            events=event_views(plane, 30),
            alerts=alert_views(plane),
            train_loss={lid: list(curve) for lid, curve in sorted(plane.train_losses.items())},
            tokens=token_fate_views(plane),
        )


@router.get("/snapshot", summary="Everything the dashboard shows, at once")
def get_snapshot(plane: PlaneDep, request: Request) -> DashboardSnapshot:
    """Learners, state, recent rounds, faults and events."""
    return snapshot(plane, writes_enabled=request.app.state.gate.writes_enabled)


def _frame(plane: ControlPlane, writes_enabled: bool, max_age_s: float) -> str:
    try:
        plane.refresh(max_age_s=max_age_s)
        data = snapshot(plane, writes_enabled=writes_enabled).model_dump_json()
    except DDQError as exc:  # Redis down: say so, keep the stream open
        message = str(exc).replace("\n", " ")
        return f"event: problem\ndata: {message}\n\n"
    return f"id: {plane.generation}\nevent: snapshot\ndata: {data}\n\n"


@router.get(
    "/events",
    summary="Live dashboard updates (Server-Sent Events)",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}, "description": "SSE stream."}},
)
async def stream_events(
    plane: StalePlaneDep,
    request: Request,
    limit: Annotated[
        int | None, Query(ge=1, le=100_000, description="Stop after this many events.")
    ] = None,
) -> StreamingResponse:
    """One ``snapshot`` event (JSON ``DashboardSnapshot``) every ``control.refresh_s``; a
    ``problem`` event while Redis is unreachable."""
    period_s = plane.cfg.control.refresh_s
    writes = request.app.state.gate.writes_enabled

    async def frames() -> AsyncIterator[str]:
        yield f"retry: {int(period_s * 2000)}\n\n"
        sent = 0
        while limit is None or sent < limit:
            yield await anyio.to_thread.run_sync(_frame, plane, writes, period_s / 2)
            sent += 1
            if (limit is not None and sent >= limit) or await request.is_disconnected():
                break
            await anyio.sleep(period_s)

    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(frames(), media_type="text/event-stream", headers=headers)
