"""Migration 0005u turns the stored ``lending_limit_gpus`` (the part never lent) into Kueue's
``lendingLimit`` (the most lent out): ``guarantee - kept``, so scheduling is unchanged; and
back on downgrade."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from sqlalchemy import text

from gpufleet.store.db import Database
from gpufleet.store.migrate import alembic_config


def _run(db: Database, fn: str, rev: str) -> None:
    cfg = alembic_config()
    with db.engine.begin() as conn:
        cfg.attributes["connection"] = conn
        getattr(command, fn)(cfg, rev)


def test_old_never_lent_values_become_kueue_lending_limits(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'g.db'}")
    _run(db, "upgrade", "0004c")
    with db.engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO teams (id, weight, guaranteed_gpus, lending_limit_gpus, usage_gpu_s,"
                " created_at) VALUES ('a', 1, :g, :k, 0, '2026-11-30 00:00:00')"
            ),
            {"g": '{"H100": 16, "A100": 4}', "k": '{"H100": 12}'},
        )
    _run(db, "upgrade", "head")
    with db.engine.connect() as conn:
        got = conn.execute(text("SELECT lending_limit_gpus FROM teams")).scalar_one()
    assert got in ('{"H100": 4}', {"H100": 4})  # 16 guaranteed, 12 kept -> at most 4 lent
    _run(db, "downgrade", "0004c")
    with db.engine.connect() as conn:
        back = conn.execute(text("SELECT lending_limit_gpus FROM teams")).scalar_one()
    assert back in ('{"H100": 12}', {"H100": 12})
    db.dispose()
