"""The discrete-event loop: events on a virtual clock, one policy pass per event time.

Events at one instant are applied in a fixed order (attempt ends, stop confirmations,
arrivals; then by sequence number), the invariants are checked after each one, then
``policy.schedule`` runs once on a snapshot of the in-memory fleet and its decisions are
applied, and the invariants are checked again. Same inputs and seed, same event order, same
report: nothing reads a wall clock, and the only randomness is the seeded workload generator.

How decisions are applied (the same contract as the live controller):
  * ``Place``: the reservation step (claim GPU ids, attempt, reservation) then the agent's
    confirm, at once (a zero-latency agent); the attempt ends when its work is done, or it
    fails (``SimJob.failures``) and is retried as a new attempt.
  * ``PlaceGang``: the same for every member at once (one attempt, one token, one
    reservation per member node); the members end, fail and are stopped together.
  * ``Preempt``: victims go PREEMPTING now; their GPUs are released only when the stop is
    confirmed, ``grace_s`` later; the preemptor gets a ``GpuHold`` on the node until it is
    placed or the policy releases the hold (a gang preemptor keeps the holds of its earlier
    preemptions, as the live store does); victims are requeued keeping their place and
    checkpointed work.
  * ``max_runtime_s``: an attempt still running at its start + ``max_runtime_s`` is stopped
    as the controller's stop driver does (PREEMPTING, stop reason ``timeout``); the stop is
    confirmed ``grace_s`` later and the job ends FAILED (``TIMEOUT``), not retried.
  * ``HoldForBackfill``: remembered and fed back as ``snapshot.reservations`` next pass,
    with the pass's headroom shields (``CycleResult.shields``).
  * ``released_holds``: the holds are deleted.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from gpufleet.domain.invariants import check_invariants
from gpufleet.domain.states import JobStatus, RunStatus
from gpufleet.policy.config import Backfill, Ordering, PolicyConfig
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import HoldForBackfill, Place, PlaceGang, Preempt
from gpufleet.policy.gang import could_ever_fit, explicit_gang
from gpufleet.policy.headroom import is_large
from gpufleet.policy.limits import BudgetStatus, Demotion, TeamLimits, apply_limits
from gpufleet.policy.ordering import displacement_window_s
from gpufleet.policy.predictor import DurationPredictor, JobKey
from gpufleet.policy.priority import queue_key, queued_at
from gpufleet.policy.quota import TeamBook
from gpufleet.policy.snapshot import (
    BackfillReservation,
    ClusterSnapshot,
    Displacement,
    GpuHold,
    NodeState,
    PendingJob,
    TeamState,
)
from gpufleet.policy.usage import decay_factor, interval_gpu_s
from gpufleet.policy.waste import Waste, WasteState
from gpufleet.sim.fleet import InMemoryFleet, SimRun, kept_work
from gpufleet.sim.gating import SimGates
from gpufleet.sim.ledger import SimLedger
from gpufleet.sim.metrics import Recorder
from gpufleet.sim.model import NodeGroup, SimJob, TeamSpec

_END, _STOPPED, _TIMEOUT, _ARRIVAL, _WAKE, _REVISIT = 0, 1, 2, 3, 4, 5
REVISIT_S = 600.0
"""While a large single-node job past its defragmentation threshold waits, a pass runs at
least this often (seconds), as the live controller's periodic pass would look at it again
(its drain horizon, the displacement budget's hour and the anti-thrash window move with
time). Gangs are not revisited: defragmentation does not act for them."""
PROGRESS_EVERY_EVENTS = 2000  # how often Engine.run reports progress to its caller


class InvariantBroken(AssertionError):
    """The simulated fleet broke an invariant of ARCHITECTURE.md (a bug, never data)."""


@dataclass(frozen=True, slots=True)
class EngineOptions:
    grace_s: float = 30.0
    """Preemption: time from SIGTERM to the confirmed stop."""
    check_invariants: str = "every_event"
    """``every_event``, ``every_pass`` or ``end``."""
    sample_interval_s: float = 600.0
    partition_label: str | None = None
    """When set, each team is confined to nodes labelled ``{label: team_id}``."""
    horizon_s: float | None = None
    """Stop the clock here (jobs still running or waiting are reported as unfinished; a job
    still waiting has waited until the horizon)."""
    predict_durations: bool = False
    """Feed a ``policy.predictor.DurationPredictor`` as the live leader does: every attempt
    that succeeds is observed (its run time, keyed on team and GPU count: the traces carry
    no user or job name), and each job gets ``predicted_duration_s`` when it (re-)enters the
    queue and when an attempt starts (minus the work it banked)."""


@dataclass(slots=True)
class _TeamAcc:
    spec: TeamSpec
    alloc: dict[str, int] = field(default_factory=dict)
    gpus: int = 0
    """``sum(alloc.values())``, kept in step."""
    cpu: float = 0.0
    mem: int = 0
    usage: float = 0.0
    pending: int = 0


class Engine:
    """One simulation run."""

    def __init__(
        self,
        groups: list[NodeGroup],
        teams: Iterable[TeamSpec],
        jobs: Iterable[SimJob],
        config: PolicyConfig,
        options: EngineOptions | None = None,
        limits: Mapping[str, TeamLimits] | None = None,
    ) -> None:
        self.cfg = config
        self.limits = {t: lim for t, lim in (limits or {}).items() if not lim.empty}
        """Team limits (``policy.limits``): allowed classes, class and GPU-hour budgets."""
        self.ledger = SimLedger(self.limits)
        self._demoted: Mapping[str, Demotion] = {}
        """The last pass's demotions (the class an attempt placed in it is charged to)."""
        self.demoted_jobs: dict[str, set[str]] = {}
        """Team -> jobs that were offered demoted in at least one pass."""
        self.demoted_starts: dict[str, int] = {}
        """Team -> attempts that started demoted."""
        self.budget_held_jobs: dict[str, set[str]] = {}
        """Team -> jobs a budget held back in at least one pass."""
        self.budget_peak: dict[tuple[str, str], float] = {}
        """(team, budget key) -> the highest use seen at a pass, GPU-hours."""
        self.budget_last: dict[tuple[str, str], BudgetStatus] = {}
        self._waste_caps = {
            t: lim.preemption_waste
            for t, lim in self.limits.items()
            if lim.preemption_waste is not None
        }
        windows = [c.window_s for c in self._waste_caps.values()]
        if config.preemption_waste_gpu_h is not None:
            windows.append(config.preemption_waste_window_s)
        self._waste_window_s: float | None = max(windows) if windows else None
        """The longest preemption waste window in force (None: no cap, ``policy.waste``)."""
        self.waste: list[Waste] = []
        """Losses of the last ``_waste_window_s`` (``snapshot.preemption_waste``)."""
        self.waste_by_team: dict[str, float] = {}
        """Team -> GPU-hours of its work lost to preemption over the whole run (reported)."""
        self.opt = options or EngineOptions()
        self.fleet = InMemoryFleet(groups)
        self.predictor: DurationPredictor | None = None
        """Learned online from the run time of every attempt that succeeded; fills
        ``predicted_duration_s`` (``EngineOptions.predict_durations``, and always under the
        QSSF ordering, which sorts by it)."""
        if self.opt.predict_durations or config.ordering is Ordering.QSSF:
            self.predictor = DurationPredictor()
            self.fleet.predict = self._predict
        self.teams: dict[str, _TeamAcc] = {t.team_id: _TeamAcc(t) for t in teams}
        self.queues: dict[str, list[PendingJob]] = {}
        self._qkey = queue_key(config)
        self.holds: dict[tuple[str, str], GpuHold] = {}
        """One hold per (preemptor, node): a gang preemptor may hold GPUs on several nodes."""
        self._holds_of: dict[str, list[tuple[str, str]]] = {}
        self.reservations: tuple[BackfillReservation, ...] = ()
        self.displacements: list[Displacement] = []
        """Preemptions of the recent past (``snapshot.recent_displacements``), pruned to the
        longer of one hour and ``anti_thrash_s``."""
        self.now = 0.0
        self._events: list[tuple[float, int, int, str]] = []
        self._seq = 0
        self._live_events = 0
        """Queued events that may still change something (not wake-ups, not events of
        ended attempts): with none left, nothing runs and nothing is to arrive, so the run
        ends (as it did before wake-ups existed)."""
        self._queued: dict[tuple[int, str], int] = {}
        """Live end/stop/timeout events in the queue, by (kind, run id)."""
        self._dead: dict[tuple[int, str], int] = {}
        """Queued events of attempts that ended (``_bury``), by (kind, run id)."""
        shapes: dict[tuple[object, ...], tuple[NodeState, int]] = {}
        for n in self.fleet.nodes.values():
            key = (
                n.gpu_type,
                n.total,
                n.cpu_total,
                n.memory_total_mb,
                tuple(sorted(n.labels.items())),
            )
            first, count = shapes.get(key, (n.state(), 0))
            shapes[key] = (first, count + 1)
        self._shapes = shapes
        """Distinct node shapes and how many nodes have each (never-fits checks)."""
        self._node_gpus: dict[str, int] = {}
        """The largest node of each GPU type, GPUs (what makes a job *large*)."""
        for shape, _ in shapes.values():
            t = shape.gpu_type
            self._node_gpus[t] = max(self._node_gpus.get(t, 0), shape.total_gpus)
        self._waits = sorted(
            {w for w in (config.headroom_wait_s, config.defrag_wait_s) if w is not None}
        )
        """The waits after which time alone changes what a pass does for a large job
        (headroom, defragmentation): a pass is due then even if nothing else happens."""
        if config.backfill is not Backfill.EASY:
            self._waits = []  # headroom and defragmentation act under EASY backfill only
        self._wake_at: dict[str, float] = {}
        """The next threshold a waiting large job's wait crosses (seconds), by job id."""
        self._overdue: set[str] = set()
        """Large jobs past every threshold, pending when added (``_revisit`` prunes it)."""
        self._revisit_at = math.inf
        self._last_pass_s = -math.inf
        self._jobs_in: list[SimJob] = []
        for j in jobs:
            self._jobs_in.append(j)
            self._push(j.submit_s, _ARRIVAL, j.job_id)
        self._specs = {j.job_id: j for j in self._jobs_in}
        self.gates = SimGates(self._jobs_in)  # arrays' %N and dependencies (policy.gates)
        self.dependency_failed: list[str] = []
        self._held: tuple[str, ...] = ()
        """Jobs the last pass's gates held back (a dependency not yet satisfied, an array's
        ``%N`` limit): PENDING but not eligible until the next pass."""
        self._held_by_team: dict[str, int] = {}
        self.rejected_causes: dict[str, int] = {}
        """Jobs that could never fit, by cause (words, for warnings)."""
        if len(self._specs) != len(self._jobs_in):
            raise ValueError("job ids in a workload must be unique")
        self.total_gpus = sum(n.total for n in self.fleet.nodes.values())
        self.rec = Recorder(self.total_gpus, self.teams_entitlement())
        self.first_reservation_s: dict[str, float] = {}
        """Start time of the first backfill reservation each job got (acceptance tests)."""
        self.passes = 0
        self.gangs_placed = 0
        self.events = 0
        self.violations = 0
        self._last_t = 0.0
        self._usage_t = 0.0
        self._next_sample_i = 0
        """Index of the next sample due (``EngineOptions.sample_interval_s`` apart from 0)."""

    # -- plumbing ----------------------------------------------------------------------
    def teams_entitlement(self) -> dict[str, float]:
        """GPUs each team is entitled to (the denominator of Jain's index): its guarantee
        (all GPU types together); a team without one gets its weighted share (by ``weight``,
        among the teams without a guarantee) of the GPUs no guarantee covers, 0 when the
        guarantees cover the fleet (such a team is then left out of Jain's index)."""
        guaranteed = {
            tid: float(sum(t.spec.guaranteed_gpus.values())) for tid, t in self.teams.items()
        }
        spare = max(0.0, self.total_gpus - sum(guaranteed.values()))
        weights = {tid: t.spec.weight for tid, t in self.teams.items() if not guaranteed[tid]}
        total_w = sum(weights.values())
        return {
            tid: g if g else (spare * weights[tid] / total_w if total_w > 0 else 0.0)
            for tid, g in guaranteed.items()
        }

    def _push(self, t: float, kind: int, key: str) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, kind, self._seq, key))
        if kind < _WAKE:
            self._live_events += 1
            if kind != _ARRIVAL:
                ev = (kind, key)
                self._queued[ev] = self._queued.get(ev, 0) + 1

    def _bury(self, run_id: str) -> None:
        """The attempt ``run_id`` ended: its end, stop and timeout events still queued would
        change nothing, so they no longer count as live (``_live_events``): once only such
        events (and wake-ups) are left, the run ends (a job stopped at its ``max_runtime_s``
        of 100 s with 100,000 s of work made the run end at 100,000 s)."""
        for kind in (_END, _STOPPED, _TIMEOUT):
            n = self._queued.pop((kind, run_id), 0)
            if n:
                self._dead[(kind, run_id)] = n
                self._live_events -= n

    def _pop(self) -> tuple[float, int, str, bool]:
        """The next event and whether it is live (a dead one, ``_bury``, was already
        taken off ``_live_events``; its handler finds nothing to do, and a pass follows it
        as it did before, when it is not the last thing left)."""
        t, kind, _, key = heapq.heappop(self._events)
        if kind >= _WAKE or kind == _ARRIVAL:
            return t, kind, key, kind == _ARRIVAL
        ev = (kind, key)
        dead = self._dead.get(ev)
        if dead:
            if dead == 1:
                del self._dead[ev]
            else:
                self._dead[ev] = dead - 1
            return t, kind, key, False
        n = self._queued[ev] - 1
        if n:
            self._queued[ev] = n
        else:
            del self._queued[ev]
        return t, kind, key, True

    def _team(self, team_id: str) -> _TeamAcc:
        acc = self.teams.get(team_id)
        if acc is None:
            acc = self.teams[team_id] = _TeamAcc(TeamSpec(team_id))
            self.rec.entitlement = self.teams_entitlement()
        return acc

    def _check(self, full: bool = False) -> None:
        bad = check_invariants(self.fleet.invariant_view(full))
        if bad:
            self.violations += len(bad)
            raise InvariantBroken("; ".join(str(v) for v in bad[:5]))

    # -- queues ------------------------------------------------------------------------
    def _enqueue(self, job_id: str) -> None:
        js = self.fleet.jobs[job_id]
        pj = self.fleet.pending_view(js)
        q = self.queues.setdefault(pj.team_id, [])
        key = self._qkey(pj)
        lo, hi = 0, len(q)
        while lo < hi:  # bisect by key (PendingJob itself is not orderable)
            mid = (lo + hi) // 2
            if self._qkey(q[mid]) < key:
                lo = mid + 1
            else:
                hi = mid
        q.insert(lo, pj)
        self._team(pj.team_id).pending += 1
        if self._waits and self._large(pj):
            self._wake_after(pj, queued_at(pj))
        self.rec.pending_sizes[pj.resources.gpu_count] = (
            self.rec.pending_sizes.get(pj.resources.gpu_count, 0) + 1
        )

    def _large(self, pj: PendingJob) -> bool:
        """Whether headroom and defragmentation would consider ``pj`` (``is_large`` on the
        largest node of its GPU types)."""
        types = pj.resources.gpu_types or tuple(self._node_gpus)
        size = max((self._node_gpus.get(t, 0) for t in types), default=0)
        return is_large(pj.resources, size, self.cfg.large_job_node_share)

    def _wake_after(self, pj: PendingJob, queued_s: float) -> None:
        """Schedule a pass for when the wait of large job ``pj`` (queued at ``queued_s``)
        next crosses a threshold (``headroom_wait_s``, ``defrag_wait_s``); past them all,
        the job joins the overdue set that ``_revisit`` looks at every ``REVISIT_S``."""
        # compared as times, not waits: now - queued_s can round below a threshold that
        # queued_s + threshold (the time of this wake-up) has reached
        due = next((queued_s + w for w in self._waits if queued_s + w > self.now), None)
        if due is None:
            if self._defrag_applies(pj):
                self._overdue.add(pj.job_id)
                self._arm_revisit(self.now + REVISIT_S)
            return
        if self._wake_at.get(pj.job_id, math.inf) <= due:
            return  # one already due no later
        self._wake_at[pj.job_id] = due
        self._push(due, _WAKE, pj.job_id)

    def _defrag_applies(self, pj: PendingJob) -> bool:
        """Whether defragmentation may act for ``pj`` (a single-node job, defragmentation
        on): the time-based rules past the thresholds are defragmentation's (drain horizon,
        displacement budget, anti-thrash window); a shield only needs the crossing."""
        if self.cfg.defrag_wait_s is None or not self.cfg.preemption:
            return False
        res = pj.resources
        if res.nodes is not None or res.gpus_per_node is not None:
            return not explicit_gang(res)
        types = res.gpu_types or tuple(self._node_gpus)
        return res.gpu_count <= max((self._node_gpus.get(t, 0) for t in types), default=0)

    def _wake(self, job_id: str) -> bool:
        """A large job's wait crossed a threshold: True when a pass is due (it still waits)."""
        if self._wake_at.get(job_id) != self.now:
            return False  # superseded by an earlier one
        del self._wake_at[job_id]
        js = self.fleet.jobs[job_id]
        if js.status is not JobStatus.PENDING:
            return False
        pj = self.fleet.pending_view(js)
        self._wake_after(pj, queued_at(pj))
        return True

    def _drop_moot(self) -> bool:
        """Drop the next event if it is a wake-up that could change nothing (for a job that
        no longer waits or was superseded, a re-check with no overdue job or a pass in the
        last ``REVISIT_S``, which is armed again for later); True when one was dropped.
        Dropped before the clock moves to it, so it neither splits a stretch of samples
        nor stretches the run."""
        t, kind, _, key = self._events[0]
        if kind < _WAKE:
            return False
        if kind == _WAKE:
            if self._wake_at.get(key) == t and self.fleet.jobs[key].status is JobStatus.PENDING:
                return False
            heapq.heappop(self._events)
            if self._wake_at.get(key) == t:
                del self._wake_at[key]
            return True
        helpable = False
        if self._revisit_at == t:
            helpable = self._prune_overdue()
            if helpable and self._last_pass_s + REVISIT_S <= t:
                return False
        heapq.heappop(self._events)
        if self._revisit_at == t:
            self._revisit_at = math.inf
            if helpable:
                self._arm_revisit(self._last_pass_s + REVISIT_S)
        return True

    def _prune_overdue(self) -> bool:
        """Drop the overdue jobs that no longer wait; True when one of the rest could be
        helped by a pass: its team's quota admits it (defragmentation cannot help a job
        its quota refuses: a job held back by a borrow limit beside a 30,000,000-s job
        brought a pass every 600 s for the whole run). Re-checks stop while none could;
        the next pass an event brings arms them again (``schedule_pass``)."""
        jobs = self.fleet.jobs
        self._overdue = {j for j in self._overdue if jobs[j].status is JobStatus.PENDING}
        return any(not self._quota_refuses(jobs[j].spec) for j in sorted(self._overdue))

    def _quota_refuses(self, spec: SimJob) -> bool:
        """Whether ``spec``'s team quota refuses it on every GPU type it accepts now: the
        pass's own rule (``TeamBook.admit``) on the team's allocation, free GPUs left out
        (they are not what a re-check waits for)."""
        self._team(spec.team_id)
        book = TeamBook({spec.team_id: self._team_state(spec.team_id)}, (), {}, 0.0, 0, self.cfg)
        return all(
            book.admit(spec.team_id, t, spec.gpus, self.total_gpus + spec.gpus) is not None
            for t in spec.gpu_types or tuple(self._node_gpus)
        )

    def _arm_revisit(self, at_s: float) -> None:
        # armed even when no live event is queued at this instant: the pass that follows may
        # start attempts (the run loop ends when nothing live is left)
        if self._revisit_at <= at_s:
            return  # one due no later
        self._revisit_at = at_s
        self._push(at_s, _REVISIT, "")

    def _revisit(self) -> bool:
        """True when a pass is due: a large single-node job past its defragmentation
        threshold still waits and no pass ran in the last ``REVISIT_S``. The live
        controller passes every few seconds, so such a job is looked at again as drain
        estimates, the displacement budget and the anti-thrash window move; the simulator
        passes on events, and before these wake-ups a quiet stretch left headroom and
        defragmentation off."""
        if self._revisit_at != self.now:
            return False  # superseded by an earlier one
        self._revisit_at = math.inf
        if not self._prune_overdue():
            return False
        due = self._last_pass_s + REVISIT_S
        if due > self.now:
            self._arm_revisit(due)
            return False
        self._arm_revisit(self.now + REVISIT_S)
        return True

    def _dequeue(self, pj: PendingJob) -> None:
        q = self.queues[pj.team_id]
        key = self._qkey(pj)
        lo, hi = 0, len(q)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._qkey(q[mid]) < key:
                lo = mid + 1
            else:
                hi = mid
        if lo >= len(q) or q[lo].job_id != pj.job_id:
            raise RuntimeError(f"{pj.job_id} not in its queue")
        del q[lo]
        self._team(pj.team_id).pending -= 1
        n = self.rec.pending_sizes[pj.resources.gpu_count] - 1
        if n:
            self.rec.pending_sizes[pj.resources.gpu_count] = n
        else:
            del self.rec.pending_sizes[pj.resources.gpu_count]

    # -- time accounting ---------------------------------------------------------------
    def _advance(self, t: float) -> None:
        """Integrate usage and the time-weighted metrics over ``[last event, t)``."""
        dt = t - self._last_t
        if dt > 0:
            hl = self.cfg.usage_half_life_s
            f = decay_factor(dt, hl)
            for acc in self.teams.values():
                acc.usage = acc.usage * f + interval_gpu_s(acc.gpus, self._last_t, t, t, hl)
            held = self._held_by_team
            for job_id in self._held:
                js = self.fleet.jobs[job_id]
                if js.status is JobStatus.PENDING:
                    js.held_s += dt
            self.rec.integrate(
                self._last_t,
                t,
                {tid: a.gpus for tid, a in self.teams.items()},
                {tid for tid, a in self.teams.items() if a.pending > held.get(tid, 0)},
            )
        self._last_t = t

    def _alloc(self, run: SimRun, sign: int) -> None:
        acc = self._team(run.team_id)
        spec = self.fleet.jobs[run.job_id].spec
        k = len(run.members)  # CPU and memory are per member
        acc.alloc[run.gpu_type] = acc.alloc.get(run.gpu_type, 0) + sign * spec.gpus
        acc.gpus += sign * spec.gpus
        acc.cpu += sign * spec.cpu * k
        acc.mem += sign * spec.memory_mb * k

    # -- events ------------------------------------------------------------------------
    def _arrive(self, job_id: str) -> None:
        spec = self._specs[job_id]
        if self.opt.partition_label is not None:
            sel = dict(spec.node_selector)
            sel[self.opt.partition_label] = spec.team_id
            spec = replace(spec, node_selector=sel)
            self._specs[job_id] = spec
        self._team(spec.team_id)
        js = self.fleet.submit(spec, self.now)
        pj = self.fleet.pending_view(js)
        # a job larger than the whole fleet is refused before the policy splits it
        if pj.resources.gpu_count > self.total_gpus or not could_ever_fit(
            self._shapes.values(), pj.resources, pj.node_selector
        ):
            self.fleet.expire(job_id, self.now)
            self.rec.rejected(js)
            cause = self._never_fit_cause(spec)
            self.rejected_causes[cause] = self.rejected_causes.get(cause, 0) + 1
            return
        self._enqueue(job_id)

    def _never_fit_cause(self, spec: SimJob) -> str:
        """Why a job can never fit, in words (``rejected_causes``); a team with no nodes of
        its own under a partition first: no job of it could run, whatever its size."""
        label = self.opt.partition_label
        mine = 0
        if label is not None:
            mine = sum(
                n.total_gpus * k
                for n, k in self._shapes.values()
                if n.labels.get(label) == spec.team_id
            )
            if mine == 0:
                why = (
                    "its guarantee found no nodes left"
                    if any(self._team(spec.team_id).spec.guaranteed_gpus.values())
                    else "it has no guarantee"
                )
                return (
                    f"team {spec.team_id!r} has no nodes of its own: {why}, and this policy "
                    "runs each team only on nodes covering its guarantee"
                )
        if spec.gpus > self.total_gpus:
            return f"more GPUs than the fleet's {self.total_gpus}"
        types = {n.gpu_type for n, _ in self._shapes.values()}
        if spec.gpu_types and not types & set(spec.gpu_types):
            return "a GPU type the fleet lacks"
        if label is not None and spec.gpus > mine:
            return f"larger than its team's partition ({mine} GPUs)"
        largest = max(n.total_gpus for n, _ in self._shapes.values())
        if spec.nodes is None and spec.gpus > largest and spec.gpus % largest:
            return f"a gang of whole nodes only: {spec.gpus} GPUs on {largest}-GPU nodes"
        return "no node or set of nodes can hold it"

    def _run_end(self, run_id: str) -> None:
        run = self.fleet.runs[run_id]
        if run.status not in (RunStatus.RUNNING, RunStatus.PREEMPTING):
            return  # stale: the attempt was already stopped
        js = self.fleet.jobs[run.job_id]
        fails = js.failures_left > 0
        outcome = RunStatus.FAILED if fails else RunStatus.SUCCEEDED
        self._release(run, outcome)

    def _stopped(self, run_id: str) -> None:
        run = self.fleet.runs[run_id]
        if run.status is not RunStatus.PREEMPTING:
            return  # it completed during the grace period
        if run.stopping_for is None:  # stopped for no job: it ran past max_runtime_s
            self._release(run, RunStatus.FAILED, timeout=True)
        else:
            self._release(run, RunStatus.PREEMPTED)

    def _timeout(self, run_id: str) -> None:
        """The attempt ran past ``max_runtime_s``: stop it (the controller's stop driver,
        reason ``timeout``); the stop is confirmed ``grace_s`` later."""
        run = self.fleet.runs[run_id]
        if run.status is not RunStatus.RUNNING:
            return  # it ended, or a preemption is already stopping it
        self.fleet.begin_stop(run, None)
        self._push(self.now + self.opt.grace_s, _STOPPED, run_id)

    def _predict(self, spec: SimJob) -> float | None:
        assert self.predictor is not None
        p = self.predictor.predict(JobKey(spec.team_id, spec.gpus))
        return p.seconds if p is not None else None

    def _release(self, run: SimRun, outcome: RunStatus, timeout: bool = False) -> None:
        self._alloc(run, -1)
        if self.limits:
            js0 = self.fleet.jobs[run.job_id]
            gpus = sum(len(m.gpu_ids) for m in run.members) or len(run.gpu_ids)
            self.ledger.record(
                run.team_id,
                run.priority or js0.spec.priority,
                run.gpu_type,
                run.reserved_s,
                self.now,
                gpus,
            )
        self._bury(run.run_id)
        if self.predictor is not None and outcome is RunStatus.SUCCEEDED:
            spec = self.fleet.jobs[run.job_id].spec
            self.predictor.observe(JobKey(spec.team_id, spec.gpus), self.now - run.reserved_s)
        js, requeued = self.fleet.finish(run, outcome, self.now, timeout)
        if requeued:
            self._enqueue(js.spec.job_id)
        else:
            self.rec.finished(js)

    def _start(self, job_id: str, members: tuple[tuple[str, int], ...]) -> None:
        """Reserve and confirm every member at once (a gang starts only when all do)."""
        js = self.fleet.jobs[job_id]
        pj = self.fleet.pending_view(js)
        self._dequeue(pj)
        run = self.fleet.reserve_gang(job_id, members, self.now)
        dem = self._demoted.get(job_id)
        if dem is not None:
            run.priority = dem.effective
            self.demoted_starts[run.team_id] = self.demoted_starts.get(run.team_id, 0) + 1
        self.fleet.confirm(run)
        acc = self._team(run.team_id)
        guar = acc.spec.guaranteed_gpus.get(run.gpu_type, 0)
        run.borrowed = acc.alloc.get(run.gpu_type, 0) + js.spec.gpus > guar
        if js.first_start_borrowed is None:
            js.first_start_borrowed = run.borrowed
            js.gang = len(run.members) > 1
        self._alloc(run, +1)
        self._drop_holds(job_id)
        spec = js.spec
        remaining = max(0.0, spec.duration_s - js.banked_s)
        if js.failures_left > 0:
            remaining *= spec.fail_after_fraction
        if remaining != float("inf"):  # a job that never ends (FGD protocol) gets no end
            self._push(self.now + remaining, _END, run.run_id)
        if spec.max_runtime_s is not None and remaining > spec.max_runtime_s:
            self._push(self.now + spec.max_runtime_s, _TIMEOUT, run.run_id)

    def _drop_holds(self, job_id: str) -> None:
        for key in self._holds_of.pop(job_id, ()):
            self.holds.pop(key, None)

    def _preempt(self, d: Preempt) -> None:
        for rid in d.victim_run_ids:
            run = self.fleet.run_of(rid)  # a gang victim lists every member's run
            if run.status is RunStatus.PREEMPTING and run.stopping_for == d.for_job_id:
                continue  # another member of an attempt already being stopped
            self.fleet.begin_stop(run, d.for_job_id)  # stops every member of a gang
            self._push(self.now + self.opt.grace_s, _STOPPED, run.run_id)
            self.rec.preempted(d.reason)
            spec = self.fleet.jobs[run.job_id].spec
            elapsed = self.now - run.reserved_s
            lost_h = spec.gpus * (elapsed - kept_work(elapsed, spec.checkpoint_s)) / 3600.0
            self.displacements.append(Displacement(run.job_id, self.now, lost_h, d.reason))
            if self._waste_window_s is not None:  # the preemption waste caps (policy.waste)
                self.waste.append(Waste(spec.team_id, self.now, lost_h))
            self.waste_by_team[spec.team_id] = self.waste_by_team.get(spec.team_id, 0.0) + lost_h
        # One hold per (preemptor, node), as the live store keeps them
        # (``services.preemption.apply_preemption``): a later preemption for the same job
        # adds a hold, or updates the one on that node and keeps its age; older holds stay
        # until the job is placed or the policy releases them (``released_holds``: the
        # hold timed out, the node left, the job is gone). Dropping a gang's older holds
        # here gave the GPUs they had freed to other jobs while the gang preempted on its
        # other nodes, so it preempted again, one grace period after the other, for ever.
        key = (d.for_job_id, d.node_id)
        had = self.holds.get(key)
        since = self.now if had is None else had.since_s
        self.holds[key] = GpuHold(d.for_job_id, d.node_id, d.gpu_count or 1, since, d.reason)
        if had is None:
            self._holds_of.setdefault(d.for_job_id, []).append(key)

    def _dependency_failed(self, job_id: str, why: str) -> None:  # noqa: ARG002 - gate API
        """PENDING -> DEPENDENCY_FAILED: leaves the queue, never ran (counted as rejected)."""
        js = self.fleet.jobs[job_id]
        self._dequeue(self.fleet.pending_view(js))
        self.fleet.end_unrun(job_id, JobStatus.DEPENDENCY_FAILED, self.now)
        self.dependency_failed.append(job_id)
        self.rec.rejected(js)

    # -- the pass ----------------------------------------------------------------------
    def _team_state(self, team_id: str) -> TeamState:
        a = self.teams[team_id]
        return TeamState(
            team_id=team_id,
            weight=a.spec.weight,
            guaranteed_gpus=a.spec.guaranteed_gpus,
            borrow_limit_gpus=a.spec.borrow_limit_gpus,
            lending_limit_gpus=a.spec.lending_limit_gpus,
            usage_gpu_s=a.usage,
            allocated_gpus=dict(a.alloc),
            allocated_cpu=a.cpu,
            allocated_memory_mb=a.mem,
        )

    def snapshot(self) -> ClusterSnapshot:
        teams = {tid: self._team_state(tid) for tid in self.teams}
        return ClusterSnapshot(
            now_s=self.now,
            nodes=self.fleet.node_states(),
            pending=(),
            running=self.fleet.running_states(self.now),
            teams=teams,
            holds=tuple(self.holds.values()),
            reservations=self.reservations,
            queues=self.queues,
            recent_displacements=self._recent_displacements(),
            preemption_waste=self._waste_state(),
            fleet_index=self.fleet.fleet_index,
        )

    def _waste_state(self) -> WasteState | None:
        """The preemption waste caps' state (``policy.waste``), the losses pruned to the
        longest window in force; None when no cap is set."""
        if self._waste_window_s is None:
            return None
        ws = self.waste
        i = 0
        while i < len(ws) and self.now - ws[i].at_s >= self._waste_window_s:
            i += 1
        if i:
            del ws[:i]
        return WasteState(tuple(ws), self._waste_caps)

    def _recent_displacements(self) -> tuple[Displacement, ...]:
        keep = displacement_window_s(self.cfg)  # (policy.ordering: the per-job cap's too)
        ds = self.displacements
        i = 0
        while i < len(ds) and self.now - ds[i].at_s >= keep:
            i += 1
        if i:
            del ds[:i]
        return tuple(ds)

    def schedule_pass(self) -> None:
        self.passes += 1
        self._last_pass_s = self.now
        if self._overdue and self._revisit_at == math.inf:
            self._arm_revisit(self.now + REVISIT_S)  # stopped while quota refused them all
        snap = self.gates.apply(self.snapshot(), self.fleet.jobs, self._dependency_failed)
        if self.gates.blocked or self._held:
            self._held = tuple(self.gates.blocked)
            held: dict[str, int] = {}
            for job_id in self._held:
                tid = self._specs[job_id].team_id
                held[tid] = held.get(tid, 0) + 1
            self._held_by_team = held
        if self.limits:
            snap = self._apply_limits(snap)
        result = schedule(snap, self.cfg)
        for job_id in result.released_holds:
            self._drop_holds(job_id)
        reservations: list[BackfillReservation] = []
        for d in result.decisions:
            if isinstance(d, Place):
                self._start(d.job_id, ((d.node_id, d.gpu_count),))
            elif isinstance(d, PlaceGang):
                self.gangs_placed += 1
                self._start(d.job_id, tuple((m.node_id, m.gpu_count) for m in d.members))
            elif isinstance(d, Preempt):
                self._preempt(d)
            elif isinstance(d, HoldForBackfill):
                self.first_reservation_s.setdefault(d.job_id, d.start_at_s)
                reservations.append(
                    BackfillReservation(d.job_id, d.node_id, d.gpu_count, d.start_at_s)
                )
        self.reservations = tuple(reservations) + result.shields
        self.rec.last_waiting = result.waiting

    def _apply_limits(self, snap: ClusterSnapshot) -> ClusterSnapshot:
        """The team limits (``policy.limits.apply_limits``) on the pass's snapshot, with
        the demotions and budget holds recorded for the report."""
        lr = apply_limits(snap, self.limits, self.ledger.uses(self.now), self.cfg)
        self._demoted = lr.demoted
        for job_id in lr.demoted:
            self.demoted_jobs.setdefault(self._specs[job_id].team_id, set()).add(job_id)
        for job_id in lr.held:
            self.budget_held_jobs.setdefault(self._specs[job_id].team_id, set()).add(job_id)
        for key, st in lr.statuses.items():
            self.budget_peak[key] = max(self.budget_peak.get(key, 0.0), st.used_gpu_h)
            self.budget_last[key] = st
        return lr.snapshot

    def limits_report(self) -> dict[str, object]:
        """Per team: each budget (limit, use at the last pass, the highest use seen) and
        the jobs demoted or held by a budget."""
        out: dict[str, object] = {}
        for team_id in sorted(self.limits):
            budgets = {
                key: {
                    "limit_gpu_h": st.limit_gpu_h,
                    "used_gpu_h_at_end": round(st.used_gpu_h, 3),
                    "peak_used_gpu_h": round(self.budget_peak.get((t, key), 0.0), 3),
                    "hard": st.hard,
                }
                for (t, key), st in sorted(self.budget_last.items())
                if t == team_id
            }
            out[team_id] = {
                "budgets": budgets,
                "demoted_jobs": len(self.demoted_jobs.get(team_id, ())),
                "demoted_starts": self.demoted_starts.get(team_id, 0),
                "budget_held_jobs": len(self.budget_held_jobs.get(team_id, ())),
                "preemption_waste_gpu_h": round(self.waste_by_team.get(team_id, 0.0), 3),
            }
        return out

    def run(self, progress: Callable[[float, int], None] | None = None) -> None:
        """Run to the end (or the horizon). ``progress(sim_time_s, events_done)`` is called
        every :data:`PROGRESS_EVERY_EVENTS` events (a CLI shows it; results do not depend
        on it)."""
        every_event = self.opt.check_invariants == "every_event"
        every_pass = every_event or self.opt.check_invariants == "every_pass"
        horizon = self.opt.horizon_s
        while self._live_events:  # else only wake-ups and ended attempts' events are left
            if self._drop_moot():
                continue  # dropped before the clock moves to it
            t = self._events[0][0]
            if horizon is not None and t > horizon:
                # the clock runs to the horizon: jobs still waiting wait until then
                self._sample_until(horizon)
                self._advance(horizon)
                self.now = horizon
                break
            self._sample_until(t)
            self._advance(t)
            self.now = t
            due = False  # a pass follows any event but a wake-up that finds nothing to do
            while self._events and self._events[0][0] == t:
                _, kind, key, live = self._pop()
                if kind == _WAKE:  # wake-ups are not counted in ``events``
                    due = self._wake(key) or due
                    continue
                if kind == _REVISIT:
                    due = self._revisit() or due
                    continue
                self.events += 1
                if live:
                    self._live_events -= 1
                due = True
                if kind == _END:
                    self._run_end(key)
                elif kind == _STOPPED:
                    self._stopped(key)
                elif kind == _TIMEOUT:
                    self._timeout(key)
                else:
                    self._arrive(key)
                if every_event:
                    self._check()
                if progress is not None and self.events % PROGRESS_EVERY_EVENTS == 0:
                    progress(self.now, self.events)
            if not due:
                continue
            self.schedule_pass()
            if every_pass:
                self._check()
        self._check(full=True)
        self.rec.close(self.now, self.fleet, len(self._jobs_in))

    def _sample_until(self, t: float) -> None:
        """Take the samples due at or before ``t`` (sample ``i`` is due at ``i *
        sample_interval_s``). Nothing changes between two events, so all the samples due in
        one stretch are the same: one sample stands for all of them (O(1) per stretch, however
        long it is or however short the interval)."""
        step = self.opt.sample_interval_s
        first = self._next_sample_i
        if step <= 0 or first * step > t:
            return
        last = max(first, math.floor(t / step))  # the last sample due, up to rounding
        while last * step > t:
            last -= 1
        while (last + 1) * step <= t:
            last += 1
        self.rec.sample(
            first * step,
            self.fleet,
            self.teams_alloc(),
            count=last - first + 1,
            last_s=last * step,
        )
        self._next_sample_i = last + 1

    def teams_alloc(self) -> dict[str, int]:
        return {tid: a.gpus for tid, a in self.teams.items()}
