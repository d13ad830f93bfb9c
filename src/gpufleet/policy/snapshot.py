"""What the policy sees: an immutable snapshot of teams, nodes, running and pending work.

Built by ``store.queries.load_snapshot`` in the live system and by ``sim`` from its in-memory
fleet. All times are seconds (float) on the snapshot's own clock (``now_s``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from gpufleet.domain.types import PriorityClass, Resources

if TYPE_CHECKING:
    from gpufleet.policy.fleet_index import FleetIndex
    from gpufleet.policy.waste import WasteState


@dataclass(frozen=True, slots=True)
class TeamState:
    """One team's entitlement and usage.

    Attributes:
        team_id: the team.
        weight: relative share for weighted DRF, float > 0.
        guaranteed_gpus: GPUs guaranteed per GPU type (``{"H100": 16}``).
        borrow_limit_gpus: how many GPUs above its guarantee the team may borrow from idle
            capacity; None means unlimited.
        lending_limit_gpus: per GPU type, the part of the guarantee never lent to others
            (``nominalQuota - lendingLimit`` in Kueue's terms: the store converts the
            team's Kueue-style ``lendingLimit`` into this); empty means all of it may be lent.
        usage_gpu_s: charged usage in GPU-seconds, decayed with ``policy.usage`` (closed
            attempts plus the elapsed part of running ones); used to break ties between teams
            whose current dominant shares are equal (see docs/design/scheduling-policy.md).
    """

    team_id: str
    weight: float = 1.0
    guaranteed_gpus: Mapping[str, int] = field(default_factory=dict)
    borrow_limit_gpus: int | None = None
    lending_limit_gpus: Mapping[str, int] = field(default_factory=dict)
    usage_gpu_s: float = 0.0
    allocated_gpus: Mapping[str, int] | None = None
    """Optional: GPUs per type this team's attempts hold now (RESERVED, CONFIRMED and
    stopping). When set for every team, the pass trusts it instead of summing ``running``
    (a GROUP BY in the live store, a counter in the simulator)."""
    allocated_cpu: float = 0.0
    allocated_memory_mb: int = 0


@dataclass(frozen=True, slots=True)
class NodeState:
    """Free capacity of one node.

    Attributes:
        schedulable: HEALTHY and not cordoned/draining/fenced; unschedulable nodes still
            count for "could this job ever fit" but receive no placements.
        images: container images the node holds (normalized references, see
            ``domain.images``); placement prefers them among equally good nodes (DD9).
        silent_since_s: for a SUSPECT node (silent: its heartbeats stopped), its last
            heartbeat; None otherwise. Only waiting reasons read it (``policy.explain``).
        fence_at_s: for a SUSPECT node, when the failure detector fences its attempts (its
            last heartbeat + the fence timeout; the GPUs they hold are QUARANTINED then, not
            freed); None when unknown or not SUSPECT.
    """

    node_id: str
    gpu_type: str
    gpu_memory_mb: int
    total_gpus: int
    free_gpus: int
    cpu_total: float = 0.0
    cpu_free: float = 0.0
    memory_total_mb: int = 0
    memory_free_mb: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)
    schedulable: bool = True
    status: str = "HEALTHY"
    images: frozenset[str] = frozenset()
    silent_since_s: float | None = None
    fence_at_s: float | None = None
    gpu_sharing: str = "none"
    """Whether and how its GPUs may be shared (``domain.types.GpuSharing``): ``none`` gives
    shares (``Resources.gpu_fraction``) no place here (``policy.shares``)."""


@dataclass(frozen=True, slots=True)
class PendingJob:
    """A job waiting for placement (status PENDING, no cancel requested)."""

    job_id: str
    team_id: str
    priority: PriorityClass
    submitted_at_s: float
    resources: Resources
    expected_duration_s: float | None = None
    max_runtime_s: float | None = None
    node_selector: Mapping[str, str] = field(default_factory=dict)
    preemptible: bool = True
    attempt: int = 0
    """How many attempts this job already had (0 for a fresh job)."""
    queued_at_s: float | None = None
    """When the job (re-)entered the queue; None means ``submitted_at_s``."""
    image: str | None = None
    """The job's container image (normalized), or None for a host-process job."""
    predicted_duration_s: float | None = None
    """The platform's own estimate of the run time (``policy.predictor``), seconds; used for
    ordering and backfill when the user gave no ``expected_duration_s``, never for killing."""
    avoid_node_id: str | None = None
    """The node its last attempt failed to start on (whoever's fault): a soft anti-affinity,
    placement takes another node that fits and this one only when none does (single-node
    placement; a gang's members are placed without it)."""


@dataclass(frozen=True, slots=True)
class RunningJob:
    """An attempt holding GPUs (reservation RESERVED or CONFIRMED)."""

    run_id: str
    job_id: str
    team_id: str
    node_id: str
    priority: PriorityClass
    gpu_count: int
    gpu_type: str
    started_at_s: float
    cpu: float = 0.0
    memory_mb: int = 0
    expected_duration_s: float | None = None
    max_runtime_s: float | None = None
    preemptible: bool = True
    last_checkpoint_s: float | None = None
    handshake_saves_s: float = 0.0
    """Seconds of the stop grace a stop of this attempt is expected *not* to wait, because its
    job signals its checkpoint (the checkpoint handshake, ``$GPUFLEET_CHECKPOINT_DONE``): the
    ``grace_s - signal_after_s`` of its job's latest ``checkpoint_handshake`` event, when that
    stop was signalled; 0 when its job never stopped that way (a stop then waits the whole
    grace). Its expected stop time is therefore ``signal_after_s`` instead of the grace; the
    victim cost (``policy.preemption.victim_cost_gpu_s``) reads it."""
    predicted_duration_s: float | None = None
    """The platform's estimate (``policy.predictor``), seconds; used when the user gave no
    ``expected_duration_s``, capped by ``max_runtime_s``."""
    stopping: bool = False
    """True while PREEMPTING: its GPUs free up soon, but are not free yet."""
    stopping_for_job_id: str | None = None
    """The preemptor this attempt is being stopped for, if any."""
    rank: int = 0
    """This member's rank in its gang (0 for a single-node job)."""
    gang_size: int = 1
    """Members of the attempt; > 1 means a gang whose members share ``job_id`` and are
    preempted, charged and reclaimed as one unit."""
    gpu_milli: int = 0
    """A share of one GPU (``gpu_count`` 1): its part, thousandths; 0: whole GPUs."""
    gpu_index: int | None = None
    """A share's GPU on its node (what ``policy.shares`` sums per GPU); None otherwise."""
    queued_at_s: float | None = None
    """The job's place in the queue, seconds (``PendingJob.queued_at_s``: its submit time,
    or when a failed attempt queued it again; a preempted job keeps its place): the priority
    ground displaces only attempts its preemptor precedes in the queue (``policy.preemption``).
    None: unknown, no such check."""

    @property
    def gpus(self) -> float:
        """GPUs it holds for quota, fair share and accounting: a share's fraction, else
        ``gpu_count`` (an int then: whole-GPU arithmetic and messages stay integral)."""
        return self.gpu_milli / 1000 if self.gpu_milli else self.gpu_count


@dataclass(frozen=True, slots=True)
class GpuHold:
    """GPUs of one node promised to one pending job after a ``Preempt`` decision (a gang
    preemptor may hold GPUs on several nodes: one hold per (job_id, node_id)).

    The driver records a hold when it applies a Preempt and deletes it when the job is placed,
    leaves the queue, or the policy lists it in ``CycleResult.released_holds``. While a hold
    lives, up to ``gpu_count`` free GPUs of ``node_id`` are visible to ``job_id`` only.
    """

    job_id: str
    node_id: str
    gpu_count: int
    since_s: float
    reason: str = "reclaim"


@dataclass(frozen=True, slots=True)
class BackfillReservation:
    """A reservation made by an earlier pass (the fields of ``HoldForBackfill``), or, with
    ``headroom``, a DD7 headroom shield of an earlier pass (``CycleResult.shields``): the
    next pass keeps a shield on its node(s) unless another is ready much earlier
    (``policy.defrag``)."""

    job_id: str
    node_id: str
    gpu_count: int
    start_at_s: float
    headroom: bool = False


@dataclass(frozen=True, slots=True)
class Displacement:
    """A job stopped by a preemption recently (what the displacement budget and the
    anti-thrash window of ``policy.defrag`` read).

    Attributes:
        job_id: the displaced job.
        at_s: when its attempt was told to stop (snapshot clock, seconds).
        gpu_hours: work lost, GPU-hours: GPUs x time since the attempt's last checkpoint
            (or its start).
        reason: the ``Preempt`` reason (``defragment``, ``reclaim``, ``priority``); only
            ``defragment`` counts against the budget, every reason against re-displacement.
    """

    job_id: str
    at_s: float
    gpu_hours: float
    reason: str = "defragment"


@dataclass(frozen=True, slots=True)
class ClusterSnapshot:
    now_s: float
    nodes: tuple[NodeState, ...]
    pending: tuple[PendingJob, ...]
    running: tuple[RunningJob, ...] = ()
    teams: Mapping[str, TeamState] = field(default_factory=dict)
    holds: tuple[GpuHold, ...] = ()
    reservations: tuple[BackfillReservation, ...] = ()
    """The ``HoldForBackfill`` decisions of the previous pass, fed back by the driver: a
    reservation, once made, is kept on its node (its time recomputed) until the job starts,
    so jobs served earlier in later passes cannot push it back. The previous pass's
    ``CycleResult.shields`` (``headroom`` True) ride along, so a headroom shield stays on
    its node(s) the same way (``policy.defrag``)."""
    queues: Mapping[str, Sequence[PendingJob]] | None = None
    """Optional fast path for drivers that keep their queues sorted: pending jobs grouped by
    team, each sequence already sorted by ``policy.priority.queue_key(config)``. When set, it
    replaces ``pending`` (which is then ignored) and the pass does not sort; jobs the pass
    never reaches cost nothing."""
    recent_displacements: tuple[Displacement, ...] | None = None
    """Preemptions of the last ``max(1 h, PolicyConfig.anti_thrash_s)`` (older entries are
    ignored): the state that lets a pure pass keep a per-hour displacement budget and an
    anti-thrash window (``policy.defrag``). None means the driver does not track them, and
    then the pass never defragments (headroom still applies): without this state the budget
    and the anti-thrash window could not hold. The simulator keeps them in memory; the live
    store reads them from ``job_runs`` (``store.queries.recent_displacements``)."""
    preemption_waste: WasteState | None = None
    """The preemption waste caps' state (``policy.waste``): the work lost to recent
    preemptions, per victim team, and the teams' caps. Drivers give it whenever a cap is set
    (a team's, or the fleet's ``PolicyConfig.preemption_waste_gpu_h``); None: no cap is
    (a fleet cap without it would count only the pass's own preemptions)."""
    fleet_index: FleetIndex | None = None
    """Optional fast path for drivers that keep their node states between passes (the
    simulator): a ``policy.fleet_index.FleetIndex`` describing exactly ``nodes``, kept up to
    date with ``FleetIndex.update`` as nodes change. The pass copies its free lists instead
    of indexing every node again; decisions are the same as without it."""
