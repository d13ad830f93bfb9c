"""What the policy returns: decisions to apply, and a reason for every job left waiting."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpufleet.policy.snapshot import BackfillReservation


@dataclass(frozen=True, slots=True)
class Place:
    """Reserve ``gpu_count`` GPUs of ``node_id`` for ``job_id`` (one atomic reservation);
    with ``gpu_milli`` a share of one GPU of the node instead (``policy.shares``: the
    fullest GPU with room, else a free one; ``gpu_count`` is 1)."""

    job_id: str
    node_id: str
    gpu_count: int
    backfilled: bool = False
    gpu_milli: int = 0


@dataclass(frozen=True, slots=True)
class GangMember:
    """One member of a gang placement: ``gpu_count`` GPUs of ``node_id`` run rank ``rank``."""

    rank: int
    node_id: str
    gpu_count: int


@dataclass(frozen=True, slots=True)
class PlaceGang:
    """Reserve every member of a multi-node job or none (one transaction, node rows locked in
    node-id order, one fencing token shared by all members). Ranks are 0..n-1; rank 0's node
    hosts ``MASTER_ADDR``."""

    job_id: str
    members: tuple[GangMember, ...]
    backfilled: bool = False


@dataclass(frozen=True, slots=True)
class Preempt:
    """Stop ``victim_run_ids`` on ``node_id`` (through the cancel path) so that ``for_job_id``
    can be placed there; the freed GPUs are held for it."""

    for_job_id: str
    node_id: str
    victim_run_ids: tuple[str, ...]
    """Every run of each victim; a gang victim lists all its members, on any node (a gang is
    stopped as one unit)."""
    reason: str  # "reclaim" (a team takes back its guarantee), "priority" or "srtf" (baseline)
    gpu_count: int = 0
    """GPUs to hold on ``node_id`` for ``for_job_id`` once the victims are gone."""


@dataclass(frozen=True, slots=True)
class HoldForBackfill:
    """GPUs of ``node_id`` are held for ``job_id`` from ``start_at_s``; later jobs may only use
    them if they end before that. A gang gets one per member node (same ``job_id``)."""

    job_id: str
    node_id: str
    gpu_count: int
    start_at_s: float


Decision = Place | PlaceGang | Preempt | HoldForBackfill


@dataclass(frozen=True, slots=True)
class WaitReason:
    """Why a job still waits.

    Attributes:
        code: stable machine-readable code (e.g. ``no_node_fits_now``, ``never_fits``,
            ``team_over_share``, ``held_for_backfill``, ``waiting_for_preemption``).
        message: one sentence a user understands.
        details: structured facts (largest free block vs needed, team served instead, ...).
        position: 1-based position in its team's queue, if known.
        estimated_start_s: when backfill computes one (snapshot clock), else None.
    """

    code: str
    message: str
    details: Mapping[str, Any] = field(default_factory=dict)
    position: int | None = None
    estimated_start_s: float | None = None


@dataclass(frozen=True, slots=True)
class CycleResult:
    """Output of one pass.

    Attributes:
        decisions: in the order to apply them.
        waiting: a reason for every pending job not placed (may be computed lazily on access).
        released_holds: job ids whose ``GpuHold`` the driver should delete (timed out, or
            the node can no longer take the job).
        shields: the DD7 headroom shields of the jobs still waiting after the pass (one per
            node, ``headroom`` True; ``policy.defrag``): not decisions (nothing to apply),
            state the driver feeds back in the next ``ClusterSnapshot.reservations`` beside
            the ``HoldForBackfill`` decisions, so a shield stays on its node.
    """

    decisions: tuple[Decision, ...]
    waiting: Mapping[str, WaitReason] = field(default_factory=dict)
    released_holds: tuple[str, ...] = ()
    shields: tuple[BackfillReservation, ...] = ()
