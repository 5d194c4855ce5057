"""One router per resource; ``dd_queue.control.app`` includes them all."""

from dd_queue.control.routes import chaos, dashboard, events, faults, health, learners, metrics, run

ROUTERS = (
    health.router,
    learners.router,
    run.router,
    faults.router,
    chaos.router,
    events.router,
    metrics.router,
    dashboard.router,
)

__all__ = ["ROUTERS"]
