"""node-level revocation (a trust epoch per node id, and each certificate's epoch) and the
fleet CA's fingerprint recorded once per database

Revision ID: 0009e
Revises: 0009d
Create Date: 2026-12-02 05:00:00

``node_trust``: one row per node id that was ever revoked, rejoined or forgotten; ``epoch``
goes up by one at each of those, and a certificate is accepted only while its
``node_certs.trust_epoch`` is not below it. A renewal copies the epoch of the certificate it
renews, so a certificate renewed during (or racing) a revocation is refused whatever its
serial; a join records the new epoch, so a rejoined node's certificates are accepted again.
``fleet_facts``: key/value facts of the fleet, e.g. ``ca_sha256`` (the CA that signed every
certificate of this database), written by the first ``admin ca init`` or controller start.
``node_certs`` is watched by no change_seq trigger nor SQLite ``insert_rows`` view: the new
column is one ``ALTER TABLE``.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009e"
down_revision: str | None = "0009d"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("node_certs", schema=None) as batch_op:  # add_column: no rebuild
        batch_op.add_column(
            sa.Column("trust_epoch", sa.Integer(), nullable=False, server_default="0")
        )
    op.create_table(
        "node_trust",
        sa.Column("node_id", sa.String(length=128), nullable=False),
        sa.Column("epoch", sa.Integer(), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("node_id", name=op.f("pk_node_trust")),
    )
    op.create_table(
        "fleet_facts",
        sa.Column("key", sa.String(length=64), nullable=False),
        sa.Column("value", sa.String(length=512), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("key", name=op.f("pk_fleet_facts")),
    )


def downgrade() -> None:
    op.drop_table("fleet_facts")
    op.drop_table("node_trust")
    op.drop_column("node_certs", "trust_epoch")
