"""The REST API while the database is down: 503 with ``Retry-After``, one log line when an
outage starts and one when it ends, and no traceback per request."""

from __future__ import annotations

import logging

from gpufleet.api.middleware import ASGIApp, Message, Receive, Scope, Send
from gpufleet.store.db import Database
from gpufleet.store.outage import DatabaseOutage as _Outage

log = logging.getLogger("gpufleet.api")

RETRY_AFTER_S = 2
"""``Retry-After`` of a 503 while the database is unreachable."""


class DatabaseOutage(_Outage):
    """The API's outage tracker (:class:`gpufleet.store.outage.DatabaseOutage`): logs on
    ``gpufleet.api``; while one lasts, :class:`OutageWatch` probes the database at most every
    ``probe_interval_s`` after a request, and the first success ends it."""

    def __init__(self, db: Database, probe_interval_s: float = 1.0) -> None:
        super().__init__(
            db,
            logger=log,
            while_down="answering 503 until it is back",
            unit="requests answered 503",
            probe_interval_s=probe_interval_s,
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
