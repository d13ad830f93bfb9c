"""This controller's view of its leader lease (:class:`Leadership`), shared by the loops.

The lease itself lives in the database (``store.leader``); every leader-only write re-checks
the epoch inside its transaction, so this view only says whether to try.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Leadership:
    """This controller's view of its lease (re-checked inside every write anyway)."""

    holder: str
    epoch: int = 0

    @property
    def is_leader(self) -> bool:
        return self.epoch > 0
