"""Route dependencies: the app's control plane (refreshed) and the admin check."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from dd_queue.control.auth import AdminGate
from dd_queue.control.plane import ControlPlane

__all__ = ["AdminDep", "GateDep", "PlaneDep", "StalePlaneDep"]

_bearer = HTTPBearer(auto_error=False, description="control.admin_token")


def _plane(request: Request) -> ControlPlane:
    plane: ControlPlane = request.app.state.plane
    return plane


def _fresh_plane(request: Request) -> ControlPlane:
    plane = _plane(request)
    plane.refresh(max_age_s=request.app.state.min_refresh_s)
    return plane


def _gate(request: Request) -> AdminGate:
    gate: AdminGate = request.app.state.gate
    return gate


def _admin(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> str:
    _gate(request).check(credentials.credentials if credentials is not None else None)
    return request.client.host if request.client is not None else "unknown"


PlaneDep = Annotated[ControlPlane, Depends(_fresh_plane)]
"""The control plane, refreshed from Redis unless it was a moment ago."""
StalePlaneDep = Annotated[ControlPlane, Depends(_plane)]
"""The control plane as it is (the caller refreshes when it needs to)."""
GateDep = Annotated[AdminGate, Depends(_gate)]
AdminDep = Annotated[str, Depends(_admin)]
"""The client's address, once the request passed the admin check."""
