"""Wake-ups across processes through the real Redis (a hint: losing one costs a tick)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from gpufleet.queue import InProcWaker, RedisWaker
from tests.conftest import REDIS_URL

pytestmark = pytest.mark.redis


def test_a_wake_from_another_process_reaches_the_listener() -> None:
    listener = RedisWaker(REDIS_URL, listen=True)
    try:
        time.sleep(0.2)  # subscription established
        assert listener.wait(0.05) is False
        code = (
            f"from gpufleet.queue import RedisWaker; w = RedisWaker({REDIS_URL!r}, listen=False);"
            " w.wake(); w.close()"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=30)
        t0 = time.monotonic()
        assert listener.wait(5.0) is True
        assert time.monotonic() - t0 < 5.0
    finally:
        listener.close()


def test_publishing_to_an_unreachable_redis_does_not_raise() -> None:
    waker = RedisWaker("redis://127.0.0.1:1/0", listen=False)
    waker.wake()  # logged, not raised: the scheduler's tick covers a lost hint
    assert waker.wait(0.01) is True  # the local half still wakes this process
    waker.close()


def test_inproc_waker_wakes_once_per_signal() -> None:
    w = InProcWaker()
    w.wake()
    assert w.wait(0.01) is True
    assert w.wait(0.01) is False
