from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.multihost.fleet import FAST_SETTINGS, MultiHostFleet


@pytest.fixture(scope="module")
def mh_fleet(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MultiHostFleet]:
    """One multi-host fleet per test module (tests/multihost/fleet.py): starting it takes
    most of a minute, so a module's scenarios share it and each leaves it healthy. The work
    dir is outside pytest's 0700 tmp (PostgreSQL runs as its own user); process logs are
    copied to pytest's tmp dir at the end and removed with the rest otherwise. A module's
    ``MULTIHOST_SETTINGS`` (``GPUFLEET_*`` -> value) go over :data:`FAST_SETTINGS`."""
    assert os.geteuid() == 0, "the multi-host harness needs root (network namespaces)"
    work = Path(tempfile.mkdtemp(prefix="gfmh-"))
    extra = dict(getattr(request.module, "MULTIHOST_SETTINGS", {}))
    fleet = MultiHostFleet(work, settings=FAST_SETTINGS | extra)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()
        if fleet.logs.exists():
            shutil.copytree(
                fleet.logs, tmp_path_factory.mktemp("multihost-logs"), dirs_exist_ok=True
            )
        if os.environ.get("GPUFLEET_KEEP_MULTIHOST") != "1":
            shutil.rmtree(work, ignore_errors=True)
