"""Job control against a real platform (API + controller + agents, real processes), on
SQLite and PostgreSQL: arrays with a %N limit, dependency chains, DEPENDENCY_FAILED, hold and
release, requeue, PATCH, bulk cancel, id prefixes and names, and the CLI commands."""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from gpufleet.cli.main import app as cli_app
from gpufleet.store.tables import JobRow, JobRunRow
from tests.e2e.harness import TERMINAL, Fleet

pytestmark = pytest.mark.slow


def post(fleet: Fleet, path: str, body: Any = None, team: str = "vision", **kw: Any) -> Any:
    with fleet.http(team) as c:
        return c.post(path, json=body, **kw)


def submit(fleet: Fleet, body: dict[str, Any], team: str = "vision") -> dict[str, Any]:
    r = post(fleet, "/v1/jobs", body, team, headers={"Idempotency-Key": str(uuid.uuid4())})
    assert r.status_code == 201, r.text
    return dict(r.json())


def py(fleet: Fleet, code: str) -> list[str]:
    return [sys.executable, "-c", code, f"gpufleet-test-marker-{fleet.tmp.name}"]


def max_overlap(intervals: list[tuple[datetime, datetime]]) -> int:
    """Most intervals open at once (an end before a start at the same instant)."""
    edges = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals])
    best = cur = 0
    for _, d in edges:
        cur += d
        best = max(best, cur)
    return best


def test_array_limit_and_dependencies(fleet: Fleet) -> None:
    """A 100-task array with %8 on 16 free GPUs never holds more than 8 at once and ends
    with 100 terminal tasks; a chain of 3 runs in order; afterok on a failed job ends
    DEPENDENCY_FAILED while afternotok on it runs."""
    fleet.start_agent("a1", gpus="16xH100-80GB")
    fleet.start_sampling(period_s=0.5)
    created = submit(
        fleet,
        {
            "name": "sweep",
            "command": ["sh", "-c", 'test -n "$GPUFLEET_ARRAY_INDEX"; sleep 0.1'],
            "array": "0-99%8",
        },
    )
    array_id, task_ids = created["array_id"], created["job_ids"]
    assert array_id.startswith("a-") and len(task_ids) == 100
    assert created["job_id"] == task_ids[0]

    # a chain of 3 (afterok) and a failed job with an afterok and an afternotok dependent
    # a runs long enough for b's reason to be seen: with 0.5 s, b was often placed (a done)
    # before a poll of the API saw it waiting
    a = submit(fleet, {"name": "chain-a", "command": ["sleep", "5"]})["job_id"]
    b = submit(fleet, {"name": "chain-b", "command": ["true"], "depends_on": f"afterok:{a}"})
    c = submit(
        fleet,
        {"command": ["true"], "depends_on": [{"type": "afterok", "job_id": b["job_id"]}]},
    )
    bad = submit(fleet, {"command": ["false"]})["job_id"]
    never = submit(fleet, {"command": ["true"], "depends_on": f"afterok:{bad}"})["job_id"]
    cleanup = submit(fleet, {"command": ["true"], "depends_on": f"afternotok:{bad}"})["job_id"]

    # while a runs, b waits, and `why` names the blocker and its state
    seen: list[dict[str, Any]] = []  # the reason as one read saw it (b moves on once a ends)

    def b_waits_on_a() -> bool:
        reason = fleet.job(b["job_id"]).get("pending_reason") or {}
        seen[:] = [reason]
        return reason.get("code") == "dependency"

    fleet.wait_for(b_waits_on_a, 60, "b's dependency reason")
    reason = seen[0]
    assert reason["details"]["job_id"] == a and reason["details"]["type"] == "afterok"
    assert a in reason["message"]

    got_never = fleet.wait_status(never, TERMINAL, 60)
    assert got_never["status"] == "DEPENDENCY_FAILED"
    assert bad in got_never["failure_reason"] and got_never["attempts"] == []
    assert fleet.wait_status(cleanup, TERMINAL, 60)["status"] == "SUCCEEDED"
    events = fleet.get(f"/v1/jobs/{never}/events")["items"]
    assert any(e["to"] == "DEPENDENCY_FAILED" for e in events)

    done_c = fleet.wait_status(c["job_id"], TERMINAL, 60)
    done_b, done_a = fleet.job(b["job_id"]), fleet.job(a)
    assert [j["status"] for j in (done_a, done_b, done_c)] == ["SUCCEEDED"] * 3
    assert done_a["finished_at"] <= done_b["started_at"]
    assert done_b["finished_at"] <= done_c["started_at"]

    # some task was throttled with numbers while the array ran
    fleet.wait_for(
        lambda: all(fleet.job(t)["status"] in TERMINAL for t in task_ids[-5:]), 180, "array"
    )
    with fleet.db.read() as s:
        statuses = list(s.scalars(select(JobRow.status).where(JobRow.array_id == array_id)))
        intervals = [
            (r.created_at, r.finished_at)
            for r in s.scalars(
                select(JobRunRow)
                .join(JobRow, JobRow.id == JobRunRow.job_id)
                .where(JobRow.array_id == array_id)
            )
        ]
        throttled = [
            e
            for e in fleet.get(f"/v1/jobs/{task_ids[-1]}/events")["items"]
            if (e.get("details") or {}).get("code") == "array_throttled"
        ]
    assert statuses.count("SUCCEEDED") == 100, statuses
    assert len(intervals) == 100 and all(end is not None for _, end in intervals)
    peak = max_overlap(intervals)  # type: ignore[arg-type]
    print(f"array of 100 %8: peak {peak} tasks holding GPUs at once")
    assert 2 <= peak <= 8, peak
    assert throttled and throttled[0]["details"]["max_running"] == 8
    arr = fleet.get(f"/v1/arrays/{array_id}")
    assert arr["counts"] == {"SUCCEEDED": 100} and arr["max_running"] == 8
    listed = fleet.get(f"/v1/jobs?array_id={array_id}&limit=500")["items"]
    assert sorted(j["array_index"] for j in listed) == list(range(100))
    assert fleet.violations == [] and fleet.check() == []


def test_submit_rejects_bad_arrays_and_dependencies(fleet: Fleet) -> None:
    other = submit(fleet, {"command": ["true"], "hold": True}, team="nlp")["job_id"]
    for body, field in (
        ({"array": "5-1"}, "array"),
        ({"array": "0-9%0"}, "array"),
        ({"depends_on": "afterok:j-00000000000000000000000000"}, "depends_on"),
        ({"depends_on": f"afterok:{other}"}, "depends_on"),  # another team's job
        ({"depends_on": "later:xyz"}, "depends_on"),
    ):
        r = post(
            fleet,
            "/v1/jobs",
            {"command": ["true"], **body},
            headers={"Idempotency-Key": str(uuid.uuid4())},
        )
        assert r.status_code == 422, (body, r.text)
        assert r.json()["field"] == field, r.json()


def test_hold_requeue_patch_cancel_and_references(fleet: Fleet) -> None:
    fleet.start_agent("a1", gpus="4xH100-80GB")
    # hold: never placed while GPUs are free; release runs it
    held = submit(fleet, {"name": "held-one", "command": ["true"], "hold": True})["job_id"]
    free = submit(fleet, {"command": ["true"]})["job_id"]
    assert fleet.wait_status(free, TERMINAL, 30)["status"] == "SUCCEEDED"
    job = fleet.job(held)
    assert job["status"] == "PENDING" and job["held"] and job["pending_reason"]["code"] == "held"
    # a short id prefix and a name both work as the job reference
    assert post(fleet, f"/v1/jobs/{held[:14]}/release").json()["job_id"] == held
    assert fleet.wait_status(held, TERMINAL, 30)["status"] == "SUCCEEDED"
    assert fleet.get("/v1/jobs/held-one")["job_id"] == held
    assert post(fleet, f"/v1/jobs/{held}/hold").status_code == 409  # finished

    # requeue a FAILED job: a new attempt at once
    bad = submit(fleet, {"name": "flaky", "command": ["false"]})["job_id"]
    fleet.wait_status(bad, TERMINAL, 30)
    assert post(fleet, f"/v1/jobs/{bad}/requeue").json()["status"] == "PENDING"
    again = fleet.wait_status(bad, {"FAILED"}, 60)
    assert len(again["attempts"]) == 2
    # requeue a RUNNING job: stopped through the stop path, then a new attempt
    long = submit(fleet, {"name": "long", "command": ["sleep", "60"], "priority": "LOW"})
    long_id = long["job_id"]
    fleet.wait_for(lambda: fleet.job(long_id)["status"] == "RUNNING", 30, "long running")
    assert post(fleet, "/v1/jobs/long/requeue").status_code == 200
    fleet.wait_for(
        lambda: (
            [a["status"] for a in fleet.job(long_id)["attempts"]][:1] == ["PREEMPTED"]
            and fleet.job(long_id)["status"] == "RUNNING"
        ),
        60,
        "requeued attempt running",
    )
    # PATCH priority, name, and max_runtime_s of the running job (it then times out)
    with fleet.http() as h:
        r = h.patch(f"/v1/jobs/{long_id}", json={"priority": "HIGH", "name": "longer"})
        assert r.status_code == 200 and r.json()["priority"] == "HIGH", r.text
        assert h.patch(f"/v1/jobs/{long_id}", json={"priority": "URGENT"}).status_code == 422
        assert h.patch(f"/v1/jobs/{long_id}", json={"bogus": 1}).status_code == 422
        r = h.patch("/v1/jobs/longer", json={"max_runtime_s": 0.5})
        assert r.status_code == 200 and r.json()["max_runtime_s"] == 0.5
    timed_out = fleet.wait_status(long_id, TERMINAL, 60)
    assert timed_out["status"] == "FAILED" and "TIMEOUT" in timed_out["failure_reason"]
    kinds = [e["kind"] for e in fleet.get(f"/v1/jobs/{long_id}/events")["items"]]
    assert kinds.count("patched") == 2
    with fleet.http() as h:
        assert h.patch(f"/v1/jobs/{long_id}", json={"priority": "LOW"}).status_code == 409

    # bulk cancel by name and state; ambiguity of a prefix is a 422 listing candidates
    batch = [
        submit(fleet, {"name": "batch", "command": ["true"], "hold": True})["job_id"]
        for _ in range(3)
    ]
    r = post(fleet, "/v1/jobs/cancel", {"name": "batch", "state": "PENDING", "dry_run": True})
    assert sorted(i["job_id"] for i in r.json()["cancelled"]) == sorted(batch)
    dry = {"name": "batch", "state": "RUNNING,pending", "dry_run": True}
    assert post(fleet, "/v1/jobs/cancel", dry).json()["count"] == 3
    assert all(fleet.job(j)["status"] == "PENDING" for j in batch)
    r = post(fleet, "/v1/jobs/cancel", {"name": "batch"})
    assert r.json()["count"] == 3
    assert all(fleet.job(j)["status"] == "CANCELLED" for j in batch)
    with fleet.http() as h:
        amb = h.get("/v1/jobs/j-" + batch[0][2:6])
        assert amb.status_code == 422 and amb.json()["field"] == "job_id", amb.text
        assert batch[0] in amb.json()["message"]
        assert h.get("/v1/jobs/no-such-name").status_code == 404
    # another team sees none of it
    with fleet.http("nlp") as h:
        assert h.get(f"/v1/jobs/{held[:14]}").status_code == 404
        assert h.get("/v1/jobs/held-one").status_code == 404
    assert fleet.check() == []


@pytest.fixture
def sqlite_fleet(tmp_path: Path) -> Iterator[Fleet]:
    """The CLI layer is the same on both databases: SQLite only."""
    f = Fleet(tmp_path).start()
    try:
        yield f
    finally:
        f.stop()


def test_cli_job_control(sqlite_fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    fleet = sqlite_fleet
    monkeypatch.setenv("GPUFLEET_URL", fleet.api.url)
    monkeypatch.setenv("GPUFLEET_TOKEN", fleet.tokens["vision"])
    monkeypatch.setenv("GPUFLEET_CONFIG", str(fleet.tmp / "absent.yaml"))

    def cli(*args: str, input: str | None = None) -> Any:
        result = CliRunner().invoke(cli_app, list(args), input=input)
        assert "Traceback" not in result.output, result.output
        return result

    r = cli("submit", "--name", "arr", "--array", "0-3%2", "--hold", "--", "true")
    assert r.exit_code == 0, r.output
    array_id = r.stdout.strip()
    assert array_id.startswith("a-")
    r = cli("submit", "--name", "after", "--depends", f"afterok:{array_id}", "--", "true")
    assert r.exit_code == 0, r.output
    after = r.stdout.strip()
    assert fleet.job(after)["depends_on"][0]["type"] == "afterok"
    assert len(fleet.job(after)["depends_on"]) == 4  # the array's tasks
    r = cli("why", after)
    assert r.exit_code == 0
    r = cli("array", array_id)
    assert r.exit_code == 0 and "4 tasks" in r.stdout and "at most 2 running" in r.stdout
    # cancel by array: asks first; "n" keeps them
    r = cli("cancel", "--array", array_id, input="n\n")
    assert r.exit_code == 1 and all(
        j["status"] == "PENDING" for j in fleet.get(f"/v1/jobs?array_id={array_id}")["items"]
    )
    r = cli("list", "--array", array_id, "-o", "json")
    assert r.exit_code == 0 and len(json.loads(r.stdout)["items"]) == 4
    r = cli("update", "arr", "--priority", "high")
    assert r.exit_code == 0 and "priority=HIGH" in r.stdout, r.output
    r = cli("hold", after)
    assert r.exit_code == 0 and "held:" in r.stdout
    r = cli("release", after)
    assert r.exit_code == 0
    # several states: any of them (repeated or as a comma list); an unknown one is named;
    # --status is the same option (as on `list`)
    r = cli("cancel", "--name", "arr", "--state", "RUNNING", "--status", "PENDING", input="n\n")
    assert r.exit_code == 1 and "Cancel 4 job(s)?" in r.output, r.output
    r = cli("cancel", "--name", "arr", "--state", "RUNNING,SCHEDULED", input="n\n")
    assert r.exit_code == 3 and "no job matched" in r.output, r.output
    r = cli("cancel", "--name", "arr", "--state", "PENDING,BOGUS", "--yes")
    assert r.exit_code == 2 and "BOGUS" in r.output and "state" in r.output, r.output
    r = cli("cancel", "--array", array_id, "--yes")
    assert r.exit_code == 0 and r.stdout.count("cancel requested") == 4, r.output
    # afterok on cancelled tasks can never be satisfied
    assert fleet.wait_status(after, TERMINAL, 30)["status"] == "DEPENDENCY_FAILED"
    r = cli("requeue", after)
    # requeued to PENDING; its dependency is still unsatisfiable, so the next pass may end it
    # DEPENDENCY_FAILED again before the answer is printed
    assert r.exit_code == 0 and "requeued:" in r.stdout, r.output
    assert fleet.wait_status(after, TERMINAL, 30)["status"] == "DEPENDENCY_FAILED"
    # its dependencies still cannot be satisfied: it ends the same way again
    assert fleet.wait_status(after, TERMINAL, 30)["status"] == "DEPENDENCY_FAILED"
    r = cli("cancel", after)
    assert r.exit_code == 2 and "already finished" in r.output
    r = cli("submit", "--array", "9-1", "--", "true")
    assert r.exit_code == 2 and "array" in r.output
    # a time limit as sbatch takes it, at submit and after
    r = cli("submit", "-q", "--name", "timed", "-t", "1:30:00", "--hold", "--", "true")
    assert r.exit_code == 0, r.output
    timed = r.stdout.strip()
    assert fleet.job(timed)["max_runtime_s"] == 5400
    r = cli("update", "timed", "--time", "2h")
    assert r.exit_code == 0 and "max_runtime=7200 s" in r.stdout, r.output
    r = cli("submit", "-t", "2h", "--max-runtime-s", "5", "--", "true")
    assert r.exit_code == 2 and "--time" in r.output, r.output
    r = cli("submit", "-t", "soon", "--", "true")
    assert r.exit_code == 2 and "--time 'soon'" in r.output, r.output
    assert cli("cancel", timed).exit_code == 0
