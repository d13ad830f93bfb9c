"""Job arrays and dependencies in the simulator: the same ``policy.gates`` as the live
scheduler, fed from the in-memory fleet.

A dependency on a job that has not arrived yet counts as PENDING (not yet decided); the
scenario loader rejects dependencies on ids that are not in the workload.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from gpufleet.domain.jobsyntax import DependencyKind
from gpufleet.domain.states import JobStatus
from gpufleet.policy import gates
from gpufleet.policy.snapshot import ClusterSnapshot
from gpufleet.sim.model import SimJob

ACTIVE = (JobStatus.SCHEDULED, JobStatus.RUNNING)


class SimGates:
    """The gates of a workload's jobs (only jobs with dependencies or an array limit)."""

    def __init__(self, jobs: Iterable[SimJob]) -> None:
        self.gates: dict[str, gates.JobGate] = {}
        self.blocked: dict[str, object] = {}
        """The jobs the last ``apply`` held back (job id -> why): not eligible yet."""
        self.arrays: dict[str, list[str]] = {}
        for j in jobs:
            if j.array_id is not None:
                self.arrays.setdefault(j.array_id, []).append(j.job_id)
            if j.depends_on or j.array_max_running is not None:
                self.gates[j.job_id] = gates.JobGate(
                    job_id=j.job_id,
                    depends_on=tuple(
                        gates.Dependency(DependencyKind(k), d) for k, d in j.depends_on
                    ),
                    array_id=j.array_id,
                    array_index=j.array_index,
                    array_max_running=j.array_max_running,
                )

    def apply(
        self,
        snap: ClusterSnapshot,
        status: Mapping[str, object],
        fail: Callable[[str, str], None],
    ) -> ClusterSnapshot:
        """``snap`` without gated jobs; ``fail(job_id, why)`` for each job whose dependency
        can never be satisfied (repeated until none is left, so chains fail in one pass).

        Args:
            status: job id -> an object with ``.status`` (the fleet's job states).
        """
        self.blocked = {}
        if not self.gates:
            return snap
        while True:
            queued = [p.job_id for q in (snap.queues or {}).values() for p in q] or [
                p.job_id for p in snap.pending
            ]
            todo = [self.gates[j] for j in queued if j in self.gates]
            if not todo:
                return snap
            dep_status = {
                d.job_id: str(getattr(status[d.job_id], "status", JobStatus.PENDING))
                if d.job_id in status
                else JobStatus.PENDING
                for g in todo
                for d in g.depends_on
            }
            active = {
                a: sum(
                    1 for j in ids if j in status and getattr(status[j], "status", None) in ACTIVE
                )
                for a, ids in self.arrays.items()
                if any(g.array_id == a for g in todo)
            }
            result = gates.evaluate(todo, dep_status, active)
            if not result.failed:
                self.blocked = dict(result.blocked)
                return gates.filter_snapshot(snap, result)
            for job_id, why in sorted(result.failed.items()):
                fail(job_id, why)
            snap = gates.filter_snapshot(snap, gates.GateResult({}, result.failed))
