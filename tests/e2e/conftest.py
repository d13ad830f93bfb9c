from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import Fleet


def database_url_for(request: pytest.FixtureRequest) -> str | None:
    """None (SQLite in the fleet's data dir) or an emptied PostgreSQL database's URL."""
    if request.param != "postgres":
        return None
    from gpufleet.store.db import Database
    from tests.conftest import _empty

    url: str = request.getfixturevalue("pg_url")
    db = Database(url)
    _empty(db)
    db.dispose()
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def fleet(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Fleet]:
    """A running platform (controller + API) on SQLite or PostgreSQL; agents are started by
    the test. Settings overrides: a module's ``fleet_settings`` dict, then a test's
    ``@pytest.mark.fleet_settings(name=value, ...)``."""
    overrides: dict[str, Any] = dict(getattr(request.module, "fleet_settings", {}))
    marker = request.node.get_closest_marker("fleet_settings")
    if marker is not None:
        overrides.update(marker.kwargs)
    f = Fleet(tmp_path, database_url_for(request), **overrides).start()
    try:
        yield f
    finally:
        f.stop()
