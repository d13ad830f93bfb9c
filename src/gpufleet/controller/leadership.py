"""This controller's view of its leader lease (:class:`Leadership`), shared by the loops.

The lease itself lives in the database (``store.leader``); every leader-only write re-checks
the epoch inside its transaction, so this view only says whether to try. The view also ends
on its own when the lease it last renewed runs out (``lease_deadline``): a controller whose
renewal hangs (its host cut off, a database connection stuck on an unanswered TCP stream)
stops acting as leader at its lease's end, not when the hung call returns, and when it renews
late it counts silence afresh from that renewal.

It also says since when this leader could hear the fleet (``listening_since``, on the
database clock): a node's silence is counted from its last heartbeat or from that instant,
whichever is later, so a stopped control plane or a failover fences no live node
(``docs/design/lifecycle.md``, "Silence is counted only while a controller listens").
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime


@dataclass
class Leadership:
    """This controller's view of its lease (re-checked inside every write anyway).

    Attributes:
        holder: this controller's lease holder name.
        epoch: the epoch held, 0 when not leader.
        listening_since: database-clock time from which this leader counts silence: when it
            took the lease, or when it could write to the database again after a failed
            renewal. None (tests that build a Leadership by hand) = no grace.
        lease_deadline: ``time.monotonic()`` (seconds, float) at which the lease last
            renewed expires at the latest (the renewal's start + the lease length); past it
            this view is not leader until a renewal succeeds. None = no local bound.
    """

    holder: str
    epoch: int = 0
    listening_since: datetime | None = None
    lease_deadline: float | None = None

    @property
    def is_leader(self) -> bool:
        """Whether this controller holds the lease, as far as it can know: an epoch, and
        the last renewal's lease not yet run out on this host's monotonic clock."""
        if self.epoch <= 0:
            return False
        return self.lease_deadline is None or time.monotonic() < self.lease_deadline

    def listened_for_s(self, now: datetime) -> float:
        """Seconds (float) this leader has been able to hear heartbeats at ``now`` (the
        database clock); infinite when ``listening_since`` is unknown."""
        if self.listening_since is None:
            return float("inf")
        return max(0.0, (now - self.listening_since).total_seconds())
