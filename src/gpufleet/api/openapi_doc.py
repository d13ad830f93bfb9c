"""The API document, made to match the server, and its viewers served locally.

FastAPI's generated document is adjusted in one place (:func:`install_openapi`):

- a bearer security scheme (``Authorization: Bearer <token>``) on every operation but
  ``/healthz``, instead of an optional ``authorization`` header parameter;
- ``Idempotency-Key`` required on ``POST /v1/jobs`` (the server answers 422 without it);
- every error answer is ``ErrorOut`` (``{error, message, field}``); FastAPI's own
  ``HTTPValidationError`` body is never sent (the one handler maps validation errors), so it
  is not documented;
- ``/healthz`` needs no token, so it documents no 401/422;
- every read under ``/v1`` documents 429 (the team's read bucket).

Swagger UI (``/docs``) and Redoc (``/redoc``) load their scripts from ``/docs-assets/``
(``api/docs_assets``, vendored with their licenses), never from a CDN: they work on an
air-gapped cluster.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

ASSETS = Path(__file__).parent / "docs_assets"
ASSETS_URL = "/docs-assets"
BEARER = "bearerAuth"
IDEMPOTENCY_KEY = {
    "name": "Idempotency-Key",
    "in": "header",
    "required": True,
    "description": "Any unique string (e.g. a uuid4), 1-256 characters: a retried submit with"
    " the same key and payload returns the same job (200, Idempotent-Replayed: true); the"
    " same key with another payload is 409.",
    "schema": {"type": "string", "minLength": 1, "maxLength": 256},
}


def mount_docs(app: FastAPI) -> None:
    """Serve the vendored assets and the two documentation pages."""
    app.mount(ASSETS_URL, StaticFiles(directory=ASSETS), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def swagger_ui() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title="gpufleet API",
            swagger_js_url=f"{ASSETS_URL}/swagger-ui/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS_URL}/swagger-ui/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS_URL}/swagger-ui/favicon-32x32.png",
        )

    @app.get("/redoc", include_in_schema=False)
    def redoc() -> HTMLResponse:
        return get_redoc_html(
            openapi_url="/openapi.json",
            title="gpufleet API",
            redoc_js_url=f"{ASSETS_URL}/redoc/redoc.standalone.js",
            redoc_favicon_url=f"{ASSETS_URL}/swagger-ui/favicon-32x32.png",
            with_google_fonts=False,
        )


def install_openapi(app: FastAPI) -> None:
    """Replace ``app.openapi`` by one that returns the adjusted document (built once)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(
                title=app.title,
                version=app.version,
                description=app.description,
                routes=app.routes,
            )
            app.openapi_schema = adjust(doc)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def adjust(doc: dict[str, Any]) -> dict[str, Any]:
    """The changes listed in the module docstring, applied to ``doc`` in place."""
    comps = doc.setdefault("components", {})
    comps.setdefault("securitySchemes", {})[BEARER] = {
        "type": "http",
        "scheme": "bearer",
        "description": "An API token (`gft_...`): `gpufleet up` prints an admin one;"
        " `gpufleet admin token create --team T` makes more. The team comes from the token.",
    }
    doc["security"] = [{BEARER: []}]
    error_ref = {"$ref": "#/components/schemas/ErrorOut"}
    for path, ops in doc.get("paths", {}).items():
        for method, op in ops.items():
            params = [
                p
                for p in op.get("parameters", [])
                if not (p.get("in") == "header" and p["name"].lower() == "authorization")
            ]
            if method == "post" and path == "/v1/jobs":
                params = [p for p in params if p["name"].lower() != "idempotency-key"]
                params.insert(0, dict(IDEMPOTENCY_KEY))
            if params:
                op["parameters"] = params
            else:
                op.pop("parameters", None)
            if method in ("get", "head") and path.startswith("/v1/"):
                # every read takes from the team's read bucket (api.app.principal)
                op.setdefault("responses", {}).setdefault(
                    "429",
                    {
                        "description": "Over the team's read rate (`field`: read_rate_per_s);"
                        " see Retry-After"
                    },
                )
            for status, resp in op.get("responses", {}).items():
                if status.startswith(("4", "5")):
                    resp["content"] = {"application/json": {"schema": error_ref}}
            if path == "/healthz":
                op["security"] = []
                for status in ("401", "422"):
                    op["responses"].pop(status, None)
    schemas = comps.get("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    return doc
