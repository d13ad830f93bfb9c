"""One log line when the database becomes unreachable and one when it is back, for every
process that talks to it (the REST API: ``api.dbhealth``; the controller's loops and RPCs:
``controller.rpc_errors``), instead of a traceback per request or loop pass."""

from __future__ import annotations

import logging
import threading
import time

from sqlalchemy import text

from gpufleet.store.db import Database, short_reason


class DatabaseOutage:
    """Tracks whether the database is reachable, from the errors its users meet.

    ``failed`` starts an outage (logged once at ERROR, with the driver's one-line reason for
    the operator, and ``while_down``: what the process does meanwhile); the first
    ``recovered`` (a success, or a :meth:`probe` that succeeds) ends it, logged once at
    WARNING with its length and how many failures it counted. Thread-safe; ``recovered``
    costs one attribute read while the database is up.

    Args:
        db: the database :meth:`probe` reads (None: no probing; the caller reports
            successes).
        logger: where the two lines go.
        while_down: the end of the first line, e.g. "answering 503 until it is back".
        unit: what ``failed`` counts, for the second line (e.g. "requests answered 503").
        probe_interval_s: :meth:`probe_due` is true at most this often, seconds.
    """

    def __init__(
        self,
        db: Database | None,
        *,
        logger: logging.Logger,
        while_down: str,
        unit: str,
        probe_interval_s: float = 1.0,
    ) -> None:
        self.db = db
        self.log = logger
        self.while_down, self.unit = while_down, unit
        self.probe_interval_s = probe_interval_s
        self._lock = threading.Lock()
        self.down_since: float | None = None
        self.refused = 0
        self._last_probe = 0.0

    def failed(self, exc: BaseException) -> None:
        """One failure because the database is unreachable (``exc``: the driver's error)."""
        with self._lock:
            self.refused += 1
            if self.down_since is not None:
                return
            self.down_since = time.monotonic()
        self.log.error("database unreachable (%s); %s", short_reason(exc), self.while_down)

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
        if self.db is None:
            return
        try:
            with self.db.read() as s:
                s.execute(text("SELECT 1"))
        except Exception:
            return
        self.recovered()

    def recovered(self) -> None:
        """The database answered: ends an outage (logged once); a no-op while up."""
        if self.down_since is None:
            return
        with self._lock:
            if self.down_since is None:
                return
            lasted, refused = time.monotonic() - self.down_since, self.refused
            self.down_since, self.refused = None, 0
        self.log.warning(
            "database reachable again after %.1f s (%d %s)", lasted, refused, self.unit
        )
