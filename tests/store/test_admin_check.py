"""`gpufleet admin check` on a real database: clean -> exit 0; a corrupted row -> exit 1."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import update
from typer.testing import CliRunner

from gpufleet.cli.main import app
from gpufleet.store.db import Database
from gpufleet.store.migrate import migrate
from gpufleet.store.tables import NodeCapacityRow
from tests.factories import create_node


def test_admin_check_exit_code_follows_the_invariants(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'gpufleet.db'}")
    migrate(db)
    create_node(db, "n1", gpus=8)
    runner = CliRunner()
    ok = runner.invoke(app, ["admin", "check", "--data-dir", str(tmp_path)])
    assert ok.exit_code == 0, ok.output
    assert "no violations" in ok.output
    db.run_write(lambda s: s.execute(update(NodeCapacityRow).values(available_gpus=5)))
    bad = runner.invoke(app, ["admin", "check", "--data-dir", str(tmp_path)])
    assert bad.exit_code == 1
    assert "invariant 1 [n1]" in bad.output
