"""job owner: the user a token stands for, recorded on the jobs it submits

Revision ID: 0011a
Revises: 0010g
Create Date: 2026-12-10 10:00:00

``api_tokens.user_name``: the person behind the token (``gpufleet admin token create --user``).
Existing tokens get their name when it is a valid user name (the name already served as
accounting's "user"), else their id. ``jobs.owner``: the submitting token's user, filled
for existing jobs from ``submitted_by``; NULL for jobs made outside the API. Index
``(team_id, owner, id)`` serves ``GET /v1/jobs?user=`` / ``?mine=true`` newest first.
"""

import re
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011a"
down_revision: str | None = "0010g"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# services.auth.USER_NAME at the time of writing (a migration keeps its own copy)
_USER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]{0,63}$")


def upgrade() -> None:
    # add_column: one ALTER TABLE on SQLite too (``jobs`` is not rebuilt, so its change_seq
    # triggers stay; the snapshot does not read ``owner``, so they need not watch it)
    with op.batch_alter_table("api_tokens", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("user_name", sa.String(64), nullable=False, server_default="")
        )
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("owner", sa.String(64), nullable=True))
    op.create_index("ix_jobs_team_id_owner", "jobs", ["team_id", "owner", "id"])
    conn = op.get_bind()
    tokens = sa.table(
        "api_tokens", sa.column("id", sa.String), sa.column("name", sa.String),
        sa.column("user_name", sa.String),
    )  # fmt: skip
    for tid, name in conn.execute(sa.select(tokens.c.id, tokens.c.name)).all():
        user = name if name and _USER_NAME.match(name) else tid
        conn.execute(sa.update(tokens).where(tokens.c.id == tid).values(user_name=user))
    # one statement: the owner of every job a token submitted (a correlated subquery works
    # on both databases)
    conn.execute(
        sa.text(
            "UPDATE jobs SET owner = (SELECT api_tokens.user_name FROM api_tokens"
            " WHERE api_tokens.id = jobs.submitted_by) WHERE submitted_by IS NOT NULL"
        )
    )


def downgrade() -> None:
    op.drop_index("ix_jobs_team_id_owner", table_name="jobs")
    # not batch_alter_table (see 0009d): SQLite >= 3.35 drops a column in place
    op.drop_column("jobs", "owner")
    op.drop_column("api_tokens", "user_name")
