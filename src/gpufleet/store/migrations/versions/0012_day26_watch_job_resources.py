"""watch a job's GPU count and spec: a PENDING job's GPUs may change (PATCH, issue 28)

Revision ID: 0012_day26
Revises: 0011e
Create Date: 2026-12-04 19:20:00

``PATCH /v1/jobs/{id}`` may change a PENDING job's ``gpu_count`` and acceptable GPU types
(``gpufleet update --gpus/--gpu-type``, what ``why --suggest`` proposes). The scheduler's
incremental snapshot (``store.snapshot_cache``) re-reads only rows whose ``change_seq``
moved, so the ``jobs`` update trigger (0006s) is created again watching ``gpu_count`` and
``spec`` too (``WATCHED``; PostgreSQL compares ``spec`` as text). No column is added.
"""

from collections.abc import Sequence
from importlib import import_module

from alembic import op

revision: str = "0012_day26"
down_revision: str | None = "0011e"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_change_seq = import_module("gpufleet.store.migrations.versions.0006s_change_seq")
_previous = import_module("gpufleet.store.migrations.versions.0008c_run_last_checkpoint")

WATCHED: dict[str, tuple[str, ...]] = {
    **_previous.WATCHED,
    "jobs": (*_previous.WATCHED["jobs"], "gpu_count", "spec"),
}
"""Per table, the columns whose change bumps ``change_seq``, as of this revision."""


def _jobs_update_trigger(watched: dict[str, tuple[str, ...]]) -> None:
    postgresql = op.get_bind().dialect.name == "postgresql"
    op.execute("DROP TRIGGER IF EXISTS jobs_change_seq_upd" + (" ON jobs" if postgresql else ""))
    op.execute(_change_seq.update_trigger_sql("jobs", watched["jobs"], postgresql=postgresql))


def upgrade() -> None:
    _jobs_update_trigger(WATCHED)


def downgrade() -> None:
    _jobs_update_trigger(_previous.WATCHED)
