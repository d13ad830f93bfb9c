"""What a run measures, and the JSON report it produces.

Time-weighted quantities (allocation, fairness) are integrated exactly between events, since
nothing changes between two events; queue delay is over every job that started (finished or
not: its wait is known once it starts), with the jobs that never started apart (their wait
so far, censored at the end); JCT is over jobs that succeeded;
the free-GPUs-per-node histogram and fragmentation are sampled every ``sample_interval_s``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpufleet.domain.states import JobStatus, NodeStatus
from gpufleet.policy.decisions import WaitReason
from gpufleet.sim.fleet import InMemoryFleet, SimJobState
from gpufleet.sim.model import size_bucket


@dataclass(frozen=True, slots=True)
class JobRecord:
    job_id: str
    team_id: str
    tier: str
    gpus: int
    submit_s: float
    first_start_s: float | None
    end_s: float | None
    wait_s: float
    attempts: int
    preemptions: int
    status: str
    borrowed: bool | None = None
    """Whether the job's first placement borrowed (took its team above its guarantee on
    that GPU type); None: it never started."""
    gang: bool = False
    """Whether the job ran as a multi-node gang (more than one member node)."""
    held_s: float = 0.0
    """Time PENDING but held by a dependency or its array's ``%N`` limit (not in ``wait_s``:
    queue delay starts when the job is eligible, as Slurm's eligible time)."""
    timed_out: bool = False
    """Ended FAILED (``TIMEOUT``): an attempt ran past ``max_runtime_s``."""


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an ascending sequence (0 <= q <= 100)."""
    if not sorted_values:
        return 0.0
    k = max(0, math.ceil(q / 100.0 * len(sorted_values)) - 1)
    return float(sorted_values[k])


def summary(values: Sequence[float]) -> dict[str, float]:
    """n, mean, p50/p95/p99 (nearest rank) and max; only ``{"n": 0}`` for no values (the
    others are undefined, not 0: read them with ``.get`` and print ``shown``)."""
    v = sorted(values)
    if not v:
        return {"n": 0}
    return {
        "n": len(v),
        "mean": sum(v) / len(v),
        "p50": percentile(v, 50),
        "p95": percentile(v, 95),
        "p99": percentile(v, 99),
        "max": v[-1],
    }


def shown(x: float | None, spec: str = ".0f") -> str:
    """A metric for people: ``format(x, spec)``, or ``n/a`` where it is undefined (None: a
    mean over no jobs, Jain's index with fewer than two backlogged teams)."""
    return "n/a" if x is None else format(x, spec)


def jain(xs: Sequence[float]) -> float | None:
    """Jain's fairness index (Jain, Chiu, Hawe 1984): (sum x)^2 / (n sum x^2), 1 = equal;
    None (undefined, 0/0) when every x is 0."""
    sq = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * sq) if sq > 0 else None


class Recorder:
    def __init__(self, total_gpus: int, entitlement: dict[str, float]) -> None:
        self.total_gpus = total_gpus
        self.entitlement = entitlement
        self.records: list[JobRecord] = []
        self.rejected_ids: list[str] = []
        self.pending_sizes: dict[int, int] = {}
        self.preemptions = 0
        self.preemptions_by_reason: dict[str, int] = {}
        self.t_total = 0.0
        self.alloc_gpu_s = 0.0
        self.t_backlog = 0.0
        self.alloc_backlog_gpu_s = 0.0
        self.t_jain = 0.0
        """Time with Jain's index defined: two or more backlogged teams with an entitlement,
        not all of them at 0 GPUs."""
        self.jain_dt = 0.0
        self.t_two_backlogged = 0.0
        self.samples: list[tuple[float, int, int, dict[str, int]]] = []
        self.free_hist: dict[int, int] = {}
        self.frag_samples = 0
        """Samples taken while jobs were waiting; ``frag_sum``/``free_sum`` add up their
        free GPUs unusable by the waiting jobs / free GPUs (integers: exact sums)."""
        self.frag_sum = 0
        self.free_sum = 0
        self.last_waiting: Mapping[str, WaitReason] = {}
        self.unfinished: list[JobRecord] = []
        self.started: list[JobRecord] = []
        """Every job that started (``close``): the finished ones and the unfinished ones that
        had started; the population of every queue-delay statistic."""
        self.never_started: list[JobRecord] = []
        """Unfinished jobs that never started (``close``), ``wait_s`` censored at the end."""
        self.not_submitted = 0
        """Jobs of the workload whose submit time is past the end (the horizon)."""
        self.team_gpu_s: dict[str, float] = {}
        self.final_allocated = 0

    # -- during the run ----------------------------------------------------------------
    def integrate(
        self, t0: float, t1: float, alloc: Mapping[str, int], backlogged: set[str]
    ) -> None:
        dt = t1 - t0
        used = sum(alloc.values())
        self.t_total += dt
        self.alloc_gpu_s += used * dt
        for tid, g in alloc.items():
            if g:
                self.team_gpu_s[tid] = self.team_gpu_s.get(tid, 0.0) + g * dt
        if backlogged:
            self.t_backlog += dt
            self.alloc_backlog_gpu_s += used * dt
        if len(backlogged) >= 2:
            self.t_two_backlogged += dt
            ent = self.entitlement
            xs = [alloc.get(t, 0) / ent[t] for t in sorted(backlogged) if ent.get(t, 0.0) > 0]
            j = jain(xs) if len(xs) >= 2 else None
            if j is not None:
                self.jain_dt += j * dt
                self.t_jain += dt

    def sample(
        self,
        now: float,
        fleet: InMemoryFleet,
        team_alloc: Mapping[str, int],
        count: int = 1,
        last_s: float | None = None,
    ) -> None:
        """Sample the fleet at ``now``. ``count`` > 1: the sample stands for ``count`` samples
        due up to ``last_s`` while nothing changed (weighted as that many; the time series
        gets a point at ``now`` and one at ``last_s``)."""
        pending = sum(self.pending_sizes.values())
        used = sum(team_alloc.values())
        point = {t: g for t, g in team_alloc.items() if g}
        self.samples.append((now, used, pending, point))
        if count > 1 and last_s is not None:
            self.samples.append((last_s, used, pending, dict(point)))
        smallest = min(self.pending_sizes) if self.pending_sizes else 0
        frag = free = 0
        for n in fleet.nodes.values():
            if n.status is not NodeStatus.HEALTHY:
                continue
            self.free_hist[n.free] = self.free_hist.get(n.free, 0) + count
            free += n.free
            if pending and 0 < n.free < smallest:
                frag += n.free
        if pending:
            self.frag_samples += count
            self.frag_sum += frag * count
            self.free_sum += free * count

    def preempted(self, reason: str = "") -> None:
        self.preemptions += 1
        if reason:
            self.preemptions_by_reason[reason] = self.preemptions_by_reason.get(reason, 0) + 1

    def _record(self, js: SimJobState) -> JobRecord:
        s = js.spec
        return JobRecord(
            s.job_id,
            s.team_id,
            s.priority.value,
            s.gpus,
            s.submit_s,
            js.first_start_s,
            js.end_s,
            js.wait_total_s - js.held_s,
            len(js.runs),
            js.preemptions,
            js.status.value,
            js.first_start_borrowed,
            js.gang,
            js.held_s,
            js.timed_out,
        )

    def finished(self, js: SimJobState) -> None:
        self.records.append(self._record(js))

    def rejected(self, js: SimJobState) -> None:
        self.rejected_ids.append(js.spec.job_id)

    def close(self, now: float, fleet: InMemoryFleet, jobs_in_workload: int | None = None) -> None:
        """End of the run at ``now``; ``jobs_in_workload``: how many jobs the workload had
        (those not submitted by ``now`` are counted apart)."""
        done = {r.job_id for r in self.records} | set(self.rejected_ids)
        for job_id, js in fleet.jobs.items():
            if job_id not in done:
                rec = self._record(js)
                if js.status is JobStatus.PENDING:  # still waiting: its wait counts up to now
                    wait = js.wait_total_s + now - js.pending_since_s - js.held_s
                    rec = JobRecord(**{**_asdict(rec), "wait_s": wait})
                self.unfinished.append(rec)
        self.started = self.records + [r for r in self.unfinished if r.first_start_s is not None]
        self.never_started = [r for r in self.unfinished if r.first_start_s is None]
        if jobs_in_workload is not None:
            self.not_submitted = jobs_in_workload - len(fleet.jobs)
        self.final_allocated = sum(n.total - n.free for n in fleet.nodes.values())
        self.preempt_lost_gpu_s = sum(js.preempt_lost_gpu_s for js in fleet.jobs.values())
        self.held_gpu_s_by_team: dict[str, float] = {}
        for js in fleet.jobs.values():
            t = js.spec.team_id
            self.held_gpu_s_by_team[t] = self.held_gpu_s_by_team.get(t, 0.0) + js.held_gpu_s

    # -- the report --------------------------------------------------------------------
    def report(self) -> dict[str, Any]:
        recs = self.started
        waits_all = [r.wait_s for r in recs]
        by_size: dict[str, list[float]] = {}
        by_tier: dict[str, list[float]] = {}
        by_team: dict[str, list[JobRecord]] = {}
        for r in recs:
            by_size.setdefault(size_bucket(r.gpus), []).append(r.wait_s)
            by_tier.setdefault(r.tier, []).append(r.wait_s)
            by_team.setdefault(r.team_id, []).append(r)
        succeeded = [r for r in self.records if r.status == JobStatus.SUCCEEDED.value]
        jcts = [r.end_s - r.submit_s for r in succeeded if r.end_s is not None]
        jct_by_team: dict[str, list[float]] = {}
        for r in succeeded:
            if r.end_s is not None:
                jct_by_team.setdefault(r.team_id, []).append(r.end_s - r.submit_s)
        longest = max(
            self.records + self.unfinished, key=lambda r: (r.wait_s, r.job_id), default=None
        )
        held = [r.held_s for r in self.records + self.unfinished if r.held_s > 0]
        hist_total = sum(self.free_hist.values()) or 1
        per_team = {}
        for tid, rs in sorted(by_team.items()):
            team_jct = jct_by_team.get(tid, [])
            per_team[tid] = {
                "jobs": len(rs),
                "queue_delay_s": summary([r.wait_s for r in rs]),
                "queue_delay_by_size_s": _by_size(rs),
                # None: no job of the team succeeded
                "mean_jct_s": sum(team_jct) / len(team_jct) if team_jct else None,
                "gpu_hours": self.team_gpu_s.get(tid, 0.0) / 3600.0,
                "entitlement_gpus": self.entitlement.get(tid, 0.0),
            }
        return {
            "jobs": {
                # finished + rejected_never_fit + unfinished + not_submitted_by_horizon =
                # the workload's jobs
                "finished": len(self.records),
                "succeeded": len(succeeded),
                "timed_out": sum(r.timed_out for r in self.records),
                "unfinished": len(self.unfinished),
                "unfinished_never_started": len(self.never_started),
                "rejected_never_fit": len(self.rejected_ids),
                "not_submitted_by_horizon": self.not_submitted,
                "started": len(recs),
            },
            "allocation": {
                "total_gpus": self.total_gpus,
                # None (printed "n/a"): no time passed / no job ever waited
                "overall": self.alloc_gpu_s / (self.total_gpus * self.t_total)
                if self.t_total
                else None,
                "under_backlog": self.alloc_backlog_gpu_s / (self.total_gpus * self.t_backlog)
                if self.t_backlog
                else None,
                "backlog_time_share": self.t_backlog / self.t_total if self.t_total else None,
                "final_share": self.final_allocated / self.total_gpus if self.total_gpus else 0.0,
            },
            "queue_delay_s": {
                "all": summary(waits_all),
                "by_size": {k: summary(v) for k, v in sorted(by_size.items())},
                "by_tier": {k: summary(v) for k, v in sorted(by_tier.items())},
                "by_quota": by_quota(recs),
                # jobs that never started: their wait until the end (censored, a lower bound)
                "never_started_censored": summary([r.wait_s for r in self.never_started]),
                # time jobs were held by a dependency or an array's %N limit, of the jobs
                # that were held at all (not queue delay)
                "held_by_dependency_or_limit": summary(held),
            },
            "jct_s": summary(jcts),
            "fairness": {
                # None (printed "n/a"): fewer than two teams were ever backlogged at once,
                # so there was no contention to be fair about
                "jain_backlogged_time_weighted": self.jain_dt / self.t_jain
                if self.t_jain
                else None,
                "share_of_time_two_or_more_teams_backlogged": self.t_two_backlogged / self.t_total
                if self.t_total
                else None,
            },
            "starvation": {
                "longest_wait_s": longest.wait_s if longest else None,
                "longest_wait_job": longest.job_id if longest else None,
                "longest_wait_finished": bool(longest and longest.end_s is not None),
                "longest_wait_started": bool(longest and longest.first_start_s is not None),
                "max_wait_by_tier_s": {k: max(v) for k, v in sorted(by_tier.items())},
            },
            "preemption": {
                "count": self.preemptions,
                "gpu_hours_lost": self.preempt_lost_gpu_s / 3600.0,
                "by_reason": dict(sorted(self.preemptions_by_reason.items())),
                # how often one job was displaced (issue 29: the per-job cap)
                "max_per_job": max((r.preemptions for r in recs), default=0),
                "jobs_preempted_10_or_more": sum(r.preemptions >= 10 for r in recs),
                # displacement: work lost to preemptions / GPU-time allocated (both GPU-s)
                "displacement_share": self.preempt_lost_gpu_s / self.alloc_gpu_s
                if self.alloc_gpu_s
                else 0.0,
            },
            "fragmentation": {
                # None: no sample was taken while jobs waited
                "mean_free_gpus_unusable_by_waiting_jobs": self.frag_sum / self.frag_samples
                if self.frag_samples
                else None,
                "mean_free_gpus_while_backlogged": self.free_sum / self.frag_samples
                if self.frag_samples
                else None,
            },
            "free_gpus_per_node_share": {
                str(k): v / hist_total for k, v in sorted(self.free_hist.items())
            },
            "per_team": per_team,
        }


def _asdict(r: JobRecord) -> dict[str, Any]:
    return {f: getattr(r, f) for f in r.__slots__}


def p99_ratio(by_size: Mapping[str, Mapping[str, float]]) -> float | None:
    """8+ GPU p99 queue delay / 1-GPU p99 of a ``_by_size`` table; None (``n/a``) when
    either size has no job or the 1-GPU p99 is 0 (undefined, not infinite)."""
    return _over_one(by_size.get("8+", {}).get("p99"), by_size)


def _over_one(p99: float | None, by_size: Mapping[str, Mapping[str, float]]) -> float | None:
    one = by_size.get("1", {}).get("p99")
    if p99 is None or one is None or one <= 0:
        return None
    return p99 / one


def by_quota(recs: Sequence[JobRecord]) -> dict[str, dict[str, Any]]:
    """Queue delay by job size, split by whether the job's first placement was inside its
    team's guarantee (``inside_guarantee``) or borrowed (``borrowing``), with the 8+ / 1-GPU
    p99 ratio of each part (None where undefined) and of all jobs (``all``); ``gangs`` is the
    queue delay of the multi-node gangs among them (a subset of 8+ on 8-GPU nodes; for all
    jobs the same as the report's ``gangs.queue_delay_s``) and ``p99_gang_to_1`` their p99
    over the same part's 1-GPU p99.

    Fair share (DD4) serves work inside a guarantee first and lets borrowed work wait for
    idle capacity: the ``inside_guarantee`` ratio shows how size is treated where fair share
    does not bind, the ``borrowing`` one how large loans fare against small ones. Jobs that
    never started are in neither part (``recs`` are jobs that started)."""
    parts: dict[str, list[JobRecord]] = {"inside_guarantee": [], "borrowing": []}
    for r in recs:
        if r.borrowed is not None:
            parts["borrowing" if r.borrowed else "inside_guarantee"].append(r)
    out: dict[str, dict[str, Any]] = {}
    for name, rs in [*parts.items(), ("all", list(recs))]:
        table = _by_size(rs)
        gangs = summary([r.wait_s for r in rs if r.gang])
        out[name] = {
            "jobs": len(rs),
            "by_size": table,
            "gangs": gangs,
            "p99_8_to_1": p99_ratio(table),
            "p99_gang_to_1": _over_one(gangs.get("p99"), table),
        }
    del out["all"]["by_size"]  # the same as queue_delay_s.by_size
    return out


def _by_size(recs: list[JobRecord]) -> dict[str, dict[str, float]]:
    """Queue delay per job size (1/2/4/8+) of some records: within one team, whether its
    large jobs wait longer than its small ones, apart from how loaded the team is."""
    out: dict[str, list[float]] = {}
    for r in recs:
        out.setdefault(size_bucket(r.gpus), []).append(r.wait_s)
    return {k: summary(v) for k, v in sorted(out.items())}
