"""Pure ASGI middleware of the REST API (no ``BaseHTTPMiddleware``: it buffers and wraps
every request in a task, and it cannot see the bytes of a body as they are read).

:class:`BodyLimit` bounds a request body by the bytes really received, chunked or not, before
any route (and so any authentication work) runs. :class:`SecurityHeaders` adds the browser
security headers (CSP, framing, sniffing, referrer) to every answer.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class BodyTooLarge(Exception):
    """Raised from ``receive`` once more than the limit has arrived (the app's body read then
    fails; :class:`BodyLimit` answers 413 in its place)."""


def error_body(code: str, message: str, field: str | None) -> bytes:
    """The API's error document ``{"error", "message", "field"}`` as JSON bytes."""
    return json.dumps({"error": code, "message": message, "field": field}).encode()


class BodyLimit:
    """Answer 413 to any HTTP request whose body is over ``max_bytes``.

    - A ``Content-Length`` over the limit is refused at once, without reading the body or
      calling the app.
    - Otherwise (chunked, or a lying length) the bytes are counted as the app reads them; past
      the limit ``receive`` raises :class:`BodyTooLarge`, nothing more is buffered, and
      whatever the app tries to answer is replaced by the 413. The server then closes the
      connection, since the rest of the body was never read.

    Memory held per request is at most ``max_bytes`` plus one chunk of the server's.

    Args:
        app: the ASGI app.
        max_bytes: the largest body accepted, bytes.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers") or ():
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = -1
                if declared > self.max_bytes:
                    await self._refuse(send)
                    return
        received = 0
        over = False
        started = False

        async def counting_receive() -> Message:
            nonlocal received, over
            if over:
                raise BodyTooLarge
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    over = True
                    raise BodyTooLarge
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if over:
                if message["type"] == "http.response.start" and not started:
                    started = True
                    await self._refuse(send)
                return  # the app's own answer to the failed read is dropped
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, counting_receive, guarded_send)
        except Exception:
            if not over:
                raise
            # whatever the failed body read turned into, the answer is the 413
        if over and not started:
            await self._refuse(send)

    async def _refuse(self, send: Send) -> None:
        body = error_body("payload_too_large", f"request body over {self.max_bytes} bytes", "body")
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(len(body)).encode()),
                    (b"connection", b"close"),
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})


UI_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; form-action 'self'; frame-ancestors 'none'; "
    "base-uri 'none'; object-src 'none'"
)
"""The dashboard's Content-Security-Policy: scripts only from this server (``/ui/static``:
htmx and ui.js; no inline script, no eval: htmx runs with ``allowEval`` off), forms only to
it, never framed. Inline ``style`` attributes (bar widths) are allowed: styles cannot run
code."""
API_CSP = "default-src 'none'; frame-ancestors 'none'"
"""Every other answer (JSON, logs): nothing to load, never framed. The API docs pages
(``/docs``, ``/redoc``) carry only ``frame-ancestors 'none'``: Swagger UI starts from an
inline script."""


class SecurityHeaders:
    """Add the browser security headers to every HTTP answer: ``X-Content-Type-Options:
    nosniff``, ``X-Frame-Options: DENY``, ``Referrer-Policy: same-origin`` and a
    Content-Security-Policy (:data:`UI_CSP` under ``/ui``, :data:`API_CSP` elsewhere, only
    ``frame-ancestors 'none'`` for the docs pages).

    Args:
        app: the ASGI app.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        if path.startswith("/ui"):
            csp = UI_CSP
        elif path.startswith(("/docs", "/redoc")):
            csp = "frame-ancestors 'none'"
        else:
            csp = API_CSP
        extra = [
            (b"x-content-type-options", b"nosniff"),
            (b"x-frame-options", b"DENY"),
            (b"referrer-policy", b"same-origin"),
            (b"content-security-policy", csp.encode()),
        ]

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                have = {name.lower() for name, _ in message.get("headers") or ()}
                message["headers"] = [
                    *(message.get("headers") or ()),
                    *(h for h in extra if h[0] not in have),
                ]
            await send(message)

        await self.app(scope, receive, with_headers)
