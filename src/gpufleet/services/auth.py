"""Teams and API tokens. Tokens are random, shown once, stored as sha256."""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpufleet.domain.errors import Conflict, NotFound, Unauthenticated, ValidationFailed
from gpufleet.domain.ids import new_id
from gpufleet.store.dialect import db_now, insert_if_absent
from gpufleet.store.tables import ApiTokenRow, TeamRow

TEAM_NAME = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
USER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]{0,63}$")
"""A token's user (a job's owner): 1-64 of letters, digits and ``_ . @ + -`` (a login name
or an e-mail address), starting with a letter or digit."""


def check_user_name(user: str, field: str = "user") -> str:
    """``user`` if it is a valid user name; else raises ValidationFailed naming ``field``."""
    if not USER_NAME.match(user):
        raise ValidationFailed(
            f"user {user!r}: use 1-64 of letters, digits and _ . @ + - (starting with a"
            " letter or digit)",
            field=field,
        )
    return user


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: the team from the token, whether it is an admin token, and the user
    the token stands for (the owner of the jobs it submits)."""

    team_id: str
    is_admin: bool
    token_id: str
    user: str = ""


def _hash(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def create_team(
    session: Session, name: str, *, weight: float = 1.0, exist_ok: bool = False
) -> str:
    """Create team ``name``; returns it. Safe against concurrent creates of the same name
    (exactly one creates it). Raises ValidationFailed for a bad name, Conflict (HTTP 409) if
    it exists (unless ``exist_ok``)."""
    if not TEAM_NAME.match(name):
        raise ValidationFailed(
            f"team name {name!r}: use 1-64 of a-z 0-9 _ . - (starting with a letter or digit)",
            field="name",
        )
    if weight <= 0:
        raise ValidationFailed("weight must be > 0", field="weight")
    # one INSERT ... ON CONFLICT DO NOTHING, not a read and then an insert: twelve admins
    # creating one team at once get one "created" and eleven 409s (or, with ``exist_ok``,
    # eleven "already there"), never a unique violation (HTTP 500)
    created = insert_if_absent(
        session,
        TeamRow.__table__,
        {
            "id": name,
            "weight": weight,
            "guaranteed_gpus": {},
            "lending_limit_gpus": {},
            "created_at": db_now(session),
        },
    )
    if not created and not exist_ok:
        raise Conflict(f"team {name!r} already exists", field="name")
    return name


def create_token(
    session: Session,
    team_id: str,
    *,
    name: str = "",
    is_admin: bool = False,
    create_team_if_missing: bool = False,
    user: str | None = None,
) -> str:
    """Create an API token for ``team_id``; returns the raw token (shown once). ``user``: the
    person it stands for (the owner of the jobs it submits); None: the token's ``name`` when
    that is a valid user name, else the token's id. Raises ValidationFailed (field ``team``,
    the message lists the known teams) for an unknown team unless ``create_team_if_missing``,
    and (field ``user``) for a bad user name."""
    if user is not None:
        check_user_name(user)
    if create_team_if_missing:
        create_team(session, team_id, exist_ok=True)
    if not TEAM_NAME.match(team_id) or session.get(TeamRow, team_id) is None:
        known = list(session.scalars(select(TeamRow.id).order_by(TeamRow.id).limit(21)))
        listed = ", ".join(known[:20]) + (", ..." if len(known) > 20 else "")
        raise ValidationFailed(
            f"no team {team_id!r} (known teams: {listed or 'none'}); create it first"
            " (`gpufleet admin team create`, or `token create --create-team`)",
            field="team",
        )
    raw = "gft_" + secrets.token_urlsafe(32)
    token_id = new_id("tok")
    if user is None:
        user = name if USER_NAME.match(name) else token_id
    session.add(
        ApiTokenRow(
            id=token_id,
            team_id=team_id,
            token_sha256=_hash(raw),
            name=name,
            user_name=user,
            is_admin=is_admin,
            created_at=db_now(session),
        )
    )
    session.flush()
    return raw


def authenticate(session: Session, raw: str | None) -> Principal:
    """The principal of a raw bearer token. Raises Unauthenticated."""
    if not raw:
        raise Unauthenticated("missing bearer token (Authorization: Bearer <token>)")
    row = session.execute(
        select(ApiTokenRow).where(ApiTokenRow.token_sha256 == _hash(raw))
    ).scalar_one_or_none()
    if row is None or row.revoked_at is not None:
        raise Unauthenticated("invalid or revoked token")
    return Principal(
        team_id=row.team_id, is_admin=row.is_admin, token_id=row.id, user=row.user_name
    )


def describe_token(row: ApiTokenRow) -> dict[str, Any]:
    """A token as operators see it: never the token or its hash."""
    return {
        "id": row.id,
        "team": row.team_id,
        "name": row.name,
        "user": row.user_name,
        "admin": row.is_admin,
        "created_at": _iso(row.created_at),
        "revoked_at": _iso(row.revoked_at),
    }


def list_tokens(
    session: Session, team_id: str | None = None, include_revoked: bool = True
) -> list[dict[str, Any]]:
    """Tokens (oldest first), of one team or all, as :func:`describe_token` shows them."""
    if team_id is not None and not TEAM_NAME.match(team_id):
        return []  # no team has such a name (and odd bytes never reach the database)
    q = select(ApiTokenRow).order_by(ApiTokenRow.created_at, ApiTokenRow.id)
    if team_id is not None:
        q = q.where(ApiTokenRow.team_id == team_id)
    if not include_revoked:
        q = q.where(ApiTokenRow.revoked_at.is_(None))
    return [describe_token(r) for r in session.scalars(q)]


def revoke_token(session: Session, token_id: str) -> dict[str, Any]:
    """Revoke token ``token_id`` (idempotent: a revoked token keeps its first ``revoked_at``).
    API servers refuse it within ``PRINCIPAL_TTL_S`` (api.app). Raises NotFound."""
    shaped = 0 < len(token_id) <= 64 and "\x00" not in token_id
    row = session.get(ApiTokenRow, token_id, with_for_update=True) if shaped else None
    if row is None:
        raise NotFound(f"no token {token_id!r}", field="token_id")
    if row.revoked_at is None:
        row.revoked_at = db_now(session)
        session.flush()
    return describe_token(row)


def _iso(ts: Any) -> str | None:
    return ts.isoformat().replace("+00:00", "Z") if ts else None
