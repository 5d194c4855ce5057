"""``GET /api/state`` (the run as a whole), ``GET /api/rounds`` (recent round records) and
``GET /api/alerts`` (the alert rules of ``deploy/alerts.yml``, evaluated here) and
``GET /api/tokens`` (each learner's token fate)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from dd_queue.control.deps import PlaneDep
from dd_queue.control.schemas import AlertsView, RoundView, StateView, TokenFateView
from dd_queue.control.views import alerts_view, round_view, state_view, token_fate_views

router = APIRouter(prefix="/api", tags=["run"])


@router.get("/state", summary="Fragments, totals, quorum and grace figures, eval, goodput")
def get_state(plane: PlaneDep, request: Request) -> StateView:
    """The run's state as the control plane last read it from Redis."""
    with plane.lock:
        return state_view(plane, writes_enabled=request.app.state.gate.writes_enabled)


@router.get("/rounds", summary="Recent round records, newest first")
def list_rounds(
    plane: PlaneDep,
    limit: Annotated[int, Query(ge=1, le=1000, description="How many (newest first).")] = 50,
    fragment_id: Annotated[int | None, Query(ge=0, description="Only this fragment.")] = None,
) -> list[RoundView]:
    """Round records (merged and abandoned) with contributors, outcomes, timings, bytes."""
    with plane.lock:
        records = plane.log.newest_rounds(len(plane.log.rounds))
        if fragment_id is not None:
            records = [r for r in records if r.fragment_id == fragment_id]
        return [round_view(plane, r) for r in records[:limit]]


@router.get("/alerts", summary="Alerts now: deploy/alerts.yml's rules over this run")
def get_alerts(plane: PlaneDep) -> AlertsView:
    """Pending and firing alerts (each with a dashboard link), and every rule, as evaluated at
    the control plane's last tick (``core.alerts``)."""
    with plane.lock:
        return alerts_view(plane)


@router.get("/tokens", summary="Each learner's tokens, computed to fate; the sums balance")
def list_token_fates(plane: PlaneDep) -> list[TokenFateView]:
    """Per learner: tokens computed, and what became of them (merged, late, superseded, stale,
    dropped, dead-lettered, unsent, in flight), from counts kept in Redis."""
    with plane.lock:
        return token_fate_views(plane)
