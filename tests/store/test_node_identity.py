"""Join tokens, node certificates, revocation and forgetting a node, on both databases; and
the control-plane checks that a node confirms and reports only for runs placed on it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any, ClassVar

import pytest
from sqlalchemy import func, select, update

from gpufleet.domain.errors import Conflict, Forbidden, NotFound, Unauthenticated, ValidationFailed
from gpufleet.objectstore import ObjectStore
from gpufleet.services import node_identity as ni
from gpufleet.services import runs
from gpufleet.store import allocate
from gpufleet.store.db import Database
from gpufleet.store.queries import check_database
from gpufleet.store.tables import (
    JobRow,
    JobRunRow,
    JoinTokenRow,
    NodeCapacityRow,
    NodeCertRow,
    NodeRow,
)
from tests.factories import become_leader, create_node, create_team, submit
from tests.store.test_allocate import reserve

LATER = datetime.now(UTC) + timedelta(days=30)


def token(db: Database, node_id: str | None = None, ttl_s: float = 900) -> str:
    return db.run_write(partial(ni.create_join_token, node_id=node_id, ttl_s=ttl_s))[0]


def join(db: Database, secret: str, node_id: str, serial: str) -> None:
    db.run_write(partial(ni.join, secret=secret, node_id=node_id, serial=serial, not_after=LATER))


def valid(db: Database, serial: str, node_id: str) -> bool:
    with db.read() as s:
        return ni.cert_is_valid(s, serial, node_id)


def test_tokens_are_stored_hashed(db: Database) -> None:
    secret = token(db)
    with db.read() as s:
        row = s.scalars(select(JoinTokenRow)).one()
    assert secret not in (row.token_sha256, row.id)
    assert len(row.token_sha256) == 64


def test_a_join_token_is_single_use(db: Database) -> None:
    secret = token(db)
    join(db, secret, "n1", "aa01")
    assert valid(db, "aa01", "n1")
    with pytest.raises(Unauthenticated, match="invalid, used or expired"):
        join(db, secret, "n2", "aa02")
    assert not valid(db, "aa02", "n2")


def test_an_expired_join_token_is_refused(db: Database) -> None:
    secret = token(db, ttl_s=10)
    db.run_write(
        lambda s: s.execute(
            update(JoinTokenRow).values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
        )
    )
    with pytest.raises(Unauthenticated):
        join(db, secret, "n1", "aa01")
    with db.read() as s:
        assert s.scalar(select(func.count()).select_from(NodeCertRow)) == 0


def test_unknown_token_and_bad_inputs(db: Database) -> None:
    with pytest.raises(Unauthenticated):
        join(db, "made-up", "n1", "aa01")
    with pytest.raises(ValidationFailed) as e:
        token(db, node_id="bad id")
    assert e.value.field == "node_id"
    with pytest.raises(ValidationFailed) as e:
        token(db, ttl_s=8 * 86400)
    assert e.value.field == "ttl"


def test_a_bound_token_joins_only_its_node(db: Database) -> None:
    secret = token(db, node_id="n1")
    with pytest.raises(Forbidden, match="for node 'n1'"):
        join(db, secret, "n2", "aa01")
    join(db, secret, "n1", "aa02")  # not spent by the refused attempt
    assert valid(db, "aa02", "n1")


def test_an_existing_node_rejoins_only_with_a_token_made_for_it(db: Database) -> None:
    create_team(db)
    create_node(db, "n1", gpus=2)
    with pytest.raises(Forbidden, match="--node-id n1"):
        join(db, token(db), "n1", "bb01")
    join(db, token(db, node_id="n1"), "n1", "bb02")
    # a rejoin (wiped state dir, lost key) revokes the node's older certificates
    join(db, token(db, node_id="n1"), "n1", "bb03")
    assert not valid(db, "bb02", "n1")
    assert valid(db, "bb03", "n1")


def test_a_certificate_is_valid_only_for_the_node_it_names(db: Database) -> None:
    join(db, token(db), "n1", "cc01")
    assert valid(db, "cc01", "n1")
    assert not valid(db, "cc01", "n2")
    assert not valid(db, "ffff", "n1")


def test_revoke_and_renewal(db: Database) -> None:
    join(db, token(db), "n1", "dd01")
    db.run_write(
        partial(ni.record_renewal, node_id="n1", old_serial="dd01", serial="dd02", not_after=LATER)
    )
    assert valid(db, "dd01", "n1") and valid(db, "dd02", "n1")
    assert db.run_write(partial(ni.revoke_node, node_id="n1")) == 2
    assert not valid(db, "dd01", "n1") and not valid(db, "dd02", "n1")
    with pytest.raises(NotFound):
        db.run_write(partial(ni.revoke_node, node_id="nobody"))


def test_a_renewal_from_a_revoked_certificate_is_refused_in_its_transaction(
    db: Database,
) -> None:
    join(db, token(db), "n1", "de01")
    db.run_write(partial(ni.revoke_node, node_id="n1"))
    with pytest.raises(Forbidden):
        db.run_write(
            partial(
                ni.record_renewal, node_id="n1", old_serial="de01", serial="de02", not_after=LATER
            )
        )
    with db.read() as s:
        assert s.get(NodeCertRow, "de02") is None


def test_a_certificate_recorded_while_a_revocation_ran_is_refused_by_its_trust_epoch(
    db: Database,
) -> None:
    """The row of a renewal that committed after the revoke had listed the node's serials
    (as it may under READ COMMITTED): not revoked by serial, refused by the node's epoch;
    a rejoin's certificate is accepted again, the old ones stay refused."""
    join(db, token(db, node_id="n1"), "n1", "df01")
    db.run_write(partial(ni.revoke_node, node_id="n1"))

    def late_renewal(s: Any) -> None:  # what the racing renewal left behind
        s.add(
            NodeCertRow(
                serial="df02",
                node_id="n1",
                issued_at=LATER,
                not_after=LATER,
                reason="renew",
                trust_epoch=0,
            )
        )

    db.run_write(late_renewal)
    assert not valid(db, "df02", "n1")
    join(db, token(db, node_id="n1"), "n1", "df03")
    assert valid(db, "df03", "n1")
    assert not valid(db, "df01", "n1") and not valid(db, "df02", "n1")
    db.run_write(
        partial(ni.record_renewal, node_id="n1", old_serial="df03", serial="df04", not_after=LATER)
    )
    assert valid(db, "df04", "n1")
    with pytest.raises(Forbidden):  # an older-epoch certificate cannot renew either
        db.run_write(
            partial(
                ni.record_renewal, node_id="n1", old_serial="df02", serial="df05", not_after=LATER
            )
        )


def test_check_join_token_reads_without_spending(db: Database) -> None:
    secret = token(db, node_id="n1")
    with db.read() as s:
        ni.check_join_token(s, secret=secret, node_id="n1")
        with pytest.raises(Unauthenticated):
            ni.check_join_token(s, secret="nope", node_id="n1")
        with pytest.raises(Forbidden):
            ni.check_join_token(s, secret=secret, node_id="n2")
    join(db, secret, "n1", "dg01")  # still usable after the check
    with db.read() as s, pytest.raises(Unauthenticated):
        ni.check_join_token(s, secret=secret, node_id="n1")


def test_forget_refuses_while_gpus_are_reserved_then_removes_the_node(db: Database) -> None:
    create_team(db)
    create_node(db, "n1", gpus=4)
    join(db, token(db, node_id="n1"), "n1", "ee01")
    epoch = become_leader(db)
    job = submit(db, gpus=2).job_id
    r = reserve(db, job, "n1", 2, epoch=epoch)
    with pytest.raises(Conflict, match="reserved"):
        db.run_write(partial(ni.forget_node, node_id="n1"))
    assert valid(db, "ee01", "n1")
    runs.complete_run(
        db,
        ObjectStore("memory://"),
        runs.Report("n1", r.run_id, r.token, runs.Outcome.NEVER_STARTED, 0, ""),
    )
    assert db.run_write(partial(ni.forget_node, node_id="n1")) == 1
    assert not valid(db, "ee01", "n1")
    with db.read() as s:
        assert s.get(NodeCapacityRow, "n1") is None
        assert s.get(NodeRow, "n1") is not None  # its attempt still names it
    assert check_database(db)[1] == []
    [row] = [r for r in _describe(db) if r["node_id"] == "n1"]
    assert row["cert_serial"] is None and row["revoked_certs"] == 1


def test_forgetting_a_node_without_history_deletes_it(db: Database) -> None:
    create_team(db)
    create_node(db, "n2", gpus=1)
    db.run_write(partial(ni.forget_node, node_id="n2"))
    with db.read() as s:
        assert s.get(NodeRow, "n2") is None


def test_describe_lists_nodes_and_certificates(db: Database) -> None:
    create_team(db)
    create_node(db, "n1", gpus=1)
    join(db, token(db, node_id="n1"), "n1", "ff01")
    join(db, token(db), "n9", "ff09")  # joined, not registered yet
    rows = {r["node_id"]: r for r in _describe(db)}
    assert rows["n1"]["cert_serial"] == "ff01" and rows["n1"]["status"] == "HEALTHY"
    assert rows["n9"]["status"] == "FORGOTTEN" and rows["n9"]["address"] is None


def _describe(db: Database) -> list[dict[str, object]]:
    with db.read() as s:
        return ni.describe_nodes(s)


class TestRunsBelongToTheirNode:
    """A node confirms and reports only for runs placed on it (nothing changes otherwise)."""

    def _placed(self, db: Database) -> tuple[str, allocate.Reserved]:
        create_team(db)
        create_node(db, "n1", gpus=2)
        create_node(db, "n2", gpus=2)
        epoch = become_leader(db)
        job = submit(db, gpus=1).job_id
        return job, reserve(db, job, "n2", 1, epoch=epoch)

    def test_confirm_for_a_run_on_another_node_is_forbidden(self, db: Database) -> None:
        _, r = self._placed(db)
        with pytest.raises(Forbidden, match="not placed on node 'n1'"):
            db.run_write(lambda s: runs.confirm_assignment(s, r.run_id, r.token, node_id="n1"))
        with db.read() as s:
            assert s.get(JobRunRow, r.run_id).status == "ASSIGNED"
        assert (
            db.run_write(lambda s: runs.confirm_assignment(s, r.run_id, r.token, node_id="n2"))
            == runs.Confirm.CONFIRMED
        )

    def test_report_for_a_run_on_another_node_is_forbidden(self, db: Database) -> None:
        job, r = self._placed(db)
        forged = runs.Report("n1", r.run_id, r.token, runs.Outcome.EXITED, 1, "")
        with pytest.raises(Forbidden):
            runs.complete_run(db, ObjectStore("memory://"), forged)
        with db.read() as s:
            assert s.get(JobRow, job).status == "SCHEDULED"
            assert s.get(JobRunRow, r.run_id).status == "ASSIGNED"
            assert s.get(NodeCapacityRow, "n2").available_gpus == 1


def test_forgetting_a_live_node_needs_force(db: Database) -> None:
    """A node that sent a heartbeat within the window looks alive: 409 unless forced; an old
    heartbeat, or all certificates revoked (it can no longer call in), needs no force."""
    create_team(db)
    create_node(db, "n1", gpus=1)
    join(db, token(db, node_id="n1"), "n1", "ab01")
    with pytest.raises(Conflict, match=r"n1 \(HEALTHY\).*looks alive.*--force") as exc:
        db.run_write(partial(ni.forget_node, node_id="n1", live_within_s=30))
    assert exc.value.field == "force"
    assert valid(db, "ab01", "n1")
    assert db.run_write(partial(ni.forget_node, node_id="n1", live_within_s=30, force=True)) == 1
    create_node(db, "n2", gpus=1)
    with db.write_tx() as s:
        s.execute(
            update(NodeRow)
            .where(NodeRow.id == "n2")
            .values(last_heartbeat_at=datetime.now(UTC) - timedelta(hours=1))
        )
    db.run_write(partial(ni.forget_node, node_id="n2", live_within_s=30))
    create_node(db, "n3", gpus=1)
    join(db, token(db, node_id="n3"), "n3", "ab03")
    db.run_write(partial(ni.revoke_node, node_id="n3"))
    db.run_write(partial(ni.forget_node, node_id="n3", live_within_s=30))
    with db.read() as s:
        assert s.get(NodeCapacityRow, "n3") is None


def test_reserved_gpus_that_can_never_be_reported_gone_point_to_fence(db: Database) -> None:
    create_team(db)
    epoch = become_leader(db)
    for node_id in ("n1", "n2", "n3"):
        create_node(db, node_id, gpus=2)
        join(db, token(db, node_id=node_id), node_id, f"ac0{node_id[-1]}")
        reserve(db, submit(db, gpus=2).job_id, node_id, 2, epoch=epoch)
    with pytest.raises(Conflict, match="drain it") as live:
        db.run_write(partial(ni.forget_node, node_id="n1"))
    assert "confirm-dead" not in live.value.message
    db.run_write(partial(ni.revoke_node, node_id="n2"))  # revoking fences the node
    with pytest.raises(Conflict, match=r"FENCED.*admin node fence n2 --confirm-dead"):
        db.run_write(partial(ni.forget_node, node_id="n2"))
    with db.write_tx() as s:  # as the upkeep loop leaves a node that stopped answering
        s.execute(update(NodeRow).where(NodeRow.id == "n3").values(status="QUARANTINED"))
    with pytest.raises(Conflict, match=r"QUARANTINED.*admin node fence n3 --confirm-dead"):
        db.run_write(partial(ni.forget_node, node_id="n3", force=True))


class TestKeptStateProblem:
    """Issue 24, item 11: a rejoin is told from a re-install by what the agent's state dir
    holds (pure)."""

    ACTIVE: ClassVar[dict[str, int]] = {"r1": 3, "r2": 5}

    @pytest.mark.parametrize(
        ("agent_epoch", "known", "held", "want_keep", "want_problem"),
        [
            pytest.param(2, 2, {"r1": 3, "r2": 5}, {"r1", "r2"}, None, id="state kept, all held"),
            pytest.param(
                3, 2, {"r1": 3}, {"r1"}, "does not hold", id="an attempt never delivered"
            ),
            pytest.param(2, 2, {"r1": 2, "r2": 5}, {"r2"}, "does not hold", id="an older token"),
            pytest.param(0, 2, {"r1": 3, "r2": 5}, set(), "no agent state", id="wiped state"),
            pytest.param(1, 2, {"r1": 3, "r2": 5}, set(), "older agent state", id="old copy"),
        ],
    )
    def test_verdict(
        self,
        agent_epoch: int,
        known: int,
        held: dict[str, int],
        want_keep: set[str],
        want_problem: str | None,
    ) -> None:
        from gpufleet.services.node_fence import kept_state_problem

        got = kept_state_problem(
            agent_epoch=agent_epoch, known_epoch=known, held=held, active=self.ACTIVE
        )
        assert got.keep == want_keep
        assert got.lost == (not want_keep)
        if want_problem is None:
            assert got.problem is None
        else:
            assert got.problem is not None and want_problem in got.problem


def test_a_rejoin_keeps_the_attempts_its_agent_holds_and_fences_the_rest(db: Database) -> None:
    create_team(db)
    create_node(db, "n1", gpus=4)
    join(db, token(db, node_id="n1"), "n1", "ab01")
    db.run_write(lambda s: update_epoch(s, "n1", 2))  # its agent registered twice since
    epoch = become_leader(db)
    held = reserve(db, submit(db, gpus=1).job_id, "n1", 1, epoch=epoch)
    lost = reserve(db, submit(db, gpus=1).job_id, "n1", 1, epoch=epoch)
    db.run_write(
        partial(
            ni.join,
            secret=token(db, node_id="n1"),
            node_id="n1",
            serial="ab02",
            not_after=LATER,
            agent_epoch=2,
            held={held.run_id: held.token},
        )
    )
    with db.read() as s:
        assert s.get(JobRunRow, held.run_id).status == "ASSIGNED"  # type: ignore[union-attr]
        assert s.get(JobRunRow, lost.run_id).status == "FENCED"  # type: ignore[union-attr]
        assert s.get(NodeRow, "n1").agent_epoch == 2  # type: ignore[union-attr]
    # the same rejoin from a wiped state dir (agent epoch 0) fences what is left
    join(db, token(db, node_id="n1"), "n1", "ab03")
    with db.read() as s:
        assert s.get(JobRunRow, held.run_id).status == "FENCED"  # type: ignore[union-attr]
        assert s.get(NodeRow, "n1").agent_epoch == 0  # type: ignore[union-attr]
    assert check_database(db)[1] == []


def update_epoch(s: Any, node_id: str, epoch: int) -> None:
    s.execute(update(NodeRow).where(NodeRow.id == node_id).values(agent_epoch=epoch))
