"""Wake-ups for the scheduler: a hint, never a decision.

Submit and release wake the scheduler so that a job with free capacity starts in milliseconds
instead of waiting for a tick. Losing a wake-up costs one tick (the scheduler also runs
periodically and always reads PENDING rows from the database), so the hint store may be lost
and rebuilt at any time.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Protocol

from gpufleet.queue.hint import DEFAULT_PREFIX, DEFAULT_TIMEOUT_S, shared_hint

log = logging.getLogger("gpufleet.queue")

WAKE_CHANNEL = f"{DEFAULT_PREFIX}:wake"
"""The wake channel under the default prefix (``{GPUFLEET_REDIS_PREFIX}:wake`` in general)."""


class Waker(Protocol):
    def wake(self) -> None:
        """Ask the scheduler for a pass soon."""

    def wait(self, timeout_s: float) -> bool:
        """Block until woken or ``timeout_s``; True if woken."""

    def close(self) -> None: ...


class InProcWaker:
    """Threads of one process (the embedded default: ``gpufleet up``)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def wake(self) -> None:
        self._event.set()

    def wait(self, timeout_s: float) -> bool:
        woken = self._event.wait(timeout_s)
        self._event.clear()
        return woken

    def close(self) -> None:
        self._event.set()


class RedisWaker:
    """Across processes and hosts: Redis pub/sub on ``{prefix}:wake``. A wake publishes through
    the process's :class:`~gpufleet.queue.hint.RedisHint` (one short timeout, then a circuit
    breaker: a hung Redis costs a submit one timeout once, not each time); a lost wake-up
    costs one tick. The listener subscribes in its own thread and keeps trying while Redis is
    down, so a controller starts and schedules (by tick) without it.

    Args:
        url: Redis URL (``redis://``, ``rediss://``, ``user:password@`` allowed).
        listen: subscribe (the controller) or only publish (an API server).
        prefix: the deployment's key and channel namespace.
        timeout_s: Redis command timeout, seconds.
    """

    def __init__(
        self,
        url: str,
        *,
        listen: bool,
        prefix: str = DEFAULT_PREFIX,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self._hint = shared_hint(url, prefix=prefix, timeout_s=timeout_s)
        self.channel = self._hint.key("wake")
        self._url = url
        self._local = InProcWaker()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if listen:
            self._thread = threading.Thread(target=self._listen, name="redis-wake", daemon=True)
            self._thread.start()

    def _listen(self) -> None:
        import redis

        # its own client: a subscribed connection blocks in reads, which the short command
        # timeout of the shared one would cut
        client = redis.Redis.from_url(self._url, socket_connect_timeout=2, socket_timeout=5)
        pubsub: Any = None
        down_since: float | None = None
        while not self._stop.is_set():
            try:
                if pubsub is None:
                    pubsub = client.pubsub(ignore_subscribe_messages=True)
                    pubsub.subscribe(self.channel)
                    if down_since is not None:
                        log.warning("redis wake listener: subscribed again to %s", self.channel)
                        down_since = None
                msg = pubsub.get_message(timeout=1.0)
            except Exception as exc:
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning(
                        "redis wake listener: %s (%s); the scheduler runs by tick until Redis"
                        " answers",
                        type(exc).__name__,
                        str(exc)[:200],
                    )
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()
                    pubsub = None
                self._stop.wait(2.0)
                continue
            if msg is not None:
                self._local.wake()
        if pubsub is not None:
            with contextlib.suppress(Exception):
                pubsub.close()
        client.close()

    def wake(self) -> None:
        self._local.wake()
        self._hint.call("wake publish", lambda r: r.publish(self.channel, b"1"))

    def wait(self, timeout_s: float) -> bool:
        return self._local.wait(timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._local.close()
        if self._thread is not None:
            self._thread.join(timeout=3)


def make_waker(
    redis_url: str | None,
    *,
    listen: bool,
    prefix: str = DEFAULT_PREFIX,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Waker:
    """A :class:`RedisWaker` when ``redis_url`` is set, else an :class:`InProcWaker`."""
    if not redis_url:
        return InProcWaker()
    return RedisWaker(redis_url, listen=listen, prefix=prefix, timeout_s=timeout_s)
