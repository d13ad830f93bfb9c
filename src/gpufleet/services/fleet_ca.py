"""The fleet CA recorded with the database: one CA per fleet, so that no host forks it.

The first ``gpufleet admin ca init`` (or the first controller start, ``gpufleet up``
included) records the CA's sha256 in ``fleet_facts`` (key ``ca_sha256``). From then on a
controller whose CA is another one refuses to start, ``admin ca init`` refuses to make a
second one (unless ``--force-new-ca``: every node must then rejoin), and API servers that
hold no ``ca.crt`` still issue join tokens naming the right CA.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.orm import Session

from gpufleet.domain.errors import Conflict
from gpufleet.store.dialect import db_now, insert_if_absent
from gpufleet.store.tables import FleetFactRow

CA_KEY = "ca_sha256"


@dataclass(frozen=True, slots=True)
class RecordedCa:
    """The fleet CA's fingerprint (sha256, 64 hex digits) and when it was recorded (UTC)."""

    fingerprint: str
    recorded_at: datetime


def recorded_ca(session: Session) -> RecordedCa | None:
    """The CA recorded for this database, or None (none recorded yet)."""
    row = session.get(FleetFactRow, CA_KEY)
    return None if row is None else RecordedCa(row.value, row.recorded_at)


def mismatch_message(recorded: RecordedCa, fingerprint: str, where: str) -> str:
    return (
        f"the fleet CA of this database is sha256:{recorded.fingerprint} (recorded "
        f"{recorded.recorded_at:%Y-%m-%d %H:%M:%S}Z), but {where} is sha256:{fingerprint}: "
        "copy the fleet's pki directory from a controller host (controllers: ca.key and "
        "ca.crt; API hosts: ca.crt only, never ca.key; compare `gpufleet admin ca show` on "
        "both), or make this CA the fleet's with `gpufleet admin ca init --force-new-ca` "
        "(every node must then rejoin with a new join token)"
    )


def record_ca(session: Session, fingerprint: str, *, where: str, replace: bool = False) -> bool:
    """Record ``fingerprint`` as the fleet CA unless one is recorded already. Returns True
    when it was written (first record, or ``replace``).

    Raises:
        Conflict: another CA is recorded (and not ``replace``); field ``ca``; the message
            names both fingerprints and ``where`` (the one offered, e.g. "the CA in /x/pki").
    """
    now = db_now(session)
    # the first record: two controllers starting at once both find no row (there is nothing
    # to lock yet); ON CONFLICT lets one insert win and the other read the winner's below
    if insert_if_absent(
        session, FleetFactRow.__table__, {"key": CA_KEY, "value": fingerprint, "recorded_at": now}
    ):
        return True
    row = session.get(FleetFactRow, CA_KEY, with_for_update=True, populate_existing=True)
    assert row is not None  # inserted by another transaction, never deleted
    if row.value == fingerprint:
        return False
    if not replace:
        raise Conflict(
            mismatch_message(RecordedCa(row.value, row.recorded_at), fingerprint, where),
            field="ca",
        )
    row.value, row.recorded_at = fingerprint, now
    session.flush()
    return True


def join_token_ca(session: Session, ca_fingerprint: str | None, ca_path: str) -> str:
    """The CA fingerprint a new join token names: that of this host's ``ca.crt``
    (``ca_fingerprint``, None when the host has none), which must be the recorded fleet CA;
    else the recorded one (an API host needs no CA file at all once a controller started).

    Raises:
        Conflict: field ``pki_dir``: this host's ``ca.crt`` is not the recorded CA, or there
            is neither a ``ca.crt`` nor a recorded CA (the message says to copy ``ca.crt``
            from a controller host).
    """
    recorded = recorded_ca(session)
    if ca_fingerprint is not None:
        if recorded is not None and recorded.fingerprint != ca_fingerprint:
            raise Conflict(
                mismatch_message(recorded, ca_fingerprint, f"this host's {ca_path}"),
                field="pki_dir",
            )
        return ca_fingerprint
    if recorded is not None:
        return recorded.fingerprint
    raise Conflict(
        f"no fleet CA certificate at {ca_path} and none recorded in the database yet: copy "
        "ca.crt (never ca.key) from a controller host's pki dir to it (GPUFLEET_PKI_DIR), or "
        "start a controller first; run `gpufleet admin ca init` only to create a new "
        "fleet's first CA",
        field="pki_dir",
    )
