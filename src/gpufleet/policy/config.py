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
    """The first blocked job of each team, and the fleet's first blocked job of each size
    (GPU count), get a reservation (a node and a time) that persists across passes; later jobs may
    start only where they do not delay it (EASY backfill, Lifka 1995)."""
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
        max_reservations: backfill reservations per pass, the floor (one per node; see
            ``nodes_per_reservation`` for the number that scales with the fleet).
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
        nodes_per_reservation: the reservations of a pass scale with the fleet: at most
            ``max(max_reservations, schedulable nodes // nodes_per_reservation)`` (0 = the
            fixed ``max_reservations``). 88 nodes at the default 4 give 22.
        headroom_wait_s: a large job that has waited this long, seconds, gets headroom:
            the node(s) that drain soonest for it are shielded from smaller jobs
            (``policy.defrag``, seed DD7); None = no headroom. EASY backfill only.
        large_job_node_share: a job is *large* when it needs at least this share of the
            largest node of its GPU type (and at least 2 GPUs); a gang always is.
        headroom_max_node_share: at most this share of the schedulable nodes is shielded
            at once.
        defrag_wait_s: a large single-node job that has waited this long, seconds, with no
            drain expected within ``defrag_drain_horizon_s``, may displace the cheapest set
            of small preemptible jobs that frees its GPUs on one node (``Preempt`` reason
            ``defragment``); None = never. Needs ``preemption`` and a snapshot with
            ``recent_displacements``.
        defrag_drain_horizon_s: a drain expected within this many seconds makes
            defragmentation unnecessary (the job waits for it).
        displacement_budget_share: defragmentation may lose at most this many GPU-hours of
            work per hour per GPU of the fleet (0.05 on 704 GPUs = 35 GPU-hours per hour),
            counted over ``ClusterSnapshot.recent_displacements`` of the last hour.
        anti_thrash_s: a job displaced (for any reason) within this many seconds is never a
            defragmentation victim.
        defrag_migrate: defragmentation may also displace small jobs of teams inside their
            guarantee when the GPUs free elsewhere (on nodes without a reservation or shield)
            can hold them at once: a move, not a reclaim (``policy.defrag``); False = only
            the preemptor's own team's, borrowed, or (preemptor within its guarantee) any.
        preemption_waste_gpu_h: fleet-wide cap on the work preemption may lose (GPU-hours
            since the victims' last checkpoints) per ``preemption_waste_window_s``; None =
            unlimited (``policy.waste``; teams' own caps come with the snapshot).
        preemption_waste_window_s: the fleet cap's rolling window, seconds.
        srpt_weight: shortest-predicted-remaining-first inside a team's queue
            (``policy.ordering``): a job is ordered as if queued ``srpt_weight`` x its
            predicted remaining time (capped at ``srpt_cap_s``) later; 0 = off (queue time
            and priority aging only).
        srpt_cap_s: the largest shift ``srpt_weight`` may give, seconds (the starvation
            bound: a job is passed only by jobs queued within this long after it).
        large_reservations: besides each team's head and the fleet's head of each size,
            the first this many blocked *large* jobs of a pass (``large_job_node_share``)
            get a backfill reservation (EASY only); 0 = off.
        max_preemptions_per_job: a job displaced this many times (any reason) within
            ``preemption_window_s`` is no longer a preemption victim; None = no cap.
        preemption_window_s: the window of that cap, seconds (drivers keep the
            displacements of ``ordering.displacement_window_s``, which covers it).
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
    nodes_per_reservation: int = 4
    headroom_wait_s: float | None = 1800.0
    large_job_node_share: float = 0.5
    headroom_max_node_share: float = 0.1
    defrag_wait_s: float | None = 3600.0
    defrag_drain_horizon_s: float = 1800.0
    displacement_budget_share: float = 0.05
    anti_thrash_s: float = 6 * 3600.0
    defrag_migrate: bool = True
    preemption_waste_gpu_h: float | None = None
    preemption_waste_window_s: float = 24 * 3600.0
    srpt_weight: float = 0.0
    srpt_cap_s: float = 4 * 3600.0
    large_reservations: int = 0
    max_preemptions_per_job: int | None = None
    preemption_window_s: float = 6 * 3600.0
