"""Schema migrations: one Alembic chain for both databases.

``gpufleet admin migrate`` applies it (:func:`migrate`); ``gpufleet server`` and ``gpufleet
controller`` only check it (:func:`check_schema`) unless started with ``--migrate``;
``gpufleet up``/``demo`` (the embedded platform) migrate by themselves. See
docs/operations/upgrade.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError

from gpufleet.store import dialect
from gpufleet.store.db import Database

MIGRATIONS_DIR = Path(__file__).parent / "migrations"
MIGRATE_COMMAND = "gpufleet admin migrate"


class SchemaMismatch(RuntimeError):
    """The database's schema revision is not the one this code was written for (older:
    not migrated yet; newer: migrated by a newer gpufleet; or a revision this code does not
    know). ``str(exc)`` is one line naming what to run."""


@dataclass(frozen=True, slots=True)
class SchemaState:
    """Where a database's schema stands against this code.

    Attributes:
        current: the revision stamped in ``alembic_version``; None for an empty database.
        head: the newest revision this code knows.
        pending: revisions :func:`migrate` would apply to reach ``head``, oldest first;
            empty when up to date or when ``current`` is unknown.
        known: whether this code knows ``current`` (False: a newer gpufleet migrated it).
    """

    current: str | None
    head: str
    pending: tuple[str, ...]
    known: bool

    @property
    def up_to_date(self) -> bool:
        return self.known and self.current == self.head


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    return cfg


def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(alembic_config())


def head_revision() -> str:
    """The newest revision of this code's chain (e.g. ``"0008c"``)."""
    head = _script().get_current_head()
    assert head is not None
    return head


def schema_state(db: Database) -> SchemaState:
    """Read the database's revision and compare it with this code's chain (reads only)."""
    script = _script()
    head = script.get_current_head()
    assert head is not None
    with db.engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
    known = current is None or _known(script, current)
    pending: tuple[str, ...] = ()
    if known and current != head:
        # iterate_revisions walks from head down to (not including) current
        pending = tuple(
            rev.revision for rev in reversed(list(script.iterate_revisions(head, current)))
        )
    return SchemaState(current=current, head=head, pending=pending, known=known)


def _known(script: ScriptDirectory, rev: str) -> bool:
    try:
        return script.get_revision(rev) is not None
    except CommandError:
        return False


def check_schema(db: Database, *, allow_newer: bool = False) -> SchemaState:
    """Refuse a database whose schema is not this code's head.

    Args:
        allow_newer: accept a revision this code does not know (a newer gpufleet migrated
            the database): for running the previous release beside the new one during a
            rolling upgrade, when the new release's migrations are additive.

    Raises:
        SchemaMismatch: empty or older schema (run ``gpufleet admin migrate``), or a newer /
            unknown one (unless ``allow_newer``).
    """
    state = schema_state(db)
    if state.up_to_date or (allow_newer and not state.known):
        return state
    if state.current is None:
        raise SchemaMismatch(
            f"the database has no gpufleet schema (this gpufleet needs revision {state.head}):"
            f" run `{MIGRATE_COMMAND}` first (or start `gpufleet server`/`controller`"
            " with --migrate)"
        )
    if state.known:
        raise SchemaMismatch(
            f"the database schema is at revision {state.current}, older than this gpufleet's "
            f"{state.head} ({len(state.pending)} migration(s) pending): run "
            f"`{MIGRATE_COMMAND}` first (or start `gpufleet server`/`controller` with --migrate)"
        )
    raise SchemaMismatch(
        f"the database schema is at revision {state.current}, which this gpufleet (newest "
        f"revision {state.head}) does not know: a newer gpufleet migrated it; run that "
        "version (or start this `gpufleet server`/`controller` with --allow-newer-schema if "
        "the newer release's migrations are additive)"
    )


def migrate(db: Database, to: str = "head") -> tuple[str | None, str | None]:
    """Upgrade (or, with an older ``to``, downgrade) the schema to revision ``to``.
    Idempotent; serialized across processes (PostgreSQL advisory lock). Each run is one
    transaction on PostgreSQL (all or nothing).

    Returns:
        (revision before, revision after); None = empty database.

    Raises:
        SchemaMismatch: the database is at a revision this code does not know, or ``to`` is
            not a revision of this code's chain.
    """
    state = schema_state(db)
    if not state.known:
        raise SchemaMismatch(
            f"the database schema is at revision {state.current}, which this gpufleet (newest "
            f"revision {state.head}) does not know: a newer gpufleet migrated it; migrate "
            "with that version"
        )
    script = _script()
    if to not in ("head", "base") and not _known(script, to):
        raise SchemaMismatch(f"unknown revision {to!r} (this gpufleet knows up to {state.head})")
    target = state.head if to == "head" else to
    if target == state.current:
        return state.current, state.current
    cfg = alembic_config()
    with db.engine.connect() as conn, dialect.migration_lock(conn):
        if conn.in_transaction():
            conn.commit()
        with conn.begin():
            cfg.attributes["connection"] = conn
            current = MigrationContext.configure(conn).get_current_revision()
            if current is not None and (target == "base" or _is_ancestor(script, target, current)):
                command.downgrade(cfg, target)
            else:
                command.upgrade(cfg, target)
    after = schema_state(db).current
    return state.current, after


def _is_ancestor(script: ScriptDirectory, older: str, newer: str) -> bool:
    """Whether ``older`` comes before ``newer`` in the chain (a downgrade target)."""
    return any(rev.revision == older for rev in script.iterate_revisions(newer, "base"))
