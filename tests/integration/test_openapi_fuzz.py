"""schemathesis fuzzes every operation of the REST API from its own OpenAPI document (with
an admin token, on SQLite): no 5xx, every answer's status code and body declared by the
document. Bounded: ``FUZZ_EXAMPLES`` examples per operation."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gpufleet.api.app import AppState, create_app
from gpufleet.objectstore import ObjectStore
from gpufleet.queue import InProcWaker
from gpufleet.services import auth
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.migrate import migrate
from tests.factories import create_node

FUZZ_EXAMPLES = int(os.environ.get("GPUFLEET_FUZZ_EXAMPLES", "40"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
TOKEN: dict[str, str] = {}
SEEN: defaultdict[str, Counter[int]] = defaultdict(Counter)


# The app is built at import (no database access: /openapi.json needs none) so that
# schemathesis can read the document at collection; the database is migrated and seeded by
# the fixture below, before the first request.
_TMP = Path(tempfile.mkdtemp(prefix="gpufleet-fuzz-"))
_DB = Database(f"sqlite:///{_TMP / 'gpufleet.db'}")
_APP = create_app(
    AppState(Settings(data_dir=_TMP), _DB, InProcWaker(), ObjectStore(str(_TMP / "objects")))
)
schema = schemathesis.openapi.from_asgi("/openapi.json", _APP)


@pytest.fixture(scope="module", autouse=True)
def seeded() -> Iterator[None]:
    migrate(_DB)
    TOKEN["admin"] = _DB.run_write(
        lambda s: auth.create_token(s, "ops", is_admin=True, create_team_if_missing=True)
    )
    create_node(_DB, "n1", gpus=8)
    yield
    _DB.dispose()
    shutil.rmtree(_TMP, ignore_errors=True)


@schema.parametrize()
@settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_api_conforms_to_its_openapi_document(case: Any) -> None:
    if case.query and str(case.query.get("follow", "")).lower() in ("true", "1"):
        case.query["follow"] = "false"  # following streams until the job ends
    response = case.call_and_validate(
        headers={"Authorization": f"Bearer {TOKEN['admin']}"}, checks=CHECKS
    )
    SEEN[f"{case.method} {case.path}"][response.status_code] += 1


def test_the_fuzzing_reached_the_handlers() -> None:
    """Guards the fuzz run itself (runs after it: same module, file order): the token worked
    and valid inputs were generated, not only 401s and 422s."""
    print({op: dict(codes) for op, codes in SEEN.items()})
    assert not any(codes[401] for codes in SEEN.values())
    assert SEEN["POST /v1/jobs"][201] > 0 and SEEN["GET /v1/jobs"][200] > 0
