"""The leader lease: one row, a holder, a monotonic epoch and an expiry on the database clock.

A controller acquires the lease (epoch + 1) when it is free or expired, renews it while it
holds it, and every scheduling write re-checks ``(holder, epoch)`` inside its own transaction
(:func:`assert_leader`), so a paused or partitioned old leader cannot commit (seed DD6).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from gpufleet.domain.errors import NotLeader
from gpufleet.store.dialect import db_now
from gpufleet.store.tables import LeaderLeaseRow
from gpufleet.store.transitions import record_event

LEASE_NAME = "scheduler"


def try_acquire(session: Session, holder: str, lease_s: float) -> int | None:
    """Take or renew the lease for ``holder``; returns the epoch held, or None if another
    holder's lease is still valid. A takeover (new holder or expired lease) bumps the epoch."""
    return acquire(session, holder, lease_s)[0]


def acquire(session: Session, holder: str, lease_s: float) -> tuple[int | None, datetime]:
    """:func:`try_acquire`, also returning the database clock it read (the instant a new
    leader starts to listen: ``controller.leadership.Leadership.listening_since``)."""
    now = db_now(session)
    return _acquire_at(session, holder, lease_s, now), now


def _acquire_at(session: Session, holder: str, lease_s: float, now: datetime) -> int | None:
    row = session.execute(
        select(LeaderLeaseRow).where(LeaderLeaseRow.name == LEASE_NAME).with_for_update()
    ).scalar_one_or_none()
    expires = now + timedelta(seconds=lease_s)
    if row is None:
        # the first lease ever: two controllers starting together may both find no row (there
        # is nothing to lock yet); the primary key lets one insert win and the other follow
        try:
            with session.begin_nested():
                session.add(
                    LeaderLeaseRow(name=LEASE_NAME, holder=holder, epoch=1, expires_at=expires)
                )
                session.flush()
        except IntegrityError:
            return None
        record_event(session, "leader", now=now, message=f"{holder} became leader (epoch 1)")
        return 1
    if row.holder == holder and row.expires_at > now:
        row.expires_at = expires
        return row.epoch
    if row.expires_at > now:
        return None
    row.holder, row.epoch, row.expires_at = holder, row.epoch + 1, expires
    record_event(session, "leader", now=now, message=f"{holder} became leader (epoch {row.epoch})")
    return row.epoch


def assert_leader(session: Session, holder: str, epoch: int, now: datetime | None = None) -> None:
    """Raise NotLeader unless ``holder`` holds an unexpired lease at ``epoch`` (at ``now``,
    the database clock read in this transaction). Called inside every scheduling write
    transaction; on PostgreSQL the row is share-locked until commit, so a takeover cannot
    interleave with the write."""
    row = session.execute(
        select(LeaderLeaseRow.holder, LeaderLeaseRow.epoch, LeaderLeaseRow.expires_at)
        .where(LeaderLeaseRow.name == LEASE_NAME)
        .with_for_update(read=True)
    ).first()
    if row is None or row.holder != holder or row.epoch != epoch:
        raise NotLeader(f"not leader at epoch {epoch} (lease: {row and (row.holder, row.epoch)})")
    if row.expires_at <= (now if now is not None else db_now(session)):
        raise NotLeader(f"leader lease of epoch {epoch} expired")


def current_epoch(session: Session) -> int:
    """The epoch of the latest lease (0 if none was ever taken). Answered to agents by every
    controller replica, leader or standby, so that agents know whom to believe."""
    epoch = session.execute(
        select(LeaderLeaseRow.epoch).where(LeaderLeaseRow.name == LEASE_NAME)
    ).scalar_one_or_none()
    return int(epoch or 0)


def release(session: Session, holder: str) -> None:
    """Give the lease up at once (clean shutdown) so a successor need not wait for expiry."""
    now = db_now(session)
    session.execute(
        update(LeaderLeaseRow)
        .where(LeaderLeaseRow.name == LEASE_NAME, LeaderLeaseRow.holder == holder)
        .values(expires_at=now)
    )
