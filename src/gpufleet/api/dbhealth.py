"""The REST API while the database is down: 503 with ``Retry-After``, one log line when an
outage starts and one when it ends, and no traceback per request."""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import text

from gpufleet.api.middleware import ASGIApp, Message, Receive, Scope, Send
from gpufleet.store.db import Database, short_reason

log = logging.getLogger("gpufleet.api")

RETRY_AFTER_S = 2
"""``Retry-After`` of a 503 while the database is unreachable."""


class DatabaseOutage:
    """Tracks whether the database is reachable, from the errors requests meet.

    ``failed`` starts an outage (logged once, with the driver's one-line reason for the
    operator; clients get only a generic message); while one lasts, :class:`OutageWatch`
    probes the database at most every ``probe_interval_s`` after a request, and the first
    success ends it (logged once, with its length and how many requests got 503).
    """

    def __init__(self, db: Database, probe_interval_s: float = 1.0) -> None:
        self.db = db
        self.probe_interval_s = probe_interval_s
        self._lock = threading.Lock()
        self.down_since: float | None = None
        self.refused = 0
        self._last_probe = 0.0

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            self.refused += 1
            if self.down_since is not None:
                return
            self.down_since = time.monotonic()
        log.error("database unreachable (%s); answering 503 until it is back", short_reason(exc))

    def probe_due(self) -> bool:
        if self.down_since is None:
            return False
        with self._lock:
            now = time.monotonic()
            if now - self._last_probe < self.probe_interval_s:
                return False
            self._last_probe = now
            return True

    def probe(self) -> None:
        """``SELECT 1``; ends the outage when it succeeds (never raises)."""
        try:
            with self.db.read() as s:
                s.execute(text("SELECT 1"))
        except Exception:
            return
        self.recovered()

    def recovered(self) -> None:
        with self._lock:
            if self.down_since is None:
                return
            lasted, refused = time.monotonic() - self.down_since, self.refused
            self.down_since, self.refused = None, 0
        log.warning(
            "database reachable again after %.1f s (%d requests answered 503)", lasted, refused
        )


class OutageWatch:
    """ASGI middleware: during an outage, probe the database after a request (in a worker
    thread): at once after an answer below 500, else at most once per ``probe_interval_s``.
    Costs one attribute read while the database is up."""

    def __init__(self, app: ASGIApp, outage: DatabaseOutage) -> None:
        self.app = app
        self.outage = outage

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.outage.down_since is None:
            await self.app(scope, receive, send)
            return
        status = 500

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        await self.app(scope, receive, watch)
        if status < 500 or self.outage.probe_due():
            from starlette.concurrency import run_in_threadpool

            await run_in_threadpool(self.outage.probe)
