"""Policy configuration: which mechanisms are on, and their parameters.

Every baseline of the simulator is a ``PolicyConfig`` with one mechanism switched off, so the
gain of each mechanism is measured by the same code that runs live.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from gpufleet.domain.types import PriorityClass


class Placement(enum.StrEnum):
    BEST_FIT = "best_fit"
    """The node with the fewest free GPUs that still fits (keeps whole nodes free; seed DD7)."""
    SPREAD = "spread"
    """Worst fit: the emptiest node first (a baseline, shown to fragment)."""


class Ordering(enum.StrEnum):
    """Which queue is served next."""

    FAIR_SHARE = "fair_share"
    """Guarantees first, then weighted DRF across teams, then priority + aging in a team."""
    FIFO = "fifo"
    """One global order by queue time (baseline)."""
    STRICT_PRIORITY = "strict_priority"
    """One global order by priority class, then queue time; no aging, no fairness (baseline)."""
    QSSF = "qssf"
    """Quasi-Shortest-Service-First (Hu et al., SC 2021): one global order by predicted
    service, GPUs x ``predicted_duration_s`` (the platform's history-based estimate, else the
    user's ``expected_duration_s``); jobs with neither last, by queue time (baseline)."""
    SRTF = "srtf"
    """Shortest-Remaining-Time-First: one global order by remaining run time,
    ``expected_duration_s`` (the simulator passes the remaining work; exact with an oracle),
    else ``predicted_duration_s``; jobs with neither last. With ``preemption`` on, the first
    blocked job of a team may also stop attempts of its own team with more remaining time
    (Tiresias, NSDI 2019; Helios, SC 2021); with it off it is non-preemptive SJF (baseline)."""


class Backfill(enum.StrEnum):
    """What happens behind a job that cannot be placed now."""

    EASY = "easy"
    """The first blocked job of each team gets a reservation (a node and a time); later jobs
    may start only where they do not delay it (EASY backfill, Lifka 1995)."""
    OFF = "off"
    """Strict order: a blocked job blocks its queue (the global queue, or its team's queue
    when borrowing is off). The "no backfill" baseline."""
    GREEDY = "greedy"
    """Anything that fits starts, no reservations: high utilization, large jobs can starve.
    A baseline that shows why reservations exist."""


DEFAULT_HEAD_START_S: Mapping[PriorityClass, float] = MappingProxyType(
    {
        PriorityClass.CRITICAL: 24 * 3600.0,
        PriorityClass.HIGH: 8 * 3600.0,
        PriorityClass.NORMAL: 2 * 3600.0,
        PriorityClass.LOW: 0.0,
    }
)
"""Aging rules per tier: a job of tier t is ordered as if it had waited ``head_start_s[t]``
longer than it did. Every job earns one second of credit per second waited, so a LOW job that
waited longer than ``head_start_s[CRITICAL]`` is ahead of any newly submitted CRITICAL job of
its team (the starvation bound in docs/design/scheduling-policy.md)."""


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Knobs of one scheduling pass.

    Attributes:
        placement: best fit (default) or spread.
        max_decisions_per_cycle: at most this many Place decisions per pass.
        ordering: fair share (default), FIFO, strict priority, QSSF or SRTF (baselines).
        backfill: EASY reservations (default), OFF (strict order) or GREEDY.
        borrowing: teams may use idle GPUs above their guarantee (False = each team is
            confined to its guarantee, the "no borrowing" baseline).
        preemption: the policy may name victims (reclaim of loans, priority preemption).
        head_start_s: aging rules per priority tier (see ``DEFAULT_HEAD_START_S``).
        max_reservations: backfill reservations per pass (at most one per team, one per node).
        max_preemptions_per_cycle: Preempt decisions per pass.
        hold_timeout_s: a hold for a preemptor older than this is released (victims that never
            stop must not keep GPUs idle forever).
        usage_half_life_s: half-life of decayed usage (``policy.usage``), seconds.
        default_runtime_estimate_s: estimate used for a running job without expected
            duration or max runtime when computing reservations; None = it never ends.
        backfill_depth: after a team's first blocked job, at most this many more of its jobs
            are tried in one pass (Slurm's ``bf_max_job_test``/``default_queue_depth`` idea):
            bounds a pass at O(teams x depth) when capacity is nearly exhausted; the rest
            are tried again next pass.
    """

    placement: Placement = Placement.BEST_FIT
    max_decisions_per_cycle: int = 10_000
    ordering: Ordering = Ordering.FAIR_SHARE
    backfill: Backfill = Backfill.EASY
    borrowing: bool = True
    preemption: bool = True
    head_start_s: Mapping[PriorityClass, float] = field(
        default_factory=lambda: DEFAULT_HEAD_START_S
    )
    max_reservations: int = 8
    max_preemptions_per_cycle: int = 16
    hold_timeout_s: float = 3600.0
    usage_half_life_s: float = 7 * 24 * 3600.0
    default_runtime_estimate_s: float | None = None
    backfill_depth: int = 100
