"""``GET /metrics``: Prometheus text exposition (prometheus-client)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

router = APIRouter(tags=["metrics"])


@router.get(
    "/metrics",
    summary="Prometheus metrics of the run",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Exposition."}},
)
def metrics(request: Request) -> Response:
    """Rounds, merges, contributions by outcome, quorum, grace window, staleness, bytes,
    learner states, goodput, eval loss, stream lengths and pending counts."""
    body = generate_latest(request.app.state.registry)
    return Response(body, media_type=CONTENT_TYPE_LATEST)
