"""The state of one scheduling pass and the bookkeeping of its decisions.

Phase 0 of ``cycle`` (docs/design/scheduling-policy.md): ``PassState`` indexes the snapshot
(free capacity by GPU type, allocation per team, sorted queues), drops dead holds and reads
back the previous pass's reservations and shields. Its methods record what a decision
changes (a placement, a gang placement, a gang reservation: the free index, the team book,
the decisions, the causes) and answer the questions every phase asks (is a request a gang,
its members, whether a start rests on predictions). ``cycle._Pass`` adds the phases.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gpufleet.domain.types import Resources
from gpufleet.policy.backfill import extra_at
from gpufleet.policy.config import Ordering, PolicyConfig
from gpufleet.policy.decisions import Decision, GangMember, HoldForBackfill, Place, PlaceGang
from gpufleet.policy.explain import Cause
from gpufleet.policy.gang import Members, explicit_gang, gang_members, member_resources
from gpufleet.policy.headroom import Shielded
from gpufleet.policy.ordering import capped_jobs
from gpufleet.policy.placement import FreeIndex, Shadow
from gpufleet.policy.preemption import VictimSearch
from gpufleet.policy.priority import queue_key, sorted_queues
from gpufleet.policy.quota import OVER_BORROW_LIMIT, TEAM_AT_GUARANTEE, TeamBook
from gpufleet.policy.runtime import RunningIndex
from gpufleet.policy.shares import ShareBook, SharePick
from gpufleet.policy.snapshot import (
    BackfillReservation,
    ClusterSnapshot,
    GpuHold,
    NodeState,
    PendingJob,
    RunningJob,
)
from gpufleet.policy.waste import victim_search

__all__ = ["PassState"]


def _find_jobs(
    queues: Mapping[str, Sequence[PendingJob]], want: set[str]
) -> dict[str, PendingJob]:
    if not want:
        return {}
    return {j.job_id: j for q in queues.values() for j in q if j.job_id in want}


def _live_holds(
    snapshot: ClusterSnapshot, jobs: Mapping[str, PendingJob], cfg: PolicyConfig
) -> tuple[list[tuple[GpuHold, PendingJob]], list[str]]:
    if not snapshot.holds:
        return [], []
    nodes: Mapping[str, NodeState] = (
        snapshot.fleet_index.nodes
        if snapshot.fleet_index is not None
        else {n.node_id: n for n in snapshot.nodes}
    )
    live: list[tuple[GpuHold, PendingJob]] = []
    released: list[str] = []
    seen: set[str] = set()
    for h in sorted(snapshot.holds, key=lambda h: (h.since_s, h.job_id)):
        job = jobs.get(h.job_id)
        node = nodes.get(h.node_id)
        dead = (
            job is None
            or node is None
            or not node.schedulable
            or snapshot.now_s - h.since_s > cfg.hold_timeout_s
            or h.node_id in seen
        )
        if dead or job is None:
            released.append(h.job_id)
            continue
        seen.add(h.node_id)
        live.append((h, job))
    if released and live:
        # a gang preemptor holds GPUs on several nodes: one dead hold releases them all
        gone = set(released)
        live = [(h, j) for h, j in live if h.job_id not in gone]
    return live, sorted(set(released))


class PassState:
    """Mutable state of one pass (the snapshot stays frozen)."""

    def __init__(self, snapshot: ClusterSnapshot, cfg: PolicyConfig) -> None:
        self.snap = snapshot
        self.cfg = cfg
        self.now = snapshot.now_s
        self.queues: Mapping[str, Sequence[PendingJob]] = (
            snapshot.queues
            if snapshot.queues is not None
            else sorted_queues(snapshot.pending, cfg)
        )
        jobs = _find_jobs(
            self.queues,
            {h.job_id for h in snapshot.holds} | {r.job_id for r in snapshot.reservations},
        )
        self.holds, self.released = _live_holds(snapshot, jobs, cfg)
        self.prev_reservations: list[tuple[BackfillReservation, PendingJob]] = [
            (r, jobs[r.job_id])
            for r in sorted(snapshot.reservations, key=lambda r: (r.start_at_s, r.job_id))
            if r.job_id in jobs and not r.headroom
        ]
        shields: dict[str, list[str]] = {}
        for r in snapshot.reservations:
            if r.headroom:
                shields.setdefault(r.job_id, []).append(r.node_id)
        self.prev_shields: Mapping[str, Sequence[str]] = shields
        """DD7 shields of the previous pass, ``job_id -> node ids`` (member order): kept by
        ``policy.defrag`` unless another node is ready much earlier."""
        self.index = FreeIndex(snapshot.nodes, (h for h, _ in self.holds), snapshot.fleet_index)
        self.book = TeamBook(
            snapshot.teams,
            snapshot.running,
            self.index.capacity_gpus,
            self.index.capacity_cpu,
            self.index.capacity_memory_mb,
            cfg,
        )
        self.hold_nodes: dict[str, list[str]] = {}
        self.preemptors: dict[str, dict[str, tuple[PendingJob, str]]] = {}
        """Per team, the jobs waiting for their victims to stop (live holds, or a
        ``Preempt`` of this pass), with their GPU type, by job id: see ``quota_kept_for``."""
        for h, job in self.holds:
            self.hold_nodes.setdefault(h.job_id, []).append(h.node_id)
            node = self.index.nodes.get(h.node_id)
            if node is not None:
                self.preemptors.setdefault(job.team_id, {})[job.job_id] = (job, node.gpu_type)
        self._queue_key = queue_key(cfg)
        self._stopping: dict[str, list[RunningJob]] | None = None
        """Preemptor job id -> the attempts stopping for it (``stopping_for``, on first use)."""
        self._gang_kind: dict[tuple[int, tuple[str, ...]], bool] = {}
        self.gang_fail_memo: set[tuple[object, ...]] = set()
        self.decisions: list[Decision] = []
        self.placed: set[str] = set()
        self.causes: dict[str, Cause] = {}
        self.default_cause: dict[str, Cause] = {}
        self.served: dict[str, int] = {}
        self.head_done: set[str] = set()
        self.tried_after_head: dict[str, int] = {}
        self.n_places = 0
        self.n_preempts = 0
        self.n_reservations = 0
        self.max_reservations = cfg.max_reservations
        if cfg.nodes_per_reservation > 0:
            self.max_reservations = max(
                cfg.max_reservations, self.index.n_schedulable // cfg.nodes_per_reservation
            )
        self.reserved_sizes: set[int] = set()
        """GPU counts of the jobs holding a reservation in this pass: a later blocked job
        gets one too when no job of its size holds one (the fleet's head job of a size)."""
        self._running: RunningIndex | None = None
        self._victims: VictimSearch | None = None
        self._shares: ShareBook | None = None
        self._shareable: dict[str, list[NodeState]] | None = None
        self.share_fail_memo: dict[tuple[object, ...], int] = {}
        self.share_node_memo: dict[tuple[object, ...], list[NodeState]] = {}
        """Per share shape, the shareable nodes its static filter accepts (``share_nodes``)."""
        """Per share shape (type, memory, CPU, memory, selector), the smallest share (in
        thousandths) that found no room in this pass."""
        # Smallest GPU count known not to fit now, per job shape (free only shrinks).
        self.fail_memo: dict[tuple[object, ...], int] = {}
        self.shielded = Shielded({}, {})  # DD7 headroom for large jobs (policy.defrag)

    @property
    def running(self) -> RunningIndex:
        if self._running is None:
            self._running = RunningIndex(self.snap.running, self.now, self.cfg)
        return self._running

    @property
    def shares(self) -> ShareBook:
        """The fills of the shared GPUs in this pass (``policy.shares``), on first use."""
        if self._shares is None:
            self._shares = ShareBook.of(self.snap.running)
        return self._shares

    def shareable(self, gpu_type: str) -> list[NodeState]:
        """The nodes of ``gpu_type`` whose GPUs take shares (any status), in node-id order;
        listed once per pass."""
        if self._shareable is None:
            by_type: dict[str, list[NodeState]] = {}
            for _, n in sorted(self.index.nodes.items()):
                if n.gpu_sharing != "none":
                    by_type.setdefault(n.gpu_type, []).append(n)
            self._shareable = by_type
        return self._shareable.get(gpu_type, [])

    @property
    def victims(self) -> VictimSearch:
        if self._victims is None:
            aged = self.cfg.head_start_s if self.cfg.ordering is Ordering.FAIR_SHARE else None
            # (policy.waste: capped by the preemption waste caps when any is set)
            self._victims = victim_search(
                self.running, self.book, self.now, aged, self.snap.preemption_waste, self.cfg
            )
            self._victims.capped = capped_jobs(self.snap.recent_displacements, self.now, self.cfg)
        return self._victims

    def quota_kept_for(self, job: PendingJob, gpu_type: str) -> int:
        """GPUs of ``gpu_type`` that ``job``'s team keeps in its quota for its preemptors
        that the queue serves before ``job`` and that are not placed yet (0: none). A job
        may start only where the quota would still admit them as well: otherwise a job of
        the same team served after the preemptor took the quota its victims' stop freed,
        the preemptor preempted that job in turn once its hold timed out, and so on (a
        HIGH 24-GPU gang of ``tests/sim/data/priority_gangs.yaml`` displaced the same LOW
        gang 25 times). Kueue likewise keeps an admitted workload's quota while it waits
        for its pods."""
        mine = self.preemptors.get(job.team_id)
        if not mine:
            return 0
        key = self._queue_key(job)
        return sum(
            # less its own team's victims still stopping: the book counts them until then
            max(0, other.resources.gpu_count - self._stopping_own(jid, job.team_id, t))
            for jid, (other, t) in mine.items()
            if t == gpu_type
            and jid != job.job_id
            and jid not in self.placed
            and self._queue_key(other) < key
        )

    def stopping_for(self, preemptor_id: str) -> list[RunningJob]:
        """The running attempts (gang members apiece) stopping for ``preemptor_id``."""
        if self._stopping is None:
            self._stopping = {}
            for r in self.snap.running:
                if r.stopping and r.stopping_for_job_id is not None:
                    self._stopping.setdefault(r.stopping_for_job_id, []).append(r)
        return self._stopping.get(preemptor_id, [])

    def _stopping_own(self, preemptor_id: str, team_id: str, gpu_type: str) -> int:
        """GPUs of ``gpu_type`` held by ``team_id``'s attempts stopping for ``preemptor_id``."""
        return sum(
            r.gpu_count
            for r in self.stopping_for(preemptor_id)
            if r.team_id == team_id and r.gpu_type == gpu_type
        )

    def admit(self, job: PendingJob, gpu_type: str, gpus: float, free_of_type: int) -> str | None:
        """``TeamBook.admit`` for ``job``, which must also leave its team's quota to the
        preemptors the queue serves before it (``quota_kept_for``); None or the refusal."""
        code = self.book.admit(job.team_id, gpu_type, gpus, free_of_type)
        if code is not None:
            return code
        kept = self.quota_kept_for(job, gpu_type)
        if not kept:
            return None
        # (their GPUs are being freed by their victims: not a claim on the free ones)
        code = self.book.admit(job.team_id, gpu_type, gpus + kept, free_of_type + kept)
        return code if code in (TEAM_AT_GUARANTEE, OVER_BORROW_LIMIT) else None

    def preempting(self, job: PendingJob, gpu_type: str) -> None:
        """``job`` issued a ``Preempt`` this pass: its quota is kept (``quota_kept_for``)."""
        self.preemptors.setdefault(job.team_id, {})[job.job_id] = (job, gpu_type)

    def is_gang(self, res: Resources) -> bool:
        """A multi-node request: explicit, or no acceptable type has a node big enough."""
        if res.nodes is not None or res.gpus_per_node is not None:
            return explicit_gang(res)
        key = (res.gpu_count, res.gpu_types)
        hit = self._gang_kind.get(key)
        if hit is None:
            sizes = [self.index.node_gpus(t) for t in (res.gpu_types or self.index.all_types())]
            hit = self._gang_kind[key] = (
                bool(sizes) and max(sizes) > 0 and (res.gpu_count > max(sizes))
            )
        return hit

    def members(self, res: Resources, gpu_type: str) -> Members | None:
        return gang_members(res, self.index.node_gpus(gpu_type))

    def _place(self, job: PendingJob, node_id: str, gpu_type: str, backfilled: bool) -> None:
        res = job.resources
        hard_end = self.now + job.max_runtime_s if job.max_runtime_s is not None else None
        self.index.take(node_id, res, job.job_id, hard_end)
        self.book.charge(job.team_id, gpu_type, res.gpu_count, res.cpu, res.memory_mb)
        self.decisions.append(Place(job.job_id, node_id, res.gpu_count, backfilled))
        self.placed.add(job.job_id)
        if job.job_id in self.shielded.nodes:  # DD7 headroom (policy.defrag)
            self.shielded.release(self.index, job.job_id)
        self.served[job.team_id] = self.served.get(job.team_id, 0) + res.gpu_count
        self.n_places += 1

    def _place_share(self, job: PendingJob, pick: SharePick, gpu_type: str) -> None:
        """``job`` (a share) placed at ``pick``: a GPU opened for shares leaves the free
        index (it is no whole GPU any more); the team is charged its fraction."""
        res = job.resources
        if pick.gpu_key is None:
            hard_end = self.now + job.max_runtime_s if job.max_runtime_s is not None else None
            self.index.take(pick.node_id, res, job.job_id, hard_end)
        self.shares.add(pick, res.gpu_milli)
        self.book.charge(job.team_id, gpu_type, res.gpus, res.cpu, res.memory_mb)
        self.decisions.append(
            Place(job.job_id, pick.node_id, 1, self.n_reservations > 0, res.gpu_milli)
        )
        self.placed.add(job.job_id)
        self.n_places += 1

    def _place_gang(
        self,
        job: PendingJob,
        gpu_type: str,
        members: Members,
        nodes: tuple[str, ...],
        hard_end: float | None,
    ) -> None:
        res = job.resources
        out: list[GangMember] = []
        for rank, (m, nid) in enumerate(zip(members, nodes, strict=True)):
            self.index.take(nid, member_resources(res, m), job.job_id, hard_end)
            out.append(GangMember(rank, nid, m))
        k = len(members)
        self.book.charge(job.team_id, gpu_type, res.gpu_count, res.cpu * k, res.memory_mb * k)
        self.decisions.append(PlaceGang(job.job_id, tuple(out), self.n_reservations > 0))
        self.placed.add(job.job_id)
        if job.job_id in self.shielded.nodes:  # DD7 headroom (policy.defrag)
            self.shielded.release(self.index, job.job_id)
        self.served[job.team_id] = self.served.get(job.team_id, 0) + res.gpu_count
        self.n_places += 1

    def _hold_gang(self, job: PendingJob, nodes: list[tuple[str, int]], start: float) -> None:
        index = self.index
        ready = 0
        for nid, m in nodes:
            extra = extra_at(job, nid, m, start, index, self.running)
            index.add_shadow(nid, Shadow(job.job_id, start, m, extra))
            self.decisions.append(HoldForBackfill(job.job_id, nid, m, start))
            held = index.held_node_for(job.job_id, nid)
            if (held.free_gpus if held is not None else index.visible_free(nid)) >= m:
                ready += 1
        self.n_reservations += 1
        self.reserved_sizes.add(job.resources.gpu_count)
        held_ids = tuple(nid for nid, _ in nodes)
        self.causes[job.job_id] = (
            "gang_reservation",
            held_ids,
            start,
            len(nodes),
            ready,
            self.predicted_start(held_ids, start),
        )
        self.head_done.add(job.team_id)

    def predicted_start(self, node_ids: Sequence[str], start_s: float) -> bool:
        """Whether a reservation's start rests on the platform's predictions: some attempt
        counted on to end by ``start_s`` has no user estimate but a predicted duration."""
        for nid in node_ids:
            for end, r in self.running.by_node.get(nid, ()):
                if end > start_s:
                    break
                if r.expected_duration_s is None and r.predicted_duration_s is not None:
                    return True
        return False
