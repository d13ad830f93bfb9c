"""usage records (accounting), the submitting token of a job, Kueue lending limit

Revision ID: 0005u
Revises: 0005j
Create Date: 2026-11-30 16:30:00

- ``usage_records``: one durable row per ended attempt (team, token, job, run, GPU type,
  GPUs, start, end, GPU-seconds, outcome), written in the transaction that ends it.
- ``jobs.submitted_by``: the API token id that submitted the job.
- ``teams.lending_limit_gpus`` changes meaning: it was the part of the guarantee never lent;
  it is now Kueue's ``lendingLimit``, the most of the guarantee other teams may borrow. Each
  stored value is converted to ``guarantee - kept`` (the same behaviour as before).
"""

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005u"
down_revision: str | None = "0005j"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "usage_records",
        sa.Column("run_id", sa.String(length=40), nullable=False),
        sa.Column("job_id", sa.String(length=40), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("team_id", sa.String(length=64), nullable=False),
        sa.Column("token_id", sa.String(length=64), nullable=True),
        sa.Column("user", sa.String(length=128), nullable=False),
        sa.Column("node_id", sa.String(length=128), nullable=False),
        sa.Column("gpu_type", sa.String(length=64), nullable=False),
        sa.Column("gpus", sa.Integer(), nullable=False),
        sa.Column("start_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("end_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("gpu_seconds", sa.Float(), nullable=False),
        sa.Column("outcome", sa.String(length=16), nullable=False),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_usage_records")),
    )
    op.create_index("ix_usage_records_end_at", "usage_records", ["end_at"])
    op.create_index("ix_usage_records_team_end_at", "usage_records", ["team_id", "end_at"])
    op.create_index(op.f("ix_usage_records_job_id"), "usage_records", ["job_id"])
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("submitted_by", sa.String(length=64), nullable=True))
    _convert_lending_limits()


def downgrade() -> None:
    _convert_lending_limits()
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_column("submitted_by")
    op.drop_index(op.f("ix_usage_records_job_id"), table_name="usage_records")
    op.drop_index("ix_usage_records_team_end_at", table_name="usage_records")
    op.drop_index("ix_usage_records_end_at", table_name="usage_records")
    op.drop_table("usage_records")


def _convert_lending_limits() -> None:
    """``kept`` (never lent) <-> Kueue ``lendingLimit`` (most lent): ``guarantee - value``
    per GPU type; the conversion is its own inverse."""
    conn = op.get_bind()
    teams = sa.table(
        "teams",
        sa.column("id", sa.String),
        sa.column("guaranteed_gpus", sa.JSON),
        sa.column("lending_limit_gpus", sa.JSON),
    )
    for team_id, guaranteed, limits in conn.execute(
        sa.select(teams.c.id, teams.c.guaranteed_gpus, teams.c.lending_limit_gpus)
    ):
        guaranteed = _as_dict(guaranteed)
        limits = _as_dict(limits)
        if not limits:
            continue
        converted = {t: max(0, int(guaranteed.get(t, 0)) - int(v)) for t, v in limits.items()}
        conn.execute(
            sa.update(teams).where(teams.c.id == team_id).values(lending_limit_gpus=converted)
        )


def _as_dict(value: object) -> dict[str, int]:
    if isinstance(value, str):
        value = json.loads(value)
    return dict(value) if isinstance(value, dict) else {}
