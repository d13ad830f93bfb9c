"""Builders for policy tests: small, explicit snapshots (pure, no DB)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from gpufleet.domain.types import PriorityClass, Resources
from gpufleet.policy.snapshot import (
    ClusterSnapshot,
    GpuHold,
    NodeState,
    PendingJob,
    RunningJob,
    TeamState,
)


def node(
    node_id: str,
    free: int,
    total: int = 8,
    gpu_type: str = "A100",
    labels: Mapping[str, str] | None = None,
    schedulable: bool = True,
) -> NodeState:
    return NodeState(
        node_id=node_id,
        gpu_type=gpu_type,
        gpu_memory_mb=80_000,
        total_gpus=total,
        free_gpus=free,
        labels=dict(labels or {}),
        schedulable=schedulable,
    )


def job(
    job_id: str,
    team: str = "a",
    gpus: int = 1,
    priority: PriorityClass = PriorityClass.NORMAL,
    at: float = 0.0,
    types: tuple[str, ...] = (),
    max_runtime_s: float | None = None,
    expected_s: float | None = None,
    selector: Mapping[str, str] | None = None,
) -> PendingJob:
    return PendingJob(
        job_id=job_id,
        team_id=team,
        priority=priority,
        submitted_at_s=at,
        resources=Resources(gpu_count=gpus, gpu_types=types),
        expected_duration_s=expected_s,
        max_runtime_s=max_runtime_s,
        node_selector=dict(selector or {}),
    )


def run(
    run_id: str,
    node_id: str,
    team: str = "a",
    gpus: int = 1,
    priority: PriorityClass = PriorityClass.NORMAL,
    started: float = 0.0,
    expected_s: float | None = None,
    max_runtime_s: float | None = None,
    gpu_type: str = "A100",
    preemptible: bool = True,
    checkpoint: float | None = None,
) -> RunningJob:
    return RunningJob(
        run_id=run_id,
        job_id="j-" + run_id,
        team_id=team,
        node_id=node_id,
        priority=priority,
        gpu_count=gpus,
        gpu_type=gpu_type,
        started_at_s=started,
        expected_duration_s=expected_s,
        max_runtime_s=max_runtime_s,
        preemptible=preemptible,
        last_checkpoint_s=checkpoint,
    )


def team(
    team_id: str,
    guarantee: int = 0,
    weight: float = 1.0,
    borrow_limit: int | None = None,
    keep: int = 0,
    gpu_type: str = "A100",
    usage: float = 0.0,
) -> TeamState:
    return TeamState(
        team_id=team_id,
        weight=weight,
        guaranteed_gpus={gpu_type: guarantee} if guarantee else {},
        borrow_limit_gpus=borrow_limit,
        lending_limit_gpus={gpu_type: keep} if keep else {},
        usage_gpu_s=usage,
    )


def snap(
    nodes: Iterable[NodeState],
    pending: Iterable[PendingJob] = (),
    running: Iterable[RunningJob] = (),
    teams: Iterable[TeamState] = (),
    now: float = 0.0,
    holds: Iterable[GpuHold] = (),
) -> ClusterSnapshot:
    return ClusterSnapshot(
        now_s=now,
        nodes=tuple(nodes),
        pending=tuple(pending),
        running=tuple(running),
        teams={t.team_id: t for t in teams},
        holds=tuple(holds),
    )
