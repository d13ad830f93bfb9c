"""The API document says what the server does, and its viewers need no network."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpufleet.api.app import AppState, create_app
from gpufleet.objectstore import ObjectStore
from gpufleet.queue import InProcWaker
from gpufleet.services import auth
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.migrate import migrate


@pytest.fixture
def client(tmp_path: Path) -> Iterator[tuple[TestClient, str]]:
    db = Database(f"sqlite:///{tmp_path / 'g.db'}")
    migrate(db)
    token = db.run_write(lambda s: auth.create_token(s, "vision", create_team_if_missing=True))
    app = create_app(
        AppState(Settings(data_dir=tmp_path), db, InProcWaker(), ObjectStore(str(tmp_path)))
    )
    with TestClient(app) as c:
        yield c, token
    db.dispose()


def test_docs_pages_load_their_assets_from_this_server(client) -> None:
    c, _ = client
    for page, asset in (
        ("/docs", "/docs-assets/swagger-ui/swagger-ui-bundle.js"),
        ("/redoc", "/docs-assets/redoc/redoc.standalone.js"),
    ):
        html = c.get(page).text
        assert asset in html and "cdn" not in html.lower() and "googleapis" not in html
        got = c.get(asset)
        assert got.status_code == 200 and len(got.content) > 100_000
    assert c.get("/docs-assets/swagger-ui/swagger-ui.css").status_code == 200
    assert c.get("/docs-assets/swagger-ui/LICENSE").status_code == 200


def test_the_document_matches_the_server(client) -> None:
    c, token = client
    doc = c.get("/openapi.json").json()
    assert doc["components"]["securitySchemes"]["bearerAuth"]["scheme"] == "bearer"
    submit = doc["paths"]["/v1/jobs"]["post"]
    (key,) = [p for p in submit["parameters"] if p["name"] == "Idempotency-Key"]
    assert key["required"] is True
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert not any(p["name"].lower() == "authorization" for p in op.get("parameters", []))
            for status, resp in op["responses"].items():
                if status.startswith("4"):
                    ref = resp["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/ErrorOut"), (path, status)
    logs = doc["paths"]["/v1/jobs/{job_id}/logs"]["get"]["responses"]["200"]["content"]
    assert list(logs) == ["text/plain"]
    # and the server does what it says: no key is a 422 with the real error body
    r = c.post(
        "/v1/jobs", json={"command": ["true"]}, headers={"Authorization": f"Bearer {token}"}
    )
    assert r.status_code == 422
    assert r.json() == {
        "error": "validation_error",
        "message": "the Idempotency-Key header is required",
        "field": "Idempotency-Key",
    }
