"""Builders for tests: pure (domain/policy objects) and database rows."""

from __future__ import annotations

from gpufleet.domain.types import GpuDevice, JobSpec, PriorityClass, Resources
from gpufleet.services import auth, nodes
from gpufleet.services.jobs import Submitted, submit_job
from gpufleet.store import leader
from gpufleet.store.db import Database


def make_spec(
    gpus: int = 1,
    *,
    priority: str = "NORMAL",
    command: tuple[str, ...] = ("true",),
    max_retries: int = 0,
    gpu_types: tuple[str, ...] = (),
) -> JobSpec:
    return JobSpec(
        command=command,
        resources=Resources(gpus, gpu_types),
        priority=PriorityClass(priority),
        max_retries=max_retries,
    )


def create_team(db: Database, name: str = "team-a") -> str:
    return db.run_write(lambda s: auth.create_team(s, name, exist_ok=True))


def create_node(
    db: Database,
    node_id: str = "n1",
    gpus: int = 8,
    gpu_type: str = "H100",
    address: str = "127.0.0.1:1",
    gpu_sharing: str = "none",
) -> str:
    inv = nodes.NodeInventory(
        node_id=node_id,
        address=address,
        agent_epoch=1,
        gpus=tuple(GpuDevice(i, f"{node_id}-{i}", gpu_type, 81920) for i in range(gpus)),
        cpu=64,
        memory_mb=512_000,
        labels={},
        inventory_source="declared",
        gpu_sharing=gpu_sharing,
    )
    db.run_write(lambda s: nodes.register_node(s, inv))
    return node_id


def submit(db: Database, team: str = "team-a", key: str | None = None, **kw: object) -> Submitted:
    import uuid

    return submit_job(
        db, team_id=team, idempotency_key=key or str(uuid.uuid4()), spec=make_spec(**kw)
    )  # type: ignore[arg-type]


def become_leader(db: Database, holder: str = "test-leader", lease_s: float = 60) -> int:
    epoch = db.run_write(lambda s: leader.try_acquire(s, holder, lease_s))
    assert epoch is not None
    return epoch
