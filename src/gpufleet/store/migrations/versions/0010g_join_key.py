"""the key a join token bought a certificate for

Revision ID: 0010g
Revises: 0009e
Create Date: 2026-12-02 16:40:00

``join_tokens.used_key_sha256``: sha256 (hex) of the public key (DER SubjectPublicKeyInfo)
of the CSR that spent the token. A join repeated by the same node with the same key while the
token is unexpired (its first answer was lost: the call timed out after the controller
committed) gets a certificate again instead of "used join token". NULL for tokens spent
before this migration (their repeats are refused, as before).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010g"
down_revision: str | None = "0009e"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("join_tokens", schema=None) as batch_op:
        batch_op.add_column(sa.Column("used_key_sha256", sa.String(64), nullable=True))


def downgrade() -> None:
    # not batch_alter_table (see 0009d): SQLite >= 3.35 drops a column in place
    op.drop_column("join_tokens", "used_key_sha256")
