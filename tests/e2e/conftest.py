from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import Fleet


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fleet]:
    """A running platform (controller + API) on SQLite or PostgreSQL; agents are started by
    the test."""
    url = None
    if request.param == "postgres":
        from gpufleet.store.db import Database
        from tests.conftest import _empty

        url = request.getfixturevalue("pg_url")
        db = Database(url)
        _empty(db)
        db.dispose()
    f = Fleet(tmp_path, url).start()
    try:
        yield f
    finally:
        f.stop()
