"""Alembic environment: runs on the connection handed over by ``store.migrate``."""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine

from gpufleet.store.tables import Base

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is None:  # `alembic` CLI use: take the URL from the ini / -x url=
        url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option(
            "sqlalchemy.url"
        )
        engine = create_engine(url)
        with engine.begin() as conn:
            _run(conn)
        return
    _run(connection)


def _run(connection) -> None:  # type: ignore[no-untyped-def]
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


run_migrations_online()
