"""Wake-ups for the scheduler: a hint, never a decision.

Submit and release wake the scheduler so that a job with free capacity starts in milliseconds
instead of waiting for a tick. Losing a wake-up costs one tick (the scheduler also runs
periodically and always reads PENDING rows from the database), so the hint store may be lost
and rebuilt at any time.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

log = logging.getLogger("gpufleet.queue")

WAKE_CHANNEL = "gpufleet:wake"


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
    """Across processes and hosts: Redis pub/sub on ``gpufleet:wake``. A publish failure is
    logged and ignored (the tick covers it)."""

    def __init__(self, url: str, *, listen: bool) -> None:
        import redis

        self._redis = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
        self._local = InProcWaker()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if listen:
            self._pubsub = self._redis.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
            self._pubsub.subscribe(WAKE_CHANNEL)
            self._thread = threading.Thread(target=self._listen, name="redis-wake", daemon=True)
            self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                msg = self._pubsub.get_message(timeout=1.0)
            except Exception as exc:
                log.warning("redis wake listener: %s", exc)
                self._stop.wait(1.0)
                continue
            if msg is not None:
                self._local.wake()

    def wake(self) -> None:
        self._local.wake()
        try:
            self._redis.publish(WAKE_CHANNEL, b"1")
        except Exception as exc:
            log.warning("redis wake publish failed: %s", exc)

    def wait(self, timeout_s: float) -> bool:
        return self._local.wait(timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._local.close()
        if self._thread is not None:
            self._thread.join(timeout=3)
            self._pubsub.close()
        self._redis.close()


def make_waker(redis_url: str | None, *, listen: bool) -> Waker:
    return RedisWaker(redis_url, listen=listen) if redis_url else InProcWaker()
