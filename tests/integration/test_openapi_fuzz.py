"""schemathesis fuzzes every operation of the REST API from its own OpenAPI document, with an
admin token, against a live ``gpufleet server`` process (real HTTP) on SQLite and on real
PostgreSQL: valid and invalid inputs, no 5xx, every answer's status code, content type and
body as the document declares (response conformance checks on). Bounded:
``GPUFLEET_FUZZ_EXAMPLES`` (default 25) examples per operation and generation mode."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gpufleet.services import auth
from gpufleet.store.db import Database
from gpufleet.store.migrate import migrate
from tests.conftest import PG_ADMIN_URL, _admin
from tests.factories import create_node, submit
from tests.integration.server_proc import ServerProcess

FUZZ_EXAMPLES = int(os.environ.get("GPUFLEET_FUZZ_EXAMPLES", "25"))
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


class Target:
    """A live server on one database. Nothing runs at import: :meth:`seed` migrates the
    database, makes an admin token, a node and a job, then starts ``gpufleet server`` and
    loads the document it serves."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.tmp = Path("/nonexistent")
        self.db: Database | None = None
        self.server: ServerProcess | None = None
        self.token = ""
        self.job_id = ""

    def seed(self) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix="gpufleet-fuzz-"))
        self.url = self.url.replace("{tmp}", str(self.tmp))
        self.db = db = Database(self.url)
        migrate(db)
        self.token = db.run_write(
            lambda s: auth.create_token(s, "ops", is_admin=True, create_team_if_missing=True)
        )
        create_node(db, "n1", gpus=8)
        self.job_id = submit(db, team="ops").job_id
        self.server = ServerProcess(
            self.tmp,
            {
                "GPUFLEET_DATABASE_URL": self.url,
                "GPUFLEET_REDIS_URL": "",
                # a fuzz run reads far faster than a team may (test_api_edge tests the limit)
                "GPUFLEET_TEAM_READ_RATE_PER_S": "0",
            },
        ).start()
        self.schema = schemathesis.openapi.from_url(f"{self.server.url}/openapi.json")

    def real_ids(self) -> dict[str, str]:
        # never the admin's own token id: revoking it would end the run
        return {"team_id": "ops", "job_id": self.job_id}

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.db is not None:
            self.db.dispose()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def fuzz(self) -> dict[str, Counter[int]]:
        """Every operation, valid and invalid inputs; raises the first failed check."""
        seen: dict[str, Counter[int]] = defaultdict(Counter)
        for result in self.schema.get_all_operations():
            operation = result.ok()
            # random ids mostly find nothing (404): also aim at objects that exist
            names = {p.name for p in operation.path_parameters}
            real = {k: v for k, v in self.real_ids().items() if k in names}
            cases = st.one_of(
                *(
                    operation.as_strategy(mode, path_parameters=fixed)
                    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)
                    for fixed in ([None, real] if real else [None])
                )
            )

            @given(case=cases)
            @settings(
                max_examples=FUZZ_EXAMPLES,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                derandomize=True,
                database=None,
            )
            def one(case: Any) -> None:
                if case.query and str(case.query.get("follow", "")).lower() in ("true", "1"):
                    case.query["follow"] = "false"  # following streams until the job ends
                response = case.call_and_validate(
                    headers={"Authorization": f"Bearer {self.token}"}, checks=CHECKS
                )
                seen[f"{case.method} {case.path}"][response.status_code] += 1

            one()
            # and one known-valid request each where generation may find none (strict fields
            # refuse 2.0 for an integer, so generated "valid" bodies are often 422): the
            # success answer is schema-checked on every run, not by luck
            valid = EXPLICIT.get(f"{operation.method.upper()} {operation.path}")
            if valid is not None:
                case = operation.Case(
                    body=valid["body"],
                    path_parameters=valid.get("path"),
                    headers={"Idempotency-Key": uuid.uuid4().hex},
                    media_type="application/json",
                )
                response = case.call_and_validate(
                    headers={"Authorization": f"Bearer {self.token}"}, checks=CHECKS
                )
                seen[f"{case.method} {case.path}"][response.status_code] += 1
        return seen


EXPLICIT: dict[str, dict[str, Any]] = {
    "POST /v1/jobs": {"body": {"command": ["python3", "-c", "pass"], "gpu_count": 1}},
    "PUT /v1/admin/teams/{team_id}": {"body": {"weight": 2.0}, "path": {"team_id": "ops"}},
}


SQLITE = Target("sqlite:///{tmp}/gpufleet.db")
PG_NAME = f"gpufleet_fuzz_{uuid.uuid4().hex[:10]}"
POSTGRES = Target(PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + PG_NAME)


@pytest.mark.parametrize(
    "target",
    [
        pytest.param(SQLITE, id="sqlite"),
        pytest.param(POSTGRES, id="postgres", marks=pytest.mark.postgres),
    ],
)
def test_api_conforms_to_its_openapi_document(target: Target) -> None:
    if target is POSTGRES:
        _admin(f'CREATE DATABASE "{PG_NAME}"')
    try:
        target.seed()
        seen = target.fuzz()
    finally:
        target.close()
        if target is POSTGRES:
            _admin(f'DROP DATABASE IF EXISTS "{PG_NAME}" WITH (FORCE)')
    print({op: dict(codes) for op, codes in seen.items()})
    # the run reached the handlers: the token worked and valid inputs were generated (401s
    # come from negative cases, which send a missing or broken Authorization header)
    assert seen["GET /v1/admin/teams"][200] > 0 and seen["GET /v1/usage"][200] > 0
    assert seen["POST /v1/jobs"][201] > 0 and seen["PUT /v1/admin/teams/{team_id}"][200] > 0
    assert seen["GET /v1/jobs/{job_id}"][200] > 0
    assert len(seen) >= 25
    # the documented error body is the real one, on a live server
    assert seen["POST /v1/jobs"][422] > 0
