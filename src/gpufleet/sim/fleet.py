"""The in-memory fleet: nodes with per-GPU holders, jobs, attempts and reservations.

Every status change goes through ``domain.states.check_transition`` (the same tables the
store enforces), and ``invariant_view`` builds the same ``InvariantView`` the admin check
builds from the database, so ``domain.invariants.check_invariants`` judges both.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

from gpufleet.domain.invariants import InvariantView, JobView, NodeView, ReservationView, RunView
from gpufleet.domain.states import (
    JobStatus,
    Machine,
    NodeStatus,
    ReservationStatus,
    RunStatus,
    check_transition,
)
from gpufleet.domain.types import PriorityClass, Resources
from gpufleet.policy.fleet_index import FleetIndex
from gpufleet.policy.snapshot import NodeState, PendingJob, RunningJob
from gpufleet.sim.model import NodeGroup, SimJob


@dataclass(slots=True)
class SimNode:
    node_id: str
    gpu_type: str
    gpu_memory_mb: int
    total: int
    cpu_total: float
    memory_total_mb: int
    labels: dict[str, str]
    holders: list[str | None]
    free: int
    cpu_used: float = 0.0
    memory_used_mb: int = 0
    status: NodeStatus = NodeStatus.HEALTHY
    _state: NodeState | None = None

    def state(self) -> NodeState:
        if self._state is None:
            self._state = NodeState(
                node_id=self.node_id,
                gpu_type=self.gpu_type,
                gpu_memory_mb=self.gpu_memory_mb,
                total_gpus=self.total,
                free_gpus=self.free,
                cpu_total=self.cpu_total,
                cpu_free=self.cpu_total - self.cpu_used,
                memory_total_mb=self.memory_total_mb,
                memory_free_mb=self.memory_total_mb - self.memory_used_mb,
                labels=self.labels,
                schedulable=self.status is NodeStatus.HEALTHY,
                status=self.status.value,
            )
        return self._state


@dataclass(frozen=True, slots=True)
class SimMember:
    """One member of an attempt: ``gpu_ids`` of ``node_id`` run rank ``rank``. ``run_id`` is
    the member's own run (the attempt's run id for rank 0, ``<run_id>-<rank>`` for the others),
    as the live store keeps one job_runs row per member under one token."""

    rank: int
    node_id: str
    gpu_ids: tuple[int, ...]
    run_id: str


@dataclass(slots=True)
class SimRun:
    """One attempt. A single-node attempt has one member; a gang attempt has one member per
    node, all under the attempt's one run id and token (reserved, confirmed, stopped and
    released together). ``node_id``/``gpu_ids`` are rank 0's."""

    run_id: str
    job_id: str
    team_id: str
    node_id: str
    gpu_ids: tuple[int, ...]
    gpu_type: str
    token: int
    reserved_s: float
    work_before_s: float
    """Work the job had already banked (checkpointed) when this attempt started."""
    status: RunStatus = RunStatus.ASSIGNED
    res_status: ReservationStatus = ReservationStatus.RESERVED
    stopping_for: str | None = None
    released_s: float | None = None
    state: tuple[RunningJob, ...] | None = None
    members: tuple[SimMember, ...] = ()
    predicted_s: float | None = None
    """The platform's prediction of this attempt's run time when it started (None: none)."""
    priority: PriorityClass | None = None
    """The class the attempt was placed at when a team limit demoted it (``policy.limits``;
    None: its job's class): what its GPU-time is charged to and what preemption sees."""
    borrowed: bool = False
    """The placement borrowed: it took its team above its guarantee on ``gpu_type`` (the
    engine sets it from the team's allocation before the start, as ``TeamBook.admit``
    counts a loan)."""

    @property
    def gpus(self) -> int:
        return sum(len(m.gpu_ids) for m in self.members)


@dataclass(slots=True)
class SimJobState:
    spec: SimJob
    status: JobStatus = JobStatus.PENDING
    current_run_id: str | None = None
    epoch: int = 0
    banked_s: float = 0.0
    """Work done and checkpointed (kept across preemptions and failures)."""
    failures_left: int = 0
    queued_at_s: float | None = None
    pending_since_s: float = 0.0
    wait_total_s: float = 0.0
    first_start_s: float | None = None
    first_start_borrowed: bool | None = None
    """Whether the first attempt's placement borrowed (``SimRun.borrowed``); None: never ran."""
    gang: bool = False
    """Whether the job ran as a multi-node gang (its first attempt had more than one member)."""
    end_s: float | None = None
    preemptions: int = 0
    lost_gpu_s: float = 0.0
    preempt_lost_gpu_s: float = 0.0
    held_gpu_s: float = 0.0
    held_s: float = 0.0
    """Time PENDING while held by a dependency or its array's ``%N`` limit (not eligible:
    not queue delay, not backlog)."""
    timed_out: bool = False
    """An attempt ran past ``max_runtime_s`` and was stopped: the job ended FAILED
    (``TIMEOUT``), as the live system ends it (timeouts are not retried)."""
    runs: list[str] = field(default_factory=list)
    pending: PendingJob | None = None


def kept_work(elapsed_s: float, checkpoint_s: float | None) -> float:
    if checkpoint_s is None or checkpoint_s <= 0:
        return 0.0
    return math.floor(elapsed_s / checkpoint_s) * checkpoint_s


class InMemoryFleet:
    """State of the simulated cluster. Mutated only by the engine through these methods."""

    def __init__(self, groups: list[NodeGroup]) -> None:
        self.nodes: dict[str, SimNode] = {}
        for g in groups:
            for i in range(g.count):
                node_id = g.name if g.count == 1 else f"{g.name}-{i:04d}"
                self.nodes[node_id] = SimNode(
                    node_id=node_id,
                    gpu_type=g.gpu_type,
                    gpu_memory_mb=g.gpu_memory_mb,
                    total=g.gpus_per_node,
                    cpu_total=g.cpu,
                    memory_total_mb=g.memory_mb,
                    labels=dict(g.labels),
                    holders=[None] * g.gpus_per_node,
                    free=g.gpus_per_node,
                )
        self.jobs: dict[str, SimJobState] = {}
        self.runs: dict[str, SimRun] = {}
        """Attempts by run id (rank 0's run id for a gang)."""
        self.member_runs: dict[str, SimRun] = {}
        """Gang attempts by the run id of a member of rank > 0."""
        self.active_runs: dict[str, SimRun] = {}
        self.touched_jobs: set[str] = set()
        self.touched_runs: set[str] = set()
        self.dirty_nodes: set[str] = set(self.nodes)
        self.running_tuple: tuple[RunningJob, ...] | None = None
        self._node_pos = {nid: i for i, nid in enumerate(self.nodes)}
        self._node_list: list[NodeState] = [n.state() for n in self.nodes.values()]
        self.fleet_index = FleetIndex(self._node_list)
        """Free capacity by GPU type, kept in step by ``node_states`` (``ClusterSnapshot.
        fleet_index``: a pass copies it instead of indexing every node)."""
        self._runs_on: dict[str, set[str]] = {nid: set() for nid in self.nodes}
        """Active attempts per node (by run id), for the incremental invariant view."""
        self._stale_nodes: set[str] = set()
        self._run_states: dict[str, tuple[RunningJob, ...]] = {}
        self._stale_runs: set[str] = set()
        self._run_seq = 0
        self._next_checkpoint: list[tuple[float, str]] = []
        """(time of an attempt's next checkpoint, run id): when its view goes stale."""
        self.now_s = 0.0
        """The time of the last ``running_states`` call (seconds; the views' clock)."""
        self.predict: Callable[[SimJob], float | None] | None = None
        """The engine's duration predictor (None: the scheduler is told no predictions)."""

    def _predicted(self, spec: SimJob, done_s: float) -> float | None:
        """The prediction for ``spec`` minus the work it already banked (at least 1 s)."""
        if self.predict is None:
            return None
        p = self.predict(spec)
        return max(1.0, p - done_s) if p is not None else None

    # -- jobs --------------------------------------------------------------------------
    def submit(self, spec: SimJob, now_s: float) -> SimJobState:
        js = SimJobState(spec, failures_left=spec.failures, pending_since_s=now_s)
        self.jobs[spec.job_id] = js
        self.touched_jobs.add(spec.job_id)
        return js

    def pending_view(self, js: SimJobState) -> PendingJob:
        """The policy's view of a pending job (remaining work as its estimate and bound)."""
        if js.pending is None:
            s = js.spec
            done = js.banked_s
            js.pending = PendingJob(
                job_id=s.job_id,
                team_id=s.team_id,
                priority=s.priority,
                submitted_at_s=s.submit_s,
                resources=Resources(
                    s.gpus,
                    s.gpu_types,
                    0,
                    s.cpu,
                    s.memory_mb,
                    nodes=s.nodes,
                    gpus_per_node=s.gpus_per_node,
                    allow_partial_nodes=s.allow_partial_nodes,
                ),
                expected_duration_s=(
                    max(1.0, s.expected_duration_s - done)
                    if s.expected_duration_s is not None
                    else None
                ),
                max_runtime_s=s.max_runtime_s,
                node_selector=s.node_selector,
                preemptible=s.preemptible,
                attempt=js.epoch,
                queued_at_s=js.queued_at_s,
                predicted_duration_s=self._predicted(s, done),
            )
        return js.pending

    def expire(self, job_id: str, now_s: float) -> None:
        self.end_unrun(job_id, JobStatus.EXPIRED, now_s)

    def end_unrun(self, job_id: str, to: JobStatus, now_s: float) -> None:
        """A PENDING job ends without running (EXPIRED, DEPENDENCY_FAILED)."""
        js = self.jobs[job_id]
        check_transition(Machine.JOB, js.status, to)
        js.status = to
        js.end_s = now_s
        self.touched_jobs.add(job_id)

    def run_of(self, run_id: str) -> SimRun:
        """The attempt of a run id: a single-node run, or any member of a gang."""
        run = self.runs.get(run_id)
        return run if run is not None else self.member_runs[run_id]

    # -- reserve / confirm -------------------------------------------------------------
    def reserve(self, job_id: str, node_id: str, now_s: float) -> SimRun:
        """The allocation transaction: claim free GPU ids, create attempt + reservation, job
        PENDING -> SCHEDULED. Raises if the node does not have the GPUs (a policy bug)."""
        return self.reserve_gang(job_id, ((node_id, self.jobs[job_id].spec.gpus),), now_s)

    def reserve_gang(
        self, job_id: str, members: tuple[tuple[str, int], ...], now_s: float
    ) -> SimRun:
        """The allocation transaction of a (gang) attempt: every member's GPUs or none (all
        checked before anything changes), one attempt and token, one reservation per
        member node. ``members``: ``(node_id, gpus)`` in rank order. Raises if a node lacks
        the GPUs, a node repeats, or the members do not add up to the job (a policy bug)."""
        js = self.jobs[job_id]
        spec = js.spec
        node_ids = [nid for nid, _ in members]
        if len(set(node_ids)) != len(node_ids) or sum(g for _, g in members) != spec.gpus:
            raise RuntimeError(f"policy placed {job_id} as {members}, not {spec.gpus} GPUs")
        for nid, g in members:
            node = self.nodes[nid]
            if node.status is not NodeStatus.HEALTHY or node.free < g:
                raise RuntimeError(f"policy placed {job_id} on {nid} without capacity")
        types = {self.nodes[nid].gpu_type for nid in node_ids}
        if len(types) != 1:
            raise RuntimeError(f"policy placed {job_id} across GPU types {sorted(types)}")
        check_transition(Machine.JOB, js.status, JobStatus.SCHEDULED)
        self._run_seq += 1
        js.epoch += 1
        run_id = f"r{self._run_seq:07d}"
        claimed: list[SimMember] = []
        for rank, (nid, g) in enumerate(members):
            node = self.nodes[nid]
            gpu_ids = tuple(i for i, h in enumerate(node.holders) if h is None)[:g]
            member_id = run_id if rank == 0 else f"{run_id}-{rank}"
            for i in gpu_ids:
                node.holders[i] = member_id
            node.free -= g
            node.cpu_used += spec.cpu
            node.memory_used_mb += spec.memory_mb
            node._state = None
            self._stale_nodes.add(nid)
            self.dirty_nodes.add(nid)
            claimed.append(SimMember(rank, nid, gpu_ids, member_id))
        run = SimRun(
            run_id=run_id,
            job_id=job_id,
            team_id=spec.team_id,
            node_id=claimed[0].node_id,
            gpu_ids=claimed[0].gpu_ids,
            gpu_type=types.pop(),
            token=js.epoch,
            reserved_s=now_s,
            work_before_s=js.banked_s,
            members=tuple(claimed),
            predicted_s=self._predicted(spec, js.banked_s),
        )
        js.status = JobStatus.SCHEDULED
        js.current_run_id = run.run_id
        js.runs.append(run.run_id)
        js.wait_total_s += now_s - js.pending_since_s
        js.pending = None
        if js.first_start_s is None:
            js.first_start_s = now_s
        self.runs[run.run_id] = run
        for m in run.members[1:]:
            self.member_runs[m.run_id] = run
        self.active_runs[run.run_id] = run
        for m in run.members:
            self._runs_on[m.node_id].add(run.run_id)
        self.running_tuple = None
        self._stale_runs.add(run.run_id)
        self.touched_jobs.add(job_id)
        self.touched_runs.add(run.run_id)
        return run

    def confirm(self, run: SimRun) -> None:
        """The agent confirms: ASSIGNED -> RUNNING, RESERVED -> CONFIRMED, job -> RUNNING."""
        js = self.jobs[run.job_id]
        check_transition(Machine.RUN, run.status, RunStatus.RUNNING)
        check_transition(Machine.RESERVATION, run.res_status, ReservationStatus.CONFIRMED)
        check_transition(Machine.JOB, js.status, JobStatus.RUNNING)
        run.status = RunStatus.RUNNING
        run.res_status = ReservationStatus.CONFIRMED
        js.status = JobStatus.RUNNING
        run.state = None
        self.running_tuple = None
        self._stale_runs.add(run.run_id)

    def running_view(self, run: SimRun) -> tuple[RunningJob, ...]:
        """The policy's view of an attempt: one RunningJob per member (same run id, job id
        and token; ``rank``/``gang_size`` set for a gang)."""
        if run.state is None:
            js = self.jobs[run.job_id]
            s = js.spec
            ckpt: float | None = None
            if s.checkpoint_s:
                # as the live agent reports it (the newest file in the checkpoint dir): the
                # attempt's last checkpoint so far; ``running_states`` rebuilds the view
                # when the next one is due
                ckpt = run.reserved_s + kept_work(self.now_s - run.reserved_s, s.checkpoint_s)
                heapq.heappush(self._next_checkpoint, (ckpt + s.checkpoint_s, run.run_id))
            size = len(run.members)
            run.state = tuple(
                RunningJob(
                    run_id=m.run_id,
                    job_id=run.job_id,
                    team_id=run.team_id,
                    node_id=m.node_id,
                    priority=run.priority or s.priority,
                    gpu_count=len(m.gpu_ids),
                    gpu_type=run.gpu_type,
                    started_at_s=run.reserved_s,
                    cpu=s.cpu,
                    memory_mb=s.memory_mb,
                    expected_duration_s=(
                        max(1.0, s.expected_duration_s - run.work_before_s)
                        if s.expected_duration_s is not None
                        else None
                    ),
                    max_runtime_s=s.max_runtime_s,
                    preemptible=s.preemptible,
                    last_checkpoint_s=ckpt,
                    predicted_duration_s=run.predicted_s,
                    stopping=run.status is RunStatus.PREEMPTING,
                    stopping_for_job_id=run.stopping_for,
                    rank=m.rank,
                    gang_size=size,
                    queued_at_s=js.queued_at_s if js.queued_at_s is not None else s.submit_s,
                )
                for m in run.members
            )
        return run.state

    # -- stop / finish -----------------------------------------------------------------
    def begin_stop(self, run: SimRun, for_job: str | None) -> None:
        """PREEMPTING is durable; capacity is untouched until the stop is confirmed.
        ``for_job``: the preemptor (None: a stop for no job, a timeout)."""
        check_transition(Machine.RUN, run.status, RunStatus.PREEMPTING)
        run.status = RunStatus.PREEMPTING
        run.stopping_for = for_job
        run.state = None
        self.dirty_nodes.update(m.node_id for m in run.members)
        self.running_tuple = None
        self._stale_runs.add(run.run_id)
        self.touched_runs.add(run.run_id)

    def finish(
        self, run: SimRun, outcome: RunStatus, now_s: float, timeout: bool = False
    ) -> tuple[SimJobState, bool]:
        """End an attempt (SUCCEEDED, FAILED or PREEMPTED): release its reservation and GPUs
        in one step, then move the job on. Returns (job, requeued). ``timeout``: the attempt
        (FAILED) was stopped past ``max_runtime_s``; the job ends FAILED, not retried."""
        js = self.jobs[run.job_id]
        spec = js.spec
        check_transition(Machine.RUN, run.status, outcome)
        check_transition(Machine.RESERVATION, run.res_status, ReservationStatus.RELEASED)
        run.status = outcome
        run.res_status = ReservationStatus.RELEASED
        run.released_s = now_s
        for m in run.members:  # every member at once: a gang is released as one unit
            node = self.nodes[m.node_id]
            for g in m.gpu_ids:
                node.holders[g] = None
            node.free += len(m.gpu_ids)
            node.cpu_used -= spec.cpu
            node.memory_used_mb -= spec.memory_mb
            node._state = None
            self._stale_nodes.add(m.node_id)
            self.dirty_nodes.add(m.node_id)
        del self.active_runs[run.run_id]
        for m in run.members:
            self._runs_on[m.node_id].discard(run.run_id)
        self.running_tuple = None
        self._stale_runs.add(run.run_id)
        elapsed = now_s - run.reserved_s
        js.held_gpu_s += spec.gpus * elapsed
        self.touched_jobs.add(js.spec.job_id)
        self.touched_runs.add(run.run_id)
        if outcome is RunStatus.SUCCEEDED:
            check_transition(Machine.JOB, js.status, JobStatus.SUCCEEDED)
            js.status = JobStatus.SUCCEEDED
            js.end_s = now_s
            js.banked_s = spec.duration_s
            return js, False
        kept = kept_work(elapsed, spec.checkpoint_s)
        js.lost_gpu_s += spec.gpus * (elapsed - kept)
        js.banked_s = min(spec.duration_s, js.banked_s + kept)
        if timeout:
            check_transition(Machine.JOB, js.status, JobStatus.FAILED)
            js.status = JobStatus.FAILED
            js.end_s = now_s
            js.timed_out = True
            return js, False
        check_transition(Machine.JOB, js.status, JobStatus.PENDING)
        js.status = JobStatus.PENDING
        js.pending_since_s = now_s
        js.pending = None
        if outcome is RunStatus.PREEMPTED:
            js.preempt_lost_gpu_s += spec.gpus * (elapsed - kept)
            js.preemptions += 1  # keeps its place in the queue (queued_at unchanged)
        else:
            js.failures_left -= 1
            js.queued_at_s = now_s  # a retry queues again
        return js, True

    # -- checks ------------------------------------------------------------------------
    def node_states(self) -> tuple[NodeState, ...]:
        """All nodes' states, rebuilding only those changed since the last call."""
        index = self.fleet_index
        for nid in self._stale_nodes:
            state = self.nodes[nid].state()
            self._node_list[self._node_pos[nid]] = state
            index.update(state)
        self._stale_nodes.clear()
        return tuple(self._node_list)

    def running_states(self, now_s: float) -> tuple[RunningJob, ...]:
        """Active attempts' states at ``now_s`` (seconds), rebuilding only those changed
        since the last call: started, stopped, confirmed, or checkpointed since (an attempt
        of a job with ``checkpoint_s`` shows its last checkpoint, ``last_checkpoint_s``)."""
        self.now_s = now_s
        due = self._next_checkpoint
        while due and due[0][0] <= now_s:
            _, rid = heapq.heappop(due)
            run = self.active_runs.get(rid)
            if run is not None and run.state is not None:
                run.state = None
                self._stale_runs.add(rid)
                self.running_tuple = None
        if self.running_tuple is None:
            for rid in sorted(self._stale_runs):
                run = self.active_runs.get(rid)
                if run is None:
                    self._run_states.pop(rid, None)
                else:
                    self._run_states[rid] = self.running_view(run)
            self._stale_runs.clear()
            self.running_tuple = tuple(chain.from_iterable(self._run_states.values()))
        return self.running_tuple

    def invariant_view(self, full: bool = False) -> InvariantView:
        """The InvariantView of what changed since the last check: nodes touched since then
        with every active reservation on them, and the jobs and attempts touched (an
        untouched node, job or attempt cannot have changed since it was last checked).
        ``full`` includes everything."""
        node_ids = set(self.nodes) if full else self.dirty_nodes
        on_nodes: set[str] = set()
        for nid in node_ids:
            on_nodes.update(self._runs_on[nid])
        # run ids grow with creation, so sorting them is the order of ``active_runs``
        runs = {rid: self.active_runs[rid] for rid in sorted(on_nodes)}
        for rid in self.touched_runs:
            r = self.runs[rid]
            if any(m.node_id in node_ids for m in r.members) or r.run_id not in self.active_runs:
                runs[rid] = r
        job_ids = set(self.touched_jobs) | {r.job_id for r in runs.values()}
        if full:
            job_ids |= {js.spec.job_id for js in self.jobs.values() if js.current_run_id}
        view = InvariantView(
            nodes=tuple(
                NodeView(n.node_id, n.total, n.free, dict(enumerate(n.holders)))
                for nid in sorted(node_ids)
                for n in (self.nodes[nid],)
            ),
            reservations=tuple(
                ReservationView(
                    "res-" + m.run_id,
                    m.run_id,
                    r.job_id,
                    m.node_id,
                    m.gpu_ids,
                    r.res_status,
                )
                for r in runs.values()
                for m in r.members
                if m.node_id in node_ids
            ),
            jobs=tuple(
                JobView(j, self.jobs[j].status, self.jobs[j].current_run_id, self.jobs[j].epoch)
                for j in sorted(job_ids)
            ),
            runs=tuple(
                RunView(
                    m.run_id,
                    r.job_id,
                    r.status,
                    r.token,
                    r.status is RunStatus.SUCCEEDED,
                    rank=m.rank,
                    gang_size=len(r.members),
                )
                for r in runs.values()
                for m in r.members
            ),
        )
        self.touched_jobs.clear()
        self.touched_runs.clear()
        self.dirty_nodes = set()
        return view
