"""node identity: join tokens and node certificates (mutual TLS between controller and agents)

Revision ID: 0004a
Revises: 0003
Create Date: 2026-11-30 13:30:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004a"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "join_tokens",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("token_sha256", sa.String(length=64), nullable=False),
        sa.Column("node_id", sa.String(length=128), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("used_by", sa.String(length=128), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_join_tokens")),
        sa.UniqueConstraint("token_sha256", name=op.f("uq_join_tokens_token_sha256")),
    )
    op.create_table(
        "node_certs",
        sa.Column("serial", sa.String(length=40), nullable=False),
        sa.Column("node_id", sa.String(length=128), nullable=False),
        sa.Column("issued_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("not_after", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("reason", sa.String(length=32), nullable=False),
        sa.PrimaryKeyConstraint("serial", name=op.f("pk_node_certs")),
    )
    op.create_index("ix_node_certs_node", "node_certs", ["node_id"], unique=False)


def downgrade() -> None:
    op.drop_index("ix_node_certs_node", table_name="node_certs")
    op.drop_table("node_certs")
    op.drop_table("join_tokens")
