"""The control plane's outer gate: the ``Host`` header and the request body's size.

Both are checked before anything else runs, so no route, token check or JSON parser ever sees a
request that fails them:

- **Host.** A page on another site can make a browser send requests to ``127.0.0.1:8000`` by
  rebinding its own DNS name to that address; the browser then sends that name as ``Host``.
  Only loopback names, the bind address (unless it is a wildcard such as ``0.0.0.0``) and
  ``control.allowed_hosts`` are served; any other name gets 400, naming the setting.
- **Body size.** A body longer than ``control.max_body_bytes`` gets 413 without being read
  any further: by its ``Content-Length`` before any byte is read, or once a chunked body
  passes the limit. So a 100 MB body costs at most the limit, not 100 MB of memory and a
  JSON parse before the 401.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

__all__ = ["Guard", "allowed_hosts", "host_name"]

LOOPBACK_NAMES = ("127.0.0.1", "::1", "localhost")
_WILDCARDS = ("0.0.0.0", "::", "")


def allowed_hosts(bind: str, extra: Iterable[str]) -> frozenset[str]:
    """The ``Host`` names served: loopback, the bind address unless a wildcard, ``extra``."""
    names = {*LOOPBACK_NAMES, *(h.lower() for h in extra)}
    if bind not in _WILDCARDS:
        names.add(bind.lower().strip("[]"))
    return frozenset(names)


def host_name(header: str) -> str:
    """The name of a ``Host`` header without its port (``[::1]:8000`` gives ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.rpartition(":")[0] if header.count(":") == 1 else header


class Guard:
    """ASGI middleware: refuse foreign ``Host`` names (400) and oversized bodies (413)."""

    def __init__(self, app: Any, *, hosts: frozenset[str], max_body_bytes: int) -> None:
        self.app, self.hosts, self.max_body_bytes = app, hosts, max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope["headers"]}
        host = host_name(headers.get(b"host", b"").decode("latin-1"))
        if host not in self.hosts:
            detail = (
                f"Host {host!r} is not served here (DNS rebinding guard); add it to "
                "control.allowed_hosts to allow it"
            )
            await _answer(send, 400, detail)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        too_big = (
            f"request body over control.max_body_bytes ({self.max_body_bytes} bytes); "
            "fault and chaos requests are a few hundred bytes"
        )
        declared = headers.get(b"content-length")
        if declared is not None and not declared.isdigit():
            await _answer(send, 400, "malformed Content-Length header")
            return
        if declared is not None and int(declared) > self.max_body_bytes:
            await _answer(send, 413, too_big)
            return
        body = bytearray()
        while True:  # read it all, up to the limit, then hand it on as one message
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await _answer(send, 413, too_big)
                return
            if not message.get("more_body", False):
                break
        replay = [{"type": "http.request", "body": bytes(body), "more_body": False}]

        async def receive_once() -> Any:
            return replay.pop() if replay else await receive()

        await self.app(scope, receive_once, send)


async def _answer(send: Any, code: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": code,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
