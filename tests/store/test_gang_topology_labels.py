"""Admin topology labels reach the gang placement: the labels set through
``services.node_labels`` are the ones ``store.queries.load_snapshot`` hands the policy, so a
2-node gang lands on two nodes of one ``rack`` although other free nodes sort first by id.
"""

from __future__ import annotations

from functools import partial

from gpufleet.domain.types import JobSpec, PriorityClass, Resources
from gpufleet.policy.cycle import schedule
from gpufleet.policy.decisions import PlaceGang
from gpufleet.services import node_labels
from gpufleet.services.jobs import submit_job
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.queries import load_snapshot
from tests.factories import create_node, create_team


def test_admin_rack_labels_steer_a_gang_to_one_rack(db: Database) -> None:
    create_team(db, "team-a")
    for n in ("n1", "n2", "n3", "n4"):
        create_node(db, n, gpus=2)
    # The agents report no topology; the admin says n1+n3 share rack a, n2+n4 rack b.
    for n, rack in (("n1", "a"), ("n2", "b"), ("n3", "a"), ("n4", "b")):
        db.run_write(partial(node_labels.set_admin_labels, node_id=n, changes={"rack": rack}))
    spec = JobSpec(
        command=("true",),
        resources=Resources(4, ("H100",), nodes=2, gpus_per_node=2),
        priority=PriorityClass("NORMAL"),
    )
    job = submit_job(db, team_id="team-a", idempotency_key="gang-1", spec=spec)
    with db.read() as s:
        snap = load_snapshot(s, db_now(s))
    assert {n.node_id: n.labels.get("rack") for n in snap.nodes} == {
        "n1": "a",
        "n2": "b",
        "n3": "a",
        "n4": "b",
    }
    gangs = [d for d in schedule(snap).decisions if isinstance(d, PlaceGang)]
    assert [g.job_id for g in gangs] == [job.job_id]
    assert sorted(m.node_id for m in gangs[0].members) == ["n1", "n3"]
