"""REST validation of multi-node (gang) job specs, on both databases: 4xx naming the field,
the gang fields shown in the job detail, the CLI body built from --nodes/--gpus-per-node."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from gpufleet.api.app import AppState, create_app
from gpufleet.cli.submit import build_job_body
from gpufleet.objectstore import ObjectStore
from gpufleet.queue import InProcWaker
from gpufleet.services import auth
from gpufleet.services.jobs import forget_fleet_shapes
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from tests.factories import create_node


@pytest.fixture
def api(db: Database, tmp_path: Path) -> Iterator[tuple[TestClient, dict[str, str]]]:
    settings = Settings(data_dir=tmp_path)
    app = create_app(AppState(settings, db, InProcWaker(), ObjectStore(str(tmp_path / "objects"))))
    token = db.run_write(
        lambda s: (auth.create_team(s, "vision"), auth.create_token(s, "vision"))[1]
    )
    for n in ("n1", "n2", "n3"):
        create_node(db, n, gpus=4)
    forget_fleet_shapes()
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, {"Authorization": f"Bearer {token}"}


def post(api, body: dict, key: str):
    client, auth_hdr = api
    return client.post("/v1/jobs", json=body, headers={**auth_hdr, "Idempotency-Key": key})


CMD = ["python3", "train.py"]


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"nodes": 2, "gpus_per_node": 4, "gpu_count": 6}, "gpu_count"),  # 2 x 4 != 6
        ({"nodes": 4, "gpus_per_node": 4}, "nodes"),  # only 3 nodes registered
        ({"nodes": 2, "gpus_per_node": 8}, "gpus_per_node"),  # no 8-GPU node
        ({"gpu_count": 6}, "gpu_count"),  # not whole 4-GPU nodes, no allow_partial_nodes
        ({"gpu_count": 16}, "gpu_count"),  # 4 whole nodes needed, 3 exist
        ({"gpu_count": 6, "nodes": 4}, "nodes"),  # 6 is not a multiple of 4 members
        ({"nodes": 0, "gpus_per_node": 2}, "nodes"),
        ({"nodes": 2}, "gpus_per_node"),  # how many GPUs? (trial: it said "1 is not a multiple")
        ({"gpus_per_node": 2}, "nodes"),
        ({"gpu_count": 8, "gpu_type": "A100"}, "gpu_type"),  # no such type, whatever the size
        ({"gpu_count": 8, "gpu_memory_mb": 10**6}, "gpu_memory_mb"),
    ],
)
def test_a_gang_that_can_never_run_is_refused_naming_the_field(
    api, body: dict, field: str
) -> None:
    r = post(api, {"command": CMD, **body}, f"bad-{field}-{sorted(body.items())}")
    assert r.status_code == 422, r.text
    assert r.json()["field"] == field, r.json()


def test_a_gang_is_accepted_and_its_shape_shown(api) -> None:
    client, auth_hdr = api
    r = post(api, {"command": CMD, "nodes": 3, "gpus_per_node": 4}, "ok")
    assert r.status_code == 201, r.text
    job = client.get(f"/v1/jobs/{r.json()['job_id']}", headers=auth_hdr).json()
    assert (job["gpu_count"], job["nodes"], job["gpus_per_node"]) == (12, 3, 4)
    assert post(api, {"command": CMD, "gpu_count": 6, "allow_partial_nodes": True}, "p")
    single = post(api, {"command": CMD, "gpu_count": 2}, "single").json()["job_id"]
    got = client.get(f"/v1/jobs/{single}", headers=auth_hdr).json()
    assert (got["nodes"], got["gpus_per_node"], got["allow_partial_nodes"]) == (None, None, False)


def test_the_cli_body_derives_gpu_count_from_nodes_and_gpus_per_node() -> None:
    flags = {"nodes": 2, "gpus_per_node": 2, "gpu_count": None}
    body = build_job_body({}, flags, {}, {}, ["python3", "examples/train_ddp.py"])
    assert "gpu_count" not in body and (body["nodes"], body["gpus_per_node"]) == (2, 2)
    assert build_job_body({}, {"gpu_count": 4}, {}, {}, ["x"])["gpu_count"] == 4
    # one side alone: no default gpu_count of 1, so the server names the missing side
    assert "gpu_count" not in build_job_body({}, {"nodes": 2}, {}, {}, ["x"])
