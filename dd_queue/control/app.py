"""The control plane app: ``create_app(cfg, bus, clock)`` builds a FastAPI app with no globals.

    app = create_app(cfg, RedisBus(cfg.redis.url, cfg.run.run_id), SystemClock())
    uvicorn.run(app, host=cfg.control.host, port=cfg.control.port)

Everything the routes share hangs off ``app.state``: the :class:`ControlPlane` (Redis reads and
the fault/chaos actions), the :class:`AdminGate` (bearer token) and the Prometheus registry.
The lifespan runs a ticker (every ``control.refresh_s``) that refreshes the plane, advances the
fault watches and fires due chaos faults. Errors map to answers, never to a 500: a Redis failure
is 503, a refused action 404/409, a bad body 422. Bodies are read as JSON whatever their
Content-Type says (``JsonBodies``: ``curl -d`` sends a form type).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request, status
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles

from dd_queue import __version__
from dd_queue.bus import Bus
from dd_queue.clock import Clock
from dd_queue.config import DDQConfig
from dd_queue.control.auth import AdminGate
from dd_queue.control.guard import Guard, allowed_hosts
from dd_queue.control.metrics import alert_sample, registry_for
from dd_queue.control.plane import ControlPlane
from dd_queue.control.routes import ROUTERS
from dd_queue.control.routes.dashboard import STATIC_DIR
from dd_queue.errors import BusError, DDQError, Refused
from dd_queue.startup import NOTE_EVERY_S

__all__ = ["JsonBodies", "create_app", "tick"]

log = logging.getLogger("dd_queue.control")


def tick(plane: ControlPlane) -> None:
    """The ticker's step: refresh the plane, fire due chaos faults, evaluate the alerts."""
    with plane.lock:
        plane.tick()
        plane.alerting.observe(alert_sample(plane), plane.wall())


async def _ticker(plane: ControlPlane, period_s: float) -> None:
    failing_since: float | None = None
    next_note_s = 0.0
    while True:
        try:
            await anyio.to_thread.run_sync(tick, plane)
        except DDQError as exc:  # Redis down: keep ticking, it may come back
            now = time.monotonic()
            failing_since = now if failing_since is None else failing_since
            if now >= next_note_s:
                log.warning(
                    "control.waiting for Redis for %.0f s, answering 503 meanwhile: %s",
                    now - failing_since,
                    exc,
                )
                next_note_s = now + NOTE_EVERY_S
        else:
            if failing_since is not None:
                log.info("control.redis_back after %.0f s", time.monotonic() - failing_since)
                failing_since, next_note_s = None, 0.0
        await anyio.sleep(period_s)


def _finite(value: Any) -> Any:
    """``value`` with non-finite floats as text (a 422 echoing a NaN input must still encode)."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


_LENIENT_TYPES = frozenset({b"", b"application/x-www-form-urlencoded", b"text/plain"})
_BODY_HINT = (
    "the body must be one JSON object, e.g. curl -H 'Content-Type: application/json' "
    """-d '{"target": "L0", "kind": "stall", "duration_s": 5}'"""
)


class JsonBodies:
    """ASGI middleware: a body sent to ``/api/`` is read as JSON whatever its Content-Type says.

    ``curl -d '{...}'`` sends ``application/x-www-form-urlencoded``, which FastAPI would not parse
    as JSON (422 "Input should be a valid dictionary"); a missing or ``text/plain`` type is
    treated the same way. Other types (multipart, ...) are left alone and get the 422 with a hint.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] in ("POST", "PUT", "PATCH")
            and scope["path"].startswith("/api/")
        ):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            given = next((v for k, v in scope["headers"] if k == b"content-type"), b"")
            if given.split(b";")[0].strip().lower() in _LENIENT_TYPES:
                headers.append((b"content-type", b"application/json"))
                scope = {**scope, "headers": headers}
        await self.app(scope, receive, send)


def _handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        detail = _finite(jsonable_encoder(errors))
        answer: dict[str, Any] = {"detail": detail}
        if any(tuple(e.get("loc", ())) == ("body",) for e in errors) or any(
            e.get("type") == "json_invalid" for e in errors
        ):
            answer["hint"] = _BODY_HINT
        return JSONResponse(answer, status.HTTP_422_UNPROCESSABLE_CONTENT)

    @app.exception_handler(BusError)
    async def bus_error(request: Request, exc: BusError) -> JSONResponse:
        detail = f"redis unavailable: {exc}; retry when it answers"
        return JSONResponse({"detail": detail}, status.HTTP_503_SERVICE_UNAVAILABLE)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, exc.status_code)


def create_app(
    cfg: DDQConfig,
    bus: Bus,
    clock: Clock,
    *,
    wall: Callable[[], float] = time.time,
    ticker: bool = True,
    min_refresh_s: float = 0.2,
    seed: int | None = None,
    new_token: Callable[[], str] | None = None,
) -> FastAPI:
    """Build the control plane app of one run.

    Args:
        cfg: The run's config (``control`` section: token, refresh period).
        bus: The run's bus (the app does not close it).
        clock: Monotonic seconds.
        wall: Wall-clock seconds since the epoch, for records.
        ticker: Run the background ticker (every ``control.refresh_s``); tests that drive
            time themselves pass False and call ``app.state.plane.tick()``.
        min_refresh_s: Requests within this many seconds of a refresh reuse it.
        seed: Seed of random choices (``random`` targets, unseeded chaos schedules).
        new_token: Makes the admin token when none is configured (default: 24 random bytes).

    Returns:
        The app; serve it with uvicorn.
    """
    plane = ControlPlane(cfg, bus, clock, wall=wall, seed=seed)
    period_s = cfg.control.refresh_s

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tasks:
            if ticker:
                tasks.start_soon(_ticker, plane, period_s)
            yield
            tasks.cancel_scope.cancel()

    app = FastAPI(
        title="dd_queue control plane",
        version=__version__,
        summary="Observe a Decoupled DiLoCo run and inject faults into it.",
        lifespan=lifespan,
    )
    app.state.plane = plane
    app.state.gate = AdminGate.from_config(cfg.control, new_token=new_token)
    app.state.registry = registry_for(plane)
    app.state.min_refresh_s = min_refresh_s
    for router in ROUTERS:
        app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    app.add_middleware(JsonBodies)
    app.add_middleware(  # outermost: before any route, token check or JSON parse
        Guard,
        hosts=allowed_hosts(cfg.control.host, cfg.control.allowed_hosts),
        max_body_bytes=cfg.control.max_body_bytes,
    )
    _handlers(app)
    return app
