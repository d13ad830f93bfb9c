"""Another team's job ids out of what a team token is shown.

Wait reasons, start estimates, suggestions and events are written by the scheduler for the
whole fleet: "held by running job j-...", "before the reserved 8-GPU job j-...". A team token
cannot see other teams' jobs (``status`` says no such job), so the API boundary replaces each
id of another team's job in those texts and details with a neutral phrase ("a running job of
another team"); admins see the ids. Ids of the caller's own team's jobs stay.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from gpufleet.store.tables import JobRow

JOB_ID = re.compile(r"\bj-[0-9a-z]{26}\b")
"""A full job id (``domain.ids.new_job_id``)."""

_IN_CONTEXT = re.compile(
    r"(?:\b(?:the|a) )?\b(?:(running|reserved|waiting|pending|queued) )?"
    r"(?:(\d+-GPU) )?\bjob(?:\(s\))? (j-[0-9a-z]{26})\b"
)
OTHER_TEAM = "a job of another team"


def job_ids_in(obj: Any, into: set[str] | None = None) -> set[str]:
    """Every full job id in the strings of ``obj`` (nested dicts, lists, tuples)."""
    out = set() if into is None else into
    if isinstance(obj, str):
        out.update(JOB_ID.findall(obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            job_ids_in(k, out)
            job_ids_in(v, out)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            job_ids_in(v, out)
    return out


def redact_text(text: str, foreign: set[str]) -> str:
    """``text`` with each id in ``foreign`` replaced: "running job ID" -> "a running job of
    another team", "the reserved 8-GPU job ID" -> "a reserved 8-GPU job of another team", a
    bare id -> "a job of another team"."""
    if not foreign or "j-" not in text:
        return text

    def phrase(m: re.Match[str]) -> str:
        adj, size, job_id = m.group(1), m.group(2), m.group(3)
        if job_id not in foreign:
            return m.group(0)
        words = [w for w in (adj, size) if w]
        return "a " + " ".join([*words, "job of another team"])

    text = _IN_CONTEXT.sub(phrase, text)
    return JOB_ID.sub(lambda m: OTHER_TEAM if m.group(0) in foreign else m.group(0), text)


def redact(obj: Any, foreign: set[str]) -> Any:
    """A copy of ``obj`` (str, dict, list, tuple, scalars) with the ``foreign`` ids replaced
    in every string (keys too)."""
    if not foreign:
        return obj
    if isinstance(obj, str):
        return redact_text(obj, foreign)
    if isinstance(obj, dict):
        return {redact(k, foreign): redact(v, foreign) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(redact(v, foreign) for v in obj)
    return obj


def foreign_job_ids(session: Session, team_id: str | None, ids: Iterable[str]) -> set[str]:
    """The ids among ``ids`` that are not jobs of ``team_id`` (another team's, or no job at
    all); empty for ``team_id`` None (an admin sees every id)."""
    wanted = set(ids)
    if team_id is None or not wanted:
        return set()
    own = set(
        session.scalars(
            select(JobRow.id).where(JobRow.id.in_(sorted(wanted)), JobRow.team_id == team_id)
        )
    )
    return wanted - own


def for_team(session: Session, team_id: str | None, obj: Any) -> Any:
    """``obj`` as ``team_id``'s token may see it: other teams' job ids replaced (see the
    module docstring); ``obj`` itself for an admin (``team_id`` None) or when it names none."""
    if team_id is None:
        return obj
    return redact(obj, foreign_job_ids(session, team_id, job_ids_in(obj)))
