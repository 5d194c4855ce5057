"""The control plane: a FastAPI app that reads the run from Redis and injects faults.

``create_app(cfg, bus, clock)`` builds it (``dd_queue.control.app``); ``ddq control`` /
``python -m dd_queue.services.control_plane`` serve it (``dd_queue.control.service``). Layout:
``plane``
(the model, refreshed from Redis) with ``members``, ``tails``, ``ledger``, ``faultbook``,
``observe``; ``actions`` and ``chaos`` (what operators do); ``requests``/``schemas``/``views``
(the HTTP shapes); ``routes/`` (one router per resource); ``static/`` (the dashboard).
"""

from dd_queue.control.app import create_app

__all__ = ["create_app"]
