"""Policy configuration: which mechanisms are on, and their parameters."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Placement(enum.StrEnum):
    BEST_FIT = "best_fit"
    """The node with the fewest free GPUs that still fits (keeps whole nodes free; seed DD7)."""
    SPREAD = "spread"
    """Worst fit: the emptiest node first (a baseline, shown to fragment)."""


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    placement: Placement = Placement.BEST_FIT
    max_decisions_per_cycle: int = 10_000
