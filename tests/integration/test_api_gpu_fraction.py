"""REST validation of GPU shares (``gpu_fraction``), on both databases: 422 naming the field,
the fleet's step setting, the fraction shown in the job detail and kept in the stored spec,
the CLI body built from --gpu-fraction and the SDK's body."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpufleet.api.app import AppState, create_app
from gpufleet.cli.submit import build_job_body
from gpufleet.client import _core
from gpufleet.objectstore import ObjectStore
from gpufleet.queue import InProcWaker
from gpufleet.services import auth
from gpufleet.services.jobs import forget_fleet_shapes
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.queries import resources_of
from gpufleet.store.tables import JobRow
from tests.factories import create_node

CMD = ["python3", "eval.py"]


def _api(
    db: Database, tmp_path: Path, sharing: str = "timeslice", **settings: object
) -> Iterator[tuple[TestClient, dict]]:
    app = create_app(
        AppState(
            Settings(data_dir=tmp_path, **settings),
            db,
            InProcWaker(),
            ObjectStore(str(tmp_path / "objects")),
        )
    )
    token = db.run_write(
        lambda s: (auth.create_team(s, "vision"), auth.create_token(s, "vision"))[1]
    )
    create_node(db, "n1", gpus=4, gpu_sharing=sharing)
    forget_fleet_shapes()
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, {"Authorization": f"Bearer {token}"}


@pytest.fixture
def api(db: Database, tmp_path: Path) -> Iterator[tuple[TestClient, dict]]:
    yield from _api(db, tmp_path)


def _spec(db: Database, job_id: str) -> dict:
    with db.read() as s:
        return dict(s.get(JobRow, job_id).spec)


def post(api, body: dict, key: str):
    client, auth_hdr = api
    return client.post("/v1/jobs", json=body, headers={**auth_hdr, "Idempotency-Key": key})


class TestFractionValidation:
    @pytest.mark.parametrize(
        ("body", "want_in_message"),
        [
            pytest.param({"gpu_fraction": 0}, "it must be above 0", id="zero"),
            pytest.param({"gpu_fraction": 1}, "it must be below 1", id="one whole GPU"),
            pytest.param({"gpu_fraction": 1.5}, "it must be below 1", id="more than one"),
            pytest.param({"gpu_fraction": -0.25}, "it must be above 0", id="negative"),
            pytest.param({"gpu_fraction": 0.3}, "multiple of 1/8", id="not an eighth"),
            pytest.param({"gpu_fraction": "0.5"}, "", id="a string"),
            pytest.param({"gpu_fraction": 0.5, "gpu_count": 2}, "ONE GPU", id="with several GPUs"),
            pytest.param(
                {"gpu_fraction": 0.5, "nodes": 2, "gpus_per_node": 1}, "ONE GPU", id="a gang"
            ),
        ],
    )
    def test_a_bad_fraction_is_refused_naming_the_field(
        self, api, body: dict, want_in_message: str
    ) -> None:
        r = post(api, {"command": CMD, **body}, f"bad-{sorted(body.items())}")
        assert r.status_code == 422, r.text
        assert r.json()["field"] == "gpu_fraction", r.json()
        assert want_in_message in r.json()["message"]

    def test_a_share_is_accepted_shown_and_stored(self, api, db: Database) -> None:
        client, auth_hdr = api
        r = post(api, {"command": CMD, "gpu_fraction": 0.375}, "ok")
        assert r.status_code == 201, r.text
        job_id = r.json()["job_id"]
        got = client.get(f"/v1/jobs/{job_id}", headers=auth_hdr).json()
        assert (got["gpu_count"], got["gpu_fraction"]) == (1, 0.375)
        spec = _spec(db, job_id)
        res = resources_of(spec)
        assert (res.gpu_fraction, res.gpu_milli, res.gpus) == (0.375, 375, 0.375)

    def test_a_whole_gpu_job_stores_no_fraction(self, api, db: Database) -> None:
        job_id = post(api, {"command": CMD}, "whole").json()["job_id"]
        spec = _spec(db, job_id)
        assert "gpu_fraction" not in spec["resources"]  # its payload hash is unchanged
        assert resources_of(spec).gpu_milli == 0


def test_the_fleet_step_setting_decides_the_allowed_shares(db: Database, tmp_path: Path) -> None:
    api = _api(db, tmp_path, gpu_fraction_steps=4)
    client = next(api)
    assert post(client, {"command": CMD, "gpu_fraction": 0.75}, "q").status_code == 201
    r = post(client, {"command": CMD, "gpu_fraction": 0.125}, "e")
    assert r.status_code == 422 and "multiple of 1/4" in r.json()["message"], r.text
    api.close()


def test_a_share_is_refused_where_no_node_shares_its_gpus(db: Database, tmp_path: Path) -> None:
    api = _api(db, tmp_path, sharing="none")
    client = next(api)
    r = post(client, {"command": CMD, "gpu_fraction": 0.5}, "s")
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "gpu_fraction" and "--gpu-sharing" in r.json()["message"]
    assert post(client, {"command": CMD}, "w").status_code == 201  # whole GPUs are fine
    api.close()


def test_steps_must_divide_a_thousandth_count() -> None:
    with pytest.raises(ValueError, match="does not divide 1000"):
        Settings(gpu_fraction_steps=3)


def test_cli_and_sdk_send_the_fraction() -> None:
    body = build_job_body({}, {"gpu_fraction": 0.25}, {}, {}, CMD)
    assert (body["gpu_fraction"], body["gpu_count"]) == (0.25, 1)
    from_file = build_job_body({"gpu_fraction": 0.5, "command": "x"}, {}, {}, {}, [])
    assert from_file["gpu_fraction"] == 0.5
    assert _core.submit_body(CMD, gpu_fraction=0.125)["gpu_fraction"] == 0.125
    assert "gpu_fraction" not in _core.submit_body(CMD)


def test_a_share_job_keeps_its_one_gpu_on_update(api, db: Database) -> None:
    client, auth_hdr = api
    r = post(api, {"command": CMD, "gpu_fraction": 0.125, "hold": True}, "held-share")
    assert r.status_code == 201, r.text
    job_id = r.json()["job_id"]
    r = client.patch(f"/v1/jobs/{job_id}", json={"gpu_count": 3}, headers=auth_hdr)
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "gpu_count"
    assert "a GPU share's job has one GPU" in r.json()["message"]
    assert "submit a new job for whole GPUs" in r.json()["message"]
    res = _spec(db, job_id)["resources"]
    assert (res["gpu_count"], res["gpu_fraction"]) == (1, 0.125)  # unchanged
    # its one GPU (a no-op) and a type change stay allowed
    r = client.patch(f"/v1/jobs/{job_id}", json={"gpu_count": 1}, headers=auth_hdr)
    assert r.status_code == 200, r.text
