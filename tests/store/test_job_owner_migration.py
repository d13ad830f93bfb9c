"""Migration 0011a gives every token a user (its name when that is a valid user name, else
its id) and every job its submitting token's user as ``owner``; downgrade drops both."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from sqlalchemy import inspect, text

from gpufleet.store.db import Database
from gpufleet.store.migrate import alembic_config


def _run(db: Database, fn: str, rev: str) -> None:
    cfg = alembic_config()
    with db.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        getattr(command, fn)(cfg, rev)


def _job(conn: object, job_id: str, token: str | None) -> None:
    conn.execute(  # type: ignore[attr-defined]
        text(
            "INSERT INTO jobs (id, team_id, name, idempotency_key, payload_sha256, spec,"
            " priority, priority_rank, gpu_count, status, cancel_requested, fencing_epoch,"
            " attempts, submitted_by, held, gated, created_at, queued_at) VALUES (:id, 'a',"
            " '', :id, 'x', '{}', 'NORMAL', 2, 1, 'PENDING', 0, 0, 0, :tok, 0, 0,"
            " '2026-12-01 00:00:00', '2026-12-01 00:00:00')"
        ),
        {"id": job_id, "tok": token},
    )


def test_tokens_get_users_and_jobs_their_owner(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'g.db'}")
    _run(db, "upgrade", "0010g")
    with db.engine.begin() as conn:
        conn.execute(
            text("INSERT INTO teams (id, weight, guaranteed_gpus, lending_limit_gpus,"
                 " usage_gpu_s, created_at) VALUES ('a', 1, '{}', '{}', 0, '2026-12-01')")
        )  # fmt: skip
        for tid, name in (("tok-1", "alice"), ("tok-2", "CI bot (nightly)"), ("tok-3", "")):
            conn.execute(
                text("INSERT INTO api_tokens (id, team_id, token_sha256, name, is_admin,"
                     " created_at) VALUES (:id, 'a', :id, :name, 0, '2026-12-01')"),
                {"id": tid, "name": name},
            )  # fmt: skip
        _job(conn, "j-1", "tok-1")
        _job(conn, "j-2", "tok-2")
        _job(conn, "j-3", None)
    _run(db, "upgrade", "0011a")
    with db.engine.connect() as conn:
        users = dict(conn.execute(text("SELECT id, user_name FROM api_tokens")).all())
        owners = dict(conn.execute(text("SELECT id, owner FROM jobs")).all())
    assert users == {"tok-1": "alice", "tok-2": "tok-2", "tok-3": "tok-3"}
    assert owners == {"j-1": "alice", "j-2": "tok-2", "j-3": None}
    _run(db, "downgrade", "0010g")
    cols = {c["name"] for c in inspect(db.engine).get_columns("jobs")}
    assert "owner" not in cols
    db.dispose()
