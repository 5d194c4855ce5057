"""Who may change the run: a bearer token for the mutating routes.

``control.admin_token`` (env ``DDQ__CONTROL__ADMIN_TOKEN``) enables writes with that token. With
none configured, a random token is generated at start and logged once (WARNING), and writes stay
off unless ``control.enable_writes`` is true: a control plane started without thought cannot be
used to kill a run. Read-only routes stay open (the default bind is 127.0.0.1).
"""

from __future__ import annotations

import hmac
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import HTTPException, status

from dd_queue.config import ControlConfig

__all__ = ["AdminGate"]

log = logging.getLogger("dd_queue.control")

_HOW = "set control.admin_token (DDQ__CONTROL__ADMIN_TOKEN) or control.enable_writes: true"


@dataclass(frozen=True, slots=True)
class AdminGate:
    """The admin token and whether mutating routes are on.

    Attributes:
        token: The token a request must bear.
        writes_enabled: Whether mutating routes accept requests at all.
        generated: Whether the token was generated at start (not configured).
    """

    token: str
    writes_enabled: bool
    generated: bool

    @classmethod
    def from_config(
        cls, control: ControlConfig, *, new_token: Callable[[], str] | None = None
    ) -> AdminGate:
        """The gate of a config; a generated token is logged once, here."""
        if control.admin_token is not None:
            return cls(control.admin_token.get_secret_value(), True, False)
        token = (new_token or (lambda: secrets.token_urlsafe(24)))()
        state = "enabled (control.enable_writes)" if control.enable_writes else "disabled"
        log.warning(
            "control.token generated admin token %s; mutating routes are %s (to choose the "
            "token, %s)",
            token,
            state,
            _HOW.split(" or ")[0],
        )
        return cls(token, control.enable_writes, True)

    def check(self, credentials: str | None) -> None:
        """Let a request through, or raise the HTTP error that says why not.

        Args:
            credentials: The bearer token the request carried (None: no ``Authorization:
                Bearer`` header).

        Raises:
            HTTPException: 403 when writes are off, 401 when the token is missing or wrong.
        """
        if not self.writes_enabled:
            raise HTTPException(status.HTTP_403_FORBIDDEN, f"mutating routes are disabled: {_HOW}")
        if credentials is None:
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "missing 'Authorization: Bearer <token>' header",
                headers={"WWW-Authenticate": "Bearer"},
            )
        if not hmac.compare_digest(credentials.encode(), self.token.encode()):
            raise HTTPException(
                status.HTTP_401_UNAUTHORIZED,
                "wrong bearer token",
                headers={"WWW-Authenticate": 'Bearer error="invalid_token"'},
            )
