"""Simulator-vs-live parity on a tiny scenario: the same world, built once through the
database (``store.queries.load_snapshot``) and once in the simulator's in-memory fleet, gives
the policy the same snapshot and therefore the same decisions and wait reasons."""

from __future__ import annotations

import dataclasses
from functools import partial

from gpufleet.domain.states import JobStatus
from gpufleet.domain.types import PriorityClass
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import HoldForBackfill, Place, Preempt
from gpufleet.policy.snapshot import ClusterSnapshot, PendingJob
from gpufleet.services import teams
from gpufleet.sim.fleet import InMemoryFleet
from gpufleet.sim.model import NodeGroup, SimJob
from gpufleet.store import allocate
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import load_snapshot
from gpufleet.store.tables import JobRow
from tests.factories import become_leader, create_node, create_team, submit

# (team, GPUs, priority)
WAVE_1 = [
    ("t1", 4, "NORMAL"),
    ("t2", 8, "HIGH"),
    ("t1", 2, "LOW"),
    ("t2", 1, "NORMAL"),
    ("t1", 8, "NORMAL"),
    ("t2", 2, "LOW"),
    ("t1", 1, "CRITICAL"),
    ("t2", 4, "NORMAL"),
]
WAVE_2 = [("t2", 2, "HIGH"), ("t1", 4, "LOW"), ("t2", 8, "NORMAL"), ("t1", 1, "NORMAL")]


def live_snapshot(db: Database) -> ClusterSnapshot:
    with db.snapshot() as s:
        return load_snapshot(s, db_now(s))


def sim_snapshot(fleet: InMemoryFleet, live: ClusterSnapshot) -> ClusterSnapshot:
    pending = tuple(
        fleet.pending_view(js) for js in fleet.jobs.values() if js.status == JobStatus.PENDING
    )
    return ClusterSnapshot(
        now_s=live.now_s,
        nodes=fleet.node_states(),
        pending=pending,
        running=fleet.running_states(live.now_s),
        teams=live.teams,
    )


def submit_both(db: Database, fleet: InMemoryFleet, wave: list[tuple[str, int, str]]) -> None:
    for team, gpus, priority in wave:
        job_id = submit(db, team, gpus=gpus, priority=priority).job_id
        with db.read() as s:
            created = s.get(JobRow, job_id).created_at.timestamp()
        fleet.submit(
            SimJob(
                job_id=job_id,
                team_id=team,
                submit_s=created,
                gpus=gpus,
                duration_s=3600,
                priority=PriorityClass(priority),
            ),
            created,
        )


def normalized(pending: tuple[PendingJob, ...]) -> list[PendingJob]:
    """Sorted by id; ``queued_at_s=None`` means ``submitted_at_s`` (PendingJob's contract)."""
    return sorted(
        (dataclasses.replace(p, queued_at_s=p.queued_at_s or p.submitted_at_s) for p in pending),
        key=lambda p: p.job_id,
    )


def places(decisions: tuple[object, ...]) -> list[tuple[str, str, int]]:
    return [(d.job_id, d.node_id, d.gpu_count) for d in decisions if isinstance(d, Place)]


def canonical(decisions: tuple[object, ...], snap: ClusterSnapshot) -> list[tuple[object, ...]]:
    """Decisions with attempt ids replaced by job ids (the two worlds name attempts apart)."""
    job_of = {r.run_id: r.job_id for r in snap.running}
    out: list[tuple[object, ...]] = []
    for d in decisions:
        if isinstance(d, Place):
            out.append(("place", d.job_id, d.node_id, d.gpu_count))
        elif isinstance(d, Preempt):
            victims = tuple(sorted(job_of[r] for r in d.victim_run_ids))
            out.append(("preempt", d.for_job_id, d.node_id, victims, d.reason, d.gpu_count))
        elif isinstance(d, HoldForBackfill):
            out.append(("hold", d.job_id, d.node_id, d.gpu_count))
    return out


def test_the_live_snapshot_and_the_simulators_agree(db: Database) -> None:
    for team, guarantee in (("t1", 8), ("t2", 8)):
        create_team(db, team)
        db.run_write(
            partial(
                teams.update_quota,
                team_id=team,
                upd=teams.QuotaUpdate(guaranteed_gpus={"H100": guarantee}),
            )
        )
    for i in range(3):
        create_node(db, f"g-{i:04d}", gpus=8)
    fleet = InMemoryFleet([NodeGroup("g", 3, 8, "H100", 81920, 64, 512_000)])
    epoch = become_leader(db)
    submit_both(db, fleet, WAVE_1)
    for wave in (1, 2):
        live = live_snapshot(db)
        sim = sim_snapshot(fleet, live)
        assert sorted(live.nodes, key=lambda n: n.node_id) == sorted(
            sim.nodes, key=lambda n: n.node_id
        )
        assert normalized(live.pending) == normalized(sim.pending)
        got_live, got_sim = schedule(live), schedule(sim)
        assert canonical(got_live.decisions, live) == canonical(got_sim.decisions, sim)
        assert got_live.decisions, "the scenario decides something each wave"
        assert {j: r.code for j, r in got_live.waiting.items()} == {
            j: r.code for j, r in got_sim.waiting.items()
        }
        for job_id, node_id, gpus in places(got_live.decisions):
            seen = next(p.attempt for p in live.pending if p.job_id == job_id)
            db.run_write(
                partial(
                    allocate.reserve,
                    job_id=job_id,
                    node_id=node_id,
                    gpu_count=gpus,
                    seen_fencing_epoch=seen,
                    leader_holder="test-leader",
                    leader_epoch=epoch,
                    lease_s=60,
                )
            )
            fleet.reserve(job_id, node_id, live.now_s)
        if wave == 1:
            submit_both(db, fleet, WAVE_2)
