"""Node identity on the control plane: join tokens, the node certificates the controller
signed, revocation, and forgetting a node (``docs/design/security.md``).

A node's identity is its certificate (CN = node id), checked on every call against
``node_certs``: listed, unrevoked, for the node it names, and of the node's current trust
epoch (``node_trust``: revoke, forget and join raise it, so a certificate issued before or
while a revocation ran is refused whatever its serial). Join tokens are random secrets,
stored as sha256, used at most once, and expire.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import delete, exists, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpufleet.domain.errors import Conflict, Forbidden, Unauthenticated, ValidationFailed
from gpufleet.domain.ids import new_id
from gpufleet.domain.states import RUN_ACTIVE, NodeStatus
from gpufleet.rpc.join import hash_secret
from gpufleet.rpc.pki import check_node_id
from gpufleet.services import nodes
from gpufleet.services.job_admission import forget_fleet_shapes
from gpufleet.services.job_queries import iso
from gpufleet.services.node_lookup import is_cut_off, no_node, refuse_if_alive
from gpufleet.store import allocate
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import (
    JobRunRow,
    JoinTokenRow,
    NodeCapacityRow,
    NodeCertRow,
    NodeRow,
    NodeTrustRow,
    ReservationRow,
)
from gpufleet.store.transitions import record_event

JOIN_TTL_DEFAULT_S = 15 * 60
JOIN_TTL_MAX_S = 7 * 86400


def validate_node_id(node_id: str) -> None:
    try:
        check_node_id(node_id)
    except ValueError as exc:
        raise ValidationFailed(str(exc), field="node_id") from None


def create_join_token(
    session: Session, *, node_id: str | None = None, ttl_s: float = JOIN_TTL_DEFAULT_S
) -> tuple[str, datetime]:
    """A new join token secret (shown once; stored hashed) and its expiry (UTC).

    ``node_id``: the only id it may join as (needed to rejoin an existing node); None = any
    id not yet in use. ``ttl_s``: 10 s .. 7 days.

    Raises:
        ValidationFailed: bad node id or ttl.
    """
    if node_id is not None:
        validate_node_id(node_id)
    if not 10 <= ttl_s <= JOIN_TTL_MAX_S:
        raise ValidationFailed(
            f"ttl {ttl_s:g} s: use 10 s .. {JOIN_TTL_MAX_S // 86400} days", field="ttl"
        )
    now = db_now(session)
    secret = secrets.token_urlsafe(24)  # no "." in the alphabet: the token string splits on it
    expires = now + timedelta(seconds=ttl_s)
    session.add(
        JoinTokenRow(
            id=new_id("jt"),
            token_sha256=hash_secret(secret),
            node_id=node_id,
            created_at=now,
            expires_at=expires,
        )
    )
    session.flush()
    return secret, expires


def check_join_token(session: Session, *, secret: str, node_id: str, key_sha256: str = "") -> None:
    """Whether ``secret`` may join as ``node_id`` now (read only: the token is not spent).
    The join port calls it before it parses or signs anything, so a bad token costs one
    indexed read, no signature; :func:`join` checks again when it spends the token.

    Raises:
        Unauthenticated: unknown, used or expired token (one message for all three).
        Forbidden: the token is for another node id, or an unbound token names a node id
            that exists already (rejoining needs a token made with ``--node-id``).
        ValidationFailed: bad node id.
    """
    _usable_token(session, secret, node_id, db_now(session), key_sha256)


def _usable_token(
    session: Session, secret: str, node_id: str, now: datetime, key_sha256: str = ""
) -> JoinTokenRow:
    """The token row ``secret`` names, if it may join ``node_id`` now: unspent, or spent by
    this very join (same node id and key, ``key_sha256``) whose answer was lost."""
    validate_node_id(node_id)
    row = session.execute(
        select(JoinTokenRow).where(JoinTokenRow.token_sha256 == hash_secret(secret))
    ).scalar_one_or_none()
    if row is None or row.expires_at <= now:
        raise Unauthenticated("invalid, used or expired join token")
    if row.used_at is not None and not _is_repeat(row, node_id, key_sha256):
        raise Unauthenticated("invalid, used or expired join token")
    if row.used_at is not None:
        return row  # a repeat: the node id was checked when the token was spent
    if row.node_id is not None and row.node_id != node_id:
        raise Forbidden(f"this join token is for node {row.node_id!r}", field="node_id")
    if row.node_id is None and _node_known(session, node_id):
        raise Forbidden(
            f"node {node_id!r} exists; rejoin it with a token made for it "
            f"(gpufleet admin node join-token --node-id {node_id})",
            field="node_id",
        )
    return row


def _is_repeat(row: JoinTokenRow, node_id: str, key_sha256: str) -> bool:
    """Whether a join with a spent token is the spending join again: the agent retries a
    call that timed out with the same request (token, node id, CSR), so a first answer lost
    after the commit would otherwise leave the node with a spent token and no certificate.
    Only the holder of that key can use a certificate for it, so answering again gives
    nobody anything new."""
    return bool(key_sha256) and row.used_by == node_id and row.used_key_sha256 == key_sha256


def join(
    session: Session,
    *,
    secret: str,
    node_id: str,
    serial: str,
    not_after: datetime,
    agent_epoch: int = 0,
    held: Mapping[str, int] | None = None,
    key_sha256: str = "",
) -> None:
    """Spend a join token on ``node_id`` and record its new certificate, in one transaction.
    Older certificates of the node are revoked and its trust epoch goes up (a rejoin replaces
    a lost or stolen key: a renewal racing it from an older certificate is refused too; the
    new certificate carries the new epoch, so a revoked node is trusted again from it on).

    A rejoin is told from a re-install by what the agent says its state dir holds
    (``agent_epoch``: the epoch there, 0 = none; ``held``: run_id -> token of the attempts
    it has not seen reported; ``node_fence.kept_state_problem`` decides): an agent whose
    certificate merely expired while it was stopped keeps the attempts it holds (their
    processes ran on under their shims), and only the node's other active attempts are
    fenced; a re-installed node (no state) has them all fenced and its agent epoch restarts
    at 0 (its epoch counter starts again).

    ``key_sha256``: sha256 (hex) of the CSR's public key. The same join repeated (same token,
    node id and key, the token unexpired: the agent's call timed out after this commit) is
    answered with a certificate again, recorded under the trust epoch the first one got;
    nothing is revoked or fenced again.

    Raises:
        Unauthenticated: unknown, used or expired token (one message for all three).
        Forbidden: the token is for another node id, or an unbound token names a node id
            that exists already (rejoining needs a token made with ``--node-id``).
        ValidationFailed: bad node id.
    """
    now = db_now(session)
    row = _usable_token(session, secret, node_id, now, key_sha256)
    if row.used_at is not None:  # the same join again (its first answer was lost)
        epoch = _trust_epoch(session, node_id, lock=True)
        first = session.execute(
            select(NodeCertRow)
            .where(NodeCertRow.node_id == node_id)
            .order_by(NodeCertRow.issued_at.desc())
            .limit(1)
        ).scalar_one_or_none()
        if first is None or first.revoked_at is not None or first.trust_epoch != epoch:
            # revoked, forgotten or rejoined since: the repeat must not outlive that
            raise Unauthenticated("invalid, used or expired join token")
        _record_join_cert(
            session,
            node_id,
            serial,
            not_after,
            epoch,
            now,
            "issued again: the join was repeated with the same key (its first answer did not "
            "reach the agent)",
        )
        return
    spent = session.execute(
        update(JoinTokenRow)
        .where(JoinTokenRow.id == row.id, JoinTokenRow.used_at.is_(None))
        .values(used_at=now, used_by=node_id, used_key_sha256=key_sha256 or None)
    ).rowcount  # type: ignore[attr-defined]
    if spent != 1:  # a concurrent join spent it first
        raise Unauthenticated("invalid, used or expired join token")
    epoch = _raise_trust_epoch(session, node_id, now, revocation=False)  # lock order: trust,
    revoked = _revoke(session, node_id, now)  # then certificates (as renewals and revoke)
    # a re-install (its state dir, and so its agent epoch counter, are gone) has the
    # attempts given to the old install fenced now (the new agent cannot know them), and its
    # first registration must not be refused as an old agent process; a rejoin with the
    # state kept keeps the attempts the agent holds
    node = session.get(NodeRow, node_id, with_for_update=True)
    kept = ""
    if node is not None:
        active: dict[str, int] = dict(
            session.execute(
                select(JobRunRow.id, JobRunRow.token).where(
                    JobRunRow.node_id == node_id, JobRunRow.status.in_(sorted(RUN_ACTIVE))
                )
            ).all()  # rows, not the Result: dict() would take its keys() for a mapping's
        )
        verdict = nodes.kept_state_problem(
            agent_epoch=agent_epoch, known_epoch=node.agent_epoch, held=held or {}, active=active
        )
        if verdict.problem is not None:
            nodes.fence_lost_agent_state(session, node, reason=verdict.problem, keep=verdict.keep)
        if verdict.lost:
            node.agent_epoch = 0
        else:
            kept = (
                f"; agent state kept (agent epoch {agent_epoch}),"
                f" {len(verdict.keep)} running attempt(s) kept"
            )
        if node.status == NodeStatus.FENCED:
            # an operator made this join token: the fenced (revoked) node is trusted again
            nodes.back_to_healthy(
                session,
                node_id,
                frm=NodeStatus.FENCED,
                now=now,
                message="rejoined with a new certificate",
            )
    _record_join_cert(
        session,
        node_id,
        serial,
        not_after,
        epoch,
        now,
        "issued on a join token"
        + (f"; {revoked} older certificate(s) revoked" if revoked else "")
        + kept,
    )


def _record_join_cert(
    session: Session,
    node_id: str,
    serial: str,
    not_after: datetime,
    trust_epoch: int,
    now: datetime,
    how: str,
) -> None:
    """Record a certificate a join bought, and the ``node_joined`` event saying ``how``."""
    session.add(
        NodeCertRow(
            serial=serial,
            node_id=node_id,
            issued_at=now,
            not_after=not_after,
            reason="join",
            trust_epoch=trust_epoch,
        )
    )
    record_event(
        session, "node_joined", now=now, node_id=node_id, message=f"certificate {serial} {how}"
    )


def record_renewal(
    session: Session, *, node_id: str, old_serial: str, serial: str, not_after: datetime
) -> None:
    """Record a renewed certificate (the old one stays valid until it expires). The renewed
    certificate ``old_serial`` is checked here, in the transaction that records the new one
    (its row and the node's trust row locked), never from a cache: a renewal that loses the
    race with a revocation is refused; one that wins it carries the old certificate's trust
    epoch, which the revocation then leaves behind (:func:`cert_is_valid`).

    Raises:
        Forbidden: ``old_serial`` is revoked, unknown, of another node or of an older trust
            epoch.
    """
    trust = _trust_epoch(session, node_id, lock=True)
    old = session.execute(
        select(NodeCertRow).where(NodeCertRow.serial == old_serial).with_for_update()
    ).scalar_one_or_none()
    if (
        old is None
        or old.node_id != node_id
        or old.revoked_at is not None
        or old.trust_epoch < trust
    ):
        raise Forbidden(f"certificate {old_serial} is revoked or unknown", field="certificate")
    session.add(
        NodeCertRow(
            serial=serial,
            node_id=node_id,
            issued_at=db_now(session),
            not_after=not_after,
            reason="renew",
            trust_epoch=old.trust_epoch,
        )
    )


def cert_is_valid(session: Session, serial: str, node_id: str) -> bool:
    """True when ``serial`` is a certificate signed for ``node_id``, not revoked, and of the
    node's current trust epoch (not issued before, nor renewed during, a revocation)."""
    row = session.execute(
        select(NodeCertRow.node_id, NodeCertRow.revoked_at, NodeCertRow.trust_epoch).where(
            NodeCertRow.serial == serial
        )
    ).first()
    if row is None or row.node_id != node_id or row.revoked_at is not None:
        return False
    return bool(row.trust_epoch >= _trust_epoch(session, node_id))


def revoke_node(session: Session, node_id: str, *, max_node_failures: int = 3) -> int:
    """Revoke every certificate of ``node_id``; its next call is refused. Returns how many
    were revoked. The node rejoins only with a new join token made for it.

    A revoked node is no longer trusted (revocation answers a stolen key or a compromised
    host), so in the same transaction it is FENCED: no new placements (the controller never
    dials it again, nor sends it another team's command and env), its active attempts are
    fenced and their jobs re-placed elsewhere with a higher token, and their GPUs stay
    QUARANTINED until an operator confirms the node dead (``gpufleet admin node fence NODE
    --confirm-dead``) or it rejoins and reports them gone.

    Raises:
        NotFound: no node (or a forgotten one) and no unrevoked certificate has this id.
    """
    if not _node_present(session, node_id):
        raise no_node(session, node_id)
    now = db_now(session)
    _raise_trust_epoch(session, node_id, now, revocation=True)
    n = _revoke(session, node_id, now)
    node = session.get(NodeRow, node_id, with_for_update=True)
    if node is not None and node.status != NodeStatus.FENCED:
        reason = "certificate revoked by an operator; rejoin it with a new join token"
        nodes.fence_node(
            session,
            node_id,
            reason=reason,
            max_node_failures=max_node_failures,
            node_to=NodeStatus.FENCED,
        )
        nodes.set_status_reason(session, node_id, reason)
    record_event(
        session, "node_revoked", now=now, node_id=node_id, message=f"{n} certificate(s) revoked"
    )
    return n


def forget_node(
    session: Session, node_id: str, *, force: bool = False, live_within_s: float = 0.0
) -> int:
    """Remove ``node_id`` from the fleet: certificates revoked, capacity rows deleted, the
    node row deleted when no attempt refers to it. Returns the number of certificates revoked.

    ``live_within_s``: a node whose heartbeat is younger than this (seconds), not FENCED and
    whose certificates are not all revoked looks alive; forgetting it needs ``force`` (its agent
    would keep running jobs the scheduler no longer sees). 0 = no such check.

    Raises:
        NotFound: unknown node, or one already forgotten (its certificates revoked).
        Conflict: the node looks alive (without ``force``); or GPUs of the node are reserved
            (the message says to drain it, or, when its agent can never report them gone,
            quarantined/fenced or its certificates revoked, to fence it with
            ``--confirm-dead``).
    """
    if not _node_present(session, node_id):
        raise no_node(session, node_id)
    now = db_now(session)
    node = session.get(NodeRow, node_id)
    cut_off = node is not None and is_cut_off(session, node)
    if not force and node is not None:
        refuse_if_alive(
            session,
            node,
            live_within_s,
            action="its agent would keep running jobs the scheduler no longer sees",
            force_hint="forget it anyway with --force (REST: ?force=true)",
        )
    try:
        allocate.remove_inventory(session, node_id)
    except Conflict:
        status = node.status if node is not None else None
        if cut_off or status in (NodeStatus.QUARANTINED, NodeStatus.FENCED):
            why = (
                f"it is {status}"
                if status in (NodeStatus.QUARANTINED, NodeStatus.FENCED)
                else ("its certificates are revoked")
            )
            raise Conflict(
                f"node {node_id} has reserved GPUs that its agent can never report gone "
                f"({why}); if the node is dead, release them with `gpufleet admin node "
                f"fence {node_id} --confirm-dead`, then forget it",
                field="node_id",
            ) from None
        raise
    _raise_trust_epoch(session, node_id, now, revocation=True)
    n = _revoke(session, node_id, now)
    referenced = session.execute(
        select(
            exists().where(JobRunRow.node_id == node_id)
            | exists().where(ReservationRow.node_id == node_id)
        )
    ).scalar_one()
    if not referenced:
        session.execute(delete(NodeRow).where(NodeRow.id == node_id))
    forget_fleet_shapes()
    record_event(
        session,
        "node_forgotten",
        now=now,
        node_id=node_id,
        message=f"forgotten by an operator; {n} certificate(s) revoked",
    )
    return n


def describe_nodes(session: Session) -> list[dict[str, Any]]:
    """Every node and every node id with a certificate: id, status, address, last heartbeat,
    the newest valid certificate (serial, expiry) and how many certificates are revoked (by
    serial, or by the node's trust epoch)."""
    nodes = {n.id: n for n in session.scalars(select(NodeRow))}
    epochs = {t.node_id: t.epoch for t in session.scalars(select(NodeTrustRow))}
    certs: dict[str, list[NodeCertRow]] = {}
    for c in session.scalars(select(NodeCertRow).order_by(NodeCertRow.issued_at)):
        certs.setdefault(c.node_id, []).append(c)
    out = []
    for node_id in sorted(set(nodes) | set(certs)):
        n = nodes.get(node_id)
        mine = certs.get(node_id, [])
        valid = [
            c for c in mine if c.revoked_at is None and c.trust_epoch >= epochs.get(node_id, 0)
        ]
        cur = valid[-1] if valid else None
        out.append(
            {
                "node_id": node_id,
                "status": n.status if n else "FORGOTTEN",
                "address": n.address if n else None,
                "last_heartbeat_at": iso(n.last_heartbeat_at) if n else None,
                "cert_serial": cur.serial if cur else None,
                "cert_not_after": iso(cur.not_after) if cur else None,
                "valid_certs": len(valid),
                "revoked_certs": len(mine) - len(valid),
            }
        )
    return out


def _node_known(session: Session, node_id: str) -> bool:
    """The id is in use: a node row (forgotten ones too: their attempts name it) or an
    unrevoked certificate. A join token for any id may not take it."""
    return bool(
        session.execute(
            select(
                exists().where(NodeRow.id == node_id)
                | exists().where(NodeCertRow.node_id == node_id, NodeCertRow.revoked_at.is_(None))
            )
        ).scalar_one()
    )


def _node_present(session: Session, node_id: str) -> bool:
    """What revoke and forget act on: a node of the fleet (its row with capacity; a forgotten
    node keeps only its row, see ``node_lookup``) or a node id with an unrevoked certificate
    (joined, not registered yet)."""
    return bool(
        session.execute(
            select(
                exists().where(NodeRow.id == node_id, NodeCapacityRow.node_id == NodeRow.id)
                | exists().where(NodeCertRow.node_id == node_id, NodeCertRow.revoked_at.is_(None))
            )
        ).scalar_one()
    )


def _revoke(session: Session, node_id: str, now: datetime) -> int:
    return int(
        session.execute(
            update(NodeCertRow)
            .where(NodeCertRow.node_id == node_id, NodeCertRow.revoked_at.is_(None))
            .values(revoked_at=now)
        ).rowcount  # type: ignore[attr-defined]
    )


def _trust_epoch(session: Session, node_id: str, *, lock: bool = False) -> int:
    """The node id's trust epoch (0 without a ``node_trust`` row); ``lock``: FOR UPDATE."""
    q = select(NodeTrustRow.epoch).where(NodeTrustRow.node_id == node_id)
    value = session.execute(q.with_for_update() if lock else q).scalar_one_or_none()
    return int(value or 0)


def _raise_trust_epoch(session: Session, node_id: str, now: datetime, *, revocation: bool) -> int:
    """Raise the node id's trust epoch by one (its row locked until this transaction ends)
    and return the new epoch: every certificate issued before, the ones a concurrent renewal
    records included, is refused from the commit on."""
    values: dict[str, object] = {"epoch": NodeTrustRow.epoch + 1, "updated_at": now}
    if revocation:
        values["revoked_at"] = now
    bumped = session.execute(
        update(NodeTrustRow).where(NodeTrustRow.node_id == node_id).values(**values)
    ).rowcount  # type: ignore[attr-defined]
    if not bumped:
        try:
            with session.begin_nested():  # two first revocations at once: one inserts
                session.add(
                    NodeTrustRow(
                        node_id=node_id,
                        epoch=1,
                        revoked_at=now if revocation else None,
                        updated_at=now,
                    )
                )
        except IntegrityError:
            session.execute(
                update(NodeTrustRow).where(NodeTrustRow.node_id == node_id).values(**values)
            )
    return int(
        session.execute(
            select(func.coalesce(NodeTrustRow.epoch, 0)).where(NodeTrustRow.node_id == node_id)
        ).scalar_one()
    )
