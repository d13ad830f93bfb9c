"""Inputs of a simulation: node groups, teams, jobs. Plain frozen dataclasses."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from gpufleet.domain.types import PriorityClass


@dataclass(frozen=True, slots=True)
class NodeGroup:
    """``count`` identical nodes."""

    name: str
    count: int
    gpus_per_node: int
    gpu_type: str
    gpu_memory_mb: int = 0
    cpu: float = 0.0
    memory_mb: int = 0
    labels: Mapping[str, str] = field(default_factory=dict)

    def node_ids(self) -> list[str]:
        """The ids of the group's nodes, as the fleet names them: the group's name for one
        node, else ``name-0000``, ``name-0001``, ..."""
        if self.count == 1:
            return [self.name]
        return [f"{self.name}-{i:04d}" for i in range(self.count)]


@dataclass(frozen=True, slots=True)
class TeamSpec:
    team_id: str
    weight: float = 1.0
    guaranteed_gpus: Mapping[str, int] = field(default_factory=dict)
    borrow_limit_gpus: int | None = None
    lending_limit_gpus: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SimJob:
    """One job of a workload.

    Attributes:
        duration_s: work to do, seconds of running (resumes from the last checkpoint after a
            preemption).
        expected_duration_s / max_runtime_s: what the scheduler is told (estimate / bound).
        failures: how many attempts fail (after ``fail_after_fraction`` of their work) before
            one succeeds; each failure is retried as a new attempt.
        checkpoint_s: checkpoint interval; a preempted attempt keeps work up to its last
            checkpoint (None: it keeps nothing).
        gpus: GPUs of the whole job (all gang members together); ``cpu``/``memory_mb`` are
            per member.
    """

    job_id: str
    team_id: str
    submit_s: float
    gpus: int
    duration_s: float
    priority: PriorityClass = PriorityClass.NORMAL
    gpu_types: tuple[str, ...] = ()
    cpu: float = 0.0
    memory_mb: int = 0
    expected_duration_s: float | None = None
    max_runtime_s: float | None = None
    failures: int = 0
    fail_after_fraction: float = 0.5
    checkpoint_s: float | None = None
    preemptible: bool = True
    node_selector: Mapping[str, str] = field(default_factory=dict)
    depends_on: tuple[tuple[str, str], ...] = ()
    """``(kind, job_id)`` pairs (``afterok``/``afterany``/``afternotok``), see
    ``policy.gates``."""
    array_id: str | None = None
    """The job array this job is a task of (scenario ``array:``), with its index and ``%N``."""
    array_index: int = 0
    array_max_running: int | None = None
    nodes: int | None = None
    """Gang shape, as ``Resources``: members (None: derived from ``gpus`` and the node size;
    a job larger than one node becomes a gang of whole nodes)."""
    gpus_per_node: int | None = None
    allow_partial_nodes: bool = False


def size_bucket(gpus: int) -> str:
    """Job-size bucket of the report: 1, 2, 4 or 8+ GPUs (3 counts as 4, 5-7 as 8+)."""
    if gpus <= 1:
        return "1"
    if gpus == 2:
        return "2"
    if gpus <= 4:
        return "4"
    return "8+"
