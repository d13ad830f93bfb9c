"""Identifiers.

Ids are time-ordered (a 48-bit millisecond timestamp then 80 random bits, Crockford base32,
like a ULID) so that sorting by id sorts by creation time; list pagination relies on it.
"""

from __future__ import annotations

import os
import time
from typing import NewType

JobId = NewType("JobId", str)
RunId = NewType("RunId", str)
ReservationId = NewType("ReservationId", str)
NodeId = NewType("NodeId", str)
TeamId = NewType("TeamId", str)
Token = NewType("Token", int)
"""Fencing token of one attempt: monotonic per job, one higher for every new attempt."""
Epoch = NewType("Epoch", int)
"""Leader epoch of the controller lease, or agent epoch (one higher per agent restart)."""

_ALPHABET = "0123456789abcdefghjkmnpqrstvwxyz"


def _encode(value: int, length: int) -> str:
    chars = []
    for _ in range(length):
        chars.append(_ALPHABET[value & 31])
        value >>= 5
    return "".join(reversed(chars))


def new_id(prefix: str) -> str:
    """Return a new time-ordered id such as ``j-01hz3k...`` (26 base32 characters after prefix).

    Uses the wall clock and ``os.urandom``; not for use inside ``policy/``.
    """
    ms = time.time_ns() // 1_000_000
    rand = int.from_bytes(os.urandom(10), "big")
    return f"{prefix}-{_encode(ms, 10)}{_encode(rand, 16)}"


def new_job_id() -> JobId:
    return JobId(new_id("j"))


def new_run_id() -> RunId:
    return RunId(new_id("r"))


def new_reservation_id() -> ReservationId:
    return ReservationId(new_id("res"))
