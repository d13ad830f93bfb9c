"""The client CLI's multi-node options against the fake REST API of test_cli_client."""

from __future__ import annotations

import json

import httpx

from tests.unit.test_cli_client import FakeApi, api, attempt, cli, job

__all__ = ["api"]  # the fixture, re-used


def test_submit_nodes_and_gpus_per_node(api: FakeApi) -> None:
    api.on("POST", "/v1/jobs", httpx.Response(201, json={"job_id": "job_1", "status": "P"}))
    result = cli(
        "submit", "--nodes", "2", "--gpus-per-node", "2", "--workdir", "-", "--", "python3", "t.py"
    )
    assert result.exit_code == 0, result.stderr
    assert json.loads(api.requests[0].content) == {
        "command": ["python3", "t.py"],
        "nodes": 2,
        "gpus_per_node": 2,
        "priority": "NORMAL",
    }


def test_submit_allow_partial_nodes(api: FakeApi) -> None:
    api.on("POST", "/v1/jobs", httpx.Response(201, json={"job_id": "job_1", "status": "P"}))
    result = cli("submit", "--gpus", "12", "--allow-partial-nodes", "--workdir", "-", "--", "x")
    assert result.exit_code == 0, result.stderr
    body = json.loads(api.requests[0].content)
    assert (body["gpu_count"], body["allow_partial_nodes"]) == (12, True)


def test_logs_rank(api: FakeApi) -> None:
    api.on("GET", "/v1/jobs/job_1/logs", httpx.Response(200, content=b"rank 3\n"))
    result = cli("logs", "job_1", "--rank", "3")
    assert result.exit_code == 0, result.stderr
    assert result.stdout == "rank 3\n"
    assert dict(api.requests[0].url.params) == {"follow": "false", "tail": "1000", "rank": "3"}


def test_status_shows_the_gang_shape_and_each_rank(api: FakeApi) -> None:
    members = [
        attempt("run_a", "RUNNING", rank=0, gang_size=2),
        attempt("run_b", "RUNNING", rank=1, gang_size=2, node_id="node-b"),
    ]
    data = job(status="RUNNING", gpu_count=4, nodes=2, gpus_per_node=2, attempts=members)
    api.on("GET", "/v1/jobs/job_1", httpx.Response(200, json=data))
    result = cli("status", "job_1")
    assert result.exit_code == 0, result.stderr
    for want in ("2 x 2 GPUs", "1 r0", "1 r1", "run_a", "run_b", "node-b"):
        assert want in result.stdout, want


def test_gang_shape_derives_the_side_the_user_left_out() -> None:
    from gpufleet.cli.output import gang_shape

    assert gang_shape({"gpu_count": 4, "nodes": 2, "gpus_per_node": None}) == "2 x 2 GPUs"
    assert gang_shape({"gpu_count": 16, "nodes": None, "gpus_per_node": 8}) == "2 x 8 GPUs"
    assert gang_shape({"gpu_count": 12, "nodes": 2, "gpus_per_node": 6}) == "2 x 6 GPUs"
    assert gang_shape({"gpu_count": 12, "nodes": None, "gpus_per_node": 8}) == "- x 8 GPUs"
