"""Arrays are named like jobs everywhere (a new-user trial found them full-id only): a full
array id, a unique id prefix (the ``a-`` may be left out) or the name the array was submitted
with, in ``GET /v1/arrays/{id}``, ``GET /v1/jobs?array_id=``, ``POST /v1/jobs/cancel``'s
``array_id`` and ``depends_on``; and the CLI commands on top (``array``, ``list --array``,
``cancel --array``). An array that does not exist is the same 404 naming ``array_id``
everywhere (CLI: ``error: no array ...``, exit 2), never an empty page or "no job matched".

Over ASGI on both databases; the CLI runs in-process with its HTTP calls sent to the same app.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import typer
from fastapi.testclient import TestClient
from typer.testing import CliRunner

from gpufleet.api.app import AppState, create_app
from gpufleet.cli import session
from gpufleet.cli.client import register_client_commands
from gpufleet.objectstore import ObjectStore
from gpufleet.queue import InProcWaker
from gpufleet.services import auth
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from tests.factories import create_node


@dataclass
class Fleet:
    http: TestClient
    token: str
    other: str
    older: str
    """An array named ``sweep``, submitted first."""
    newer: str
    """Another array named ``sweep``, submitted after: the one the name means."""
    lone: str
    """An array named ``lone``."""

    def get(self, path: str, token: str | None = None, **params: Any) -> httpx.Response:
        return self.http.get(path, params=params, headers=_auth(token or self.token))

    def post(self, path: str, body: Any, token: str | None = None) -> httpx.Response:
        return self.http.post(path, json=body, headers=_auth(token or self.token))


def _auth(token: str, key: str | None = None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", **({"Idempotency-Key": key} if key else {})}


@pytest.fixture
def fleet(db: Database, tmp_path: Path) -> Iterator[Fleet]:
    settings = Settings(data_dir=tmp_path)
    app = create_app(AppState(settings, db, InProcWaker(), ObjectStore(str(tmp_path / "objs"))))
    token, other = (
        db.run_write(lambda s, t=team: (auth.create_team(s, t), auth.create_token(s, t))[1])
        for team in ("vision", "nlp")
    )
    create_node(db, "n1", gpus=8)
    with TestClient(app, raise_server_exceptions=False) as http:

        def array(name: str, key: str) -> str:
            body = {"command": ["true"], "gpu_count": 1, "name": name, "array": "0-3"}
            r = http.post("/v1/jobs", json=body, headers=_auth(token, key))
            assert r.status_code == 201, r.text
            return str(r.json()["array_id"])

        older, newer, lone = array("sweep", "k1"), array("sweep", "k2"), array("lone", "k3")
        yield Fleet(http, token, other, older, newer, lone)


def _prefix(array_id: str) -> str:
    """A unique prefix of ``array_id``: ids of one millisecond share their first 12
    characters after ``a-``; the rest is random."""
    return array_id[:20]


def refs(f: Fleet) -> list[tuple[str, str]]:
    """(reference, the array it names)."""
    return [
        (f.lone, f.lone),
        (_prefix(f.lone), f.lone),
        (_prefix(f.lone)[2:].upper(), f.lone),  # no a-, any case
        ("lone", f.lone),
        ("sweep", f.newer),  # the newest array of that name
        (_prefix(f.older), f.older),
    ]


class TestRest:
    def test_array_route_resolves_prefixes_and_names(self, fleet: Fleet) -> None:
        for ref, want in refs(fleet):
            r = fleet.get(f"/v1/arrays/{ref}")
            assert r.status_code == 200, (ref, r.text)
            assert r.json()["array_id"] == want and len(r.json()["tasks"]) == 4

    def test_list_filter_resolves_prefixes_and_names(self, fleet: Fleet) -> None:
        for ref, want in refs(fleet):
            r = fleet.get("/v1/jobs", array_id=ref)
            assert r.status_code == 200, (ref, r.text)
            assert {j["array_id"] for j in r.json()["items"]} == {want}
            assert len(r.json()["items"]) == 4

    def test_bulk_cancel_resolves_a_prefix(self, fleet: Fleet) -> None:
        r = fleet.post("/v1/jobs/cancel", {"array_id": _prefix(fleet.lone), "dry_run": True})
        assert r.status_code == 200, r.text
        assert len(r.json()["cancelled"]) == 4
        r = fleet.post("/v1/jobs/cancel", {"array_id": "sweep"})
        assert r.status_code == 200, r.text
        cancelled = {c["job_id"] for c in r.json()["cancelled"]}
        tasks = fleet.get(f"/v1/arrays/{fleet.newer}").json()["tasks"]
        assert cancelled == {t["job_id"] for t in tasks}  # the newest "sweep" only
        assert fleet.get(f"/v1/arrays/{fleet.older}").json()["counts"] == {"PENDING": 4}

    def test_depends_on_takes_an_array_prefix(self, fleet: Fleet) -> None:
        body = {"command": ["true"], "depends_on": f"afterok:{_prefix(fleet.lone)}"}
        r = fleet.http.post("/v1/jobs", json=body, headers=_auth(fleet.token, "dep"))
        assert r.status_code == 201, r.text
        job = fleet.get(f"/v1/jobs/{r.json()['job_id']}").json()
        tasks = fleet.get(f"/v1/arrays/{fleet.lone}").json()["tasks"]
        assert [d["job_id"] for d in job["depends_on"]] == [t["job_id"] for t in tasks]

    @pytest.mark.parametrize(
        "ref",
        [
            pytest.param("a-nope", id="too short to be a prefix"),
            pytest.param("a-zzzzzzzzzzzz", id="a prefix of nothing"),
            pytest.param("a-" + "z" * 26, id="a full id of nothing"),
            pytest.param("nosuchname", id="a name of nothing"),
        ],
    )
    def test_an_unknown_array_is_the_same_404_everywhere(self, fleet: Fleet, ref: str) -> None:
        answers = {
            "GET /v1/arrays": fleet.get(f"/v1/arrays/{ref}"),
            "GET /v1/jobs": fleet.get("/v1/jobs", array_id=ref),
            "POST /v1/jobs/cancel": fleet.post("/v1/jobs/cancel", {"array_id": ref}),
            "dry run": fleet.post("/v1/jobs/cancel", {"array_id": ref, "dry_run": True}),
        }
        for route, r in answers.items():
            assert r.status_code == 404, (route, r.text)
            assert r.json()["field"] == "array_id", route
            assert f"no array {ref!r}" in r.json()["message"], route

    def test_another_teams_array_is_not_found(self, fleet: Fleet) -> None:
        for ref in (fleet.lone, _prefix(fleet.lone), "lone"):
            assert fleet.get(f"/v1/arrays/{ref}", token=fleet.other).status_code == 404
            assert fleet.get("/v1/jobs", token=fleet.other, array_id=ref).status_code == 404

    def test_an_ambiguous_prefix_is_422_listing_the_arrays(self, fleet: Fleet) -> None:
        shared = next(
            fleet.older[:n]
            for n in range(len(fleet.older), 5, -1)
            if fleet.newer.startswith(fleet.older[:n]) and fleet.lone.startswith(fleet.older[:n])
        )  # the three arrays were made within seconds: a shared time prefix
        for r in (
            fleet.get(f"/v1/arrays/{shared}"),
            fleet.get("/v1/jobs", array_id=shared),
            fleet.post("/v1/jobs/cancel", {"array_id": shared}),
        ):
            assert r.status_code == 422, r.text
            body = r.json()
            assert body["error"] == "ambiguous_array_ref" and body["field"] == "array_id"
            assert fleet.older in body["message"] and fleet.newer in body["message"]


@pytest.fixture
def cli(fleet: Fleet, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """``cli(*args)``: the client CLI in-process, its HTTP calls answered by the app."""

    def forward(request: httpx.Request) -> httpx.Response:
        r = fleet.http.request(
            request.method,
            request.url.raw_path.decode(),
            headers={k: v for k, v in request.headers.items() if k.lower() != "host"},
            content=request.content,
        )
        return httpx.Response(r.status_code, headers=r.headers, content=r.content)

    real = session.make_http_client
    monkeypatch.setattr(
        session, "make_http_client", lambda cfg: real(cfg, transport=httpx.MockTransport(forward))
    )
    monkeypatch.setenv("GPUFLEET_CONFIG", str(tmp_path / "absent.yaml"))
    monkeypatch.setenv("GPUFLEET_TOKEN", fleet.token)
    monkeypatch.setenv("GPUFLEET_URL", "http://fleet.test")
    monkeypatch.setenv("COLUMNS", "250")

    def run(*args: str) -> Any:
        app = typer.Typer()
        register_client_commands(app)
        result = CliRunner().invoke(app, list(args))
        assert "Traceback" not in result.output + result.stderr
        return result

    return run


class TestCli:
    def test_array_and_list_by_prefix_and_name(self, fleet: Fleet, cli: Any) -> None:
        for ref, want in refs(fleet):
            r = cli("array", ref, "-o", "json")
            assert r.exit_code == 0, (ref, r.output)
            assert f'"array_id": "{want}"' in r.stdout
            r = cli("list", "--array", ref, "-o", "json")
            assert r.exit_code == 0, (ref, r.output)
            assert r.stdout.count(f'"array_id": "{want}"') == 4

    def test_the_table_names_the_array_by_its_full_id(self, fleet: Fleet, cli: Any) -> None:
        """`gpufleet array <prefix>` printed the prefix typed back as the array's id."""
        for ref, want in refs(fleet):
            r = cli("array", ref)
            assert r.exit_code == 0, (ref, r.output)
            assert r.stdout.startswith(f"array {want}: 4 tasks"), r.stdout

    def test_cancel_by_a_long_array_name(self, fleet: Fleet, cli: Any) -> None:
        """A bulk cancel's array_id was limited to 64 characters (a name may have 256)."""
        r = cli("cancel", "--array", "x" * 200, "--yes")
        assert r.exit_code == 2 and "no array" in r.stderr, r.output

    def test_cancel_by_array_prefix(self, fleet: Fleet, cli: Any) -> None:
        r = cli("cancel", "--array", _prefix(fleet.lone), "--yes")
        assert r.exit_code == 0, r.output
        assert r.stdout.count("cancel requested:") == 4
        assert fleet.get(f"/v1/arrays/{fleet.lone}").json()["counts"] == {"CANCELLED": 4}

    @pytest.mark.parametrize(
        "args",
        [
            pytest.param(["array", "a-nope"], id="array"),
            pytest.param(["list", "--array", "a-nope"], id="list --array"),
            pytest.param(["cancel", "--array", "a-nope", "--yes"], id="cancel --array --yes"),
            pytest.param(["cancel", "--array", "a-nope"], id="cancel --array (asks)"),
        ],
    )
    def test_an_unknown_array_is_one_error_exit_2(self, cli: Any, args: list[str]) -> None:
        r = cli(*args)
        assert r.exit_code == 2, r.output
        assert "no array 'a-nope'" in r.stderr and "array_id" in r.stderr
        assert "no job matched" not in r.output and r.stdout == ""


class TestSdk:
    def test_array_of_a_plain_submit_or_an_empty_reference_is_refused(self) -> None:
        from gpufleet.client import Client
        from gpufleet.client.models import Submitted

        with Client("http://fleet.invalid", "t0ken") as client:
            plain = Submitted("j-1", "PENDING", replayed=False, idempotency_key="k", raw={})
            with pytest.raises(ValueError, match="not submitted as an array"):
                client.array(plain)  # was GET /v1/arrays/None
            with pytest.raises(ValueError, match="must not be empty"):
                client.array(" ")

    def test_list_with_an_empty_array_is_a_404_not_every_job(self, fleet: Fleet, cli: Any) -> None:
        r = cli("list", "--array", "", "-o", "json")  # the CLI refuses it before asking
        assert r.exit_code == 2 and "must not be empty" in r.stderr, r.output
        assert fleet.get("/v1/jobs", array_id="").status_code == 404  # and the API too


class TestNamesInPaths:
    """A job or array name holding ``?``, ``#``, ``%`` or a space went into URL paths as it
    was (SDK and CLI), so the request reached another path or none; it is percent-encoded."""

    NAME = "lr?0.1#b 5%"  # (not "%20": the test client decodes a path twice)

    def _sdk(self, fleet: Fleet) -> Any:
        from gpufleet.client import Client

        def forward(request: httpx.Request) -> httpx.Response:
            r = fleet.http.request(
                request.method, request.url.raw_path.decode(), headers=dict(request.headers)
            )
            return httpx.Response(r.status_code, headers=r.headers, content=r.content)

        http = httpx.Client(
            transport=httpx.MockTransport(forward),
            base_url="http://fleet.test",
            headers={"Authorization": f"Bearer {fleet.token}"},
        )
        return Client(http=http)

    def test_a_job_and_an_array_are_found_by_such_a_name(self, fleet: Fleet, cli: Any) -> None:
        body = {"command": ["true"], "gpu_count": 1, "name": self.NAME}
        job = fleet.http.post("/v1/jobs", json=body, headers=_auth(fleet.token, "kq"))
        assert job.status_code == 201, job.text
        job_id = job.json()["job_id"]
        r = cli("status", self.NAME, "-o", "json")
        assert r.exit_code == 0 and f'"job_id": "{job_id}"' in r.stdout, r.output
        r = cli("why", self.NAME, "-o", "json")
        assert r.exit_code == 0 and job_id in r.stdout, r.output
        assert self._sdk(fleet).get(self.NAME).job_id == job_id
        arr = {**body, "name": self.NAME + "!", "array": "0-1"}
        made = fleet.http.post("/v1/jobs", json=arr, headers=_auth(fleet.token, "kq2"))
        assert made.status_code == 201, made.text
        info = self._sdk(fleet).array(self.NAME + "!")
        assert info.array_id == made.json()["array_id"]
