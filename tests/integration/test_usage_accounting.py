"""Accounting acceptance: 200 jobs of mixed sizes and outcomes across 3 teams, driven through
the service layer on a real database (SQLite and PostgreSQL) with simulated attempt ends,
then read through a real ``gpufleet server`` (REST, JSON and CSV) and the ``gpufleet usage``
command. Per-team GPU-hours must equal the sum of (end - start) x GPUs over the teams'
attempts (from ``job_runs``), to the second; ``--by user`` splits by token owner; a window
clips each attempt to ``[since, until)``."""

from __future__ import annotations

import csv
import io
import os
import random
import subprocess
import sys
import uuid
from collections import defaultdict
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select, update

from gpufleet.domain.types import JobSpec, PriorityClass, Resources
from gpufleet.objectstore import ObjectStore
from gpufleet.services import auth, nodes, runs
from gpufleet.services.jobs import submit_job
from gpufleet.store import allocate
from gpufleet.store.db import Database
from gpufleet.store.dialect import db_now
from gpufleet.store.preemption_waste import waste_per_team
from gpufleet.store.tables import ApiTokenRow, JobRow, JobRunRow, UsageRecordRow
from tests.factories import become_leader, create_node
from tests.integration.server_proc import ServerProcess
from tests.store.test_runs import write_manifest

TEAMS = ("vision", "nlp", "speech")
USERS = ("alice", "bob")
NODES = {"h1": "H100", "h2": "H100", "a1": "A100", "a2": "A100"}


def _spec(gpus: int, retries: int, gpu_type: str) -> JobSpec:
    return JobSpec(
        command=("true",),
        resources=Resources(gpus, (gpu_type,)),
        priority=PriorityClass("NORMAL"),
        max_retries=retries,
    )


class Sim:
    """Attempts started and ended through ``allocate.reserve`` and ``runs.complete_run`` (or a
    node fence), each one backdated by a random run time so GPU-hours are large."""

    def __init__(self, db: Database, store: ObjectStore, epoch: int, seed: int) -> None:
        self.db, self.store, self.epoch = db, store, epoch
        self.rng = random.Random(seed)
        self.i = 0

    def start(self, job_id: str, gpus: int, node: str) -> Any:
        """Reserve, backdate and confirm in one transaction (fewer commits: a faster test)."""
        held_s = self.rng.uniform(30, 4 * 3600)

        def tx(s: Any) -> Any:
            r = allocate.reserve(
                s,
                job_id=job_id,
                node_id=node,
                gpu_count=gpus,
                seen_fencing_epoch=s.get(JobRow, job_id).fencing_epoch,
                leader_holder="test-leader",
                leader_epoch=self.epoch,
                lease_s=60,
                now=db_now(s),
            )
            at = s.get(JobRunRow, r.run_id).created_at
            s.execute(
                update(JobRunRow)
                .where(JobRunRow.id == r.run_id)
                .values(created_at=at - timedelta(seconds=held_s))
            )
            assert runs.confirm_assignment(s, r.run_id, r.token) == runs.Confirm.CONFIRMED
            return r

        return self.db.run_write(tx)

    def exit(self, job_id: str, node: str, r: Any, code: int) -> None:
        uri = write_manifest(self.store, job_id, r.run_id, r.token, exit_code=code)
        rep = runs.Report(node, r.run_id, r.token, runs.Outcome.EXITED, code, uri)
        assert runs.complete_run(self.db, self.store, rep)[0] == runs.CompletionResult.ACCEPTED

    def stop(self, job_id: str, node: str, r: Any, reason: str) -> None:
        self.db.run_write(
            lambda s: runs.request_stop(s, r.run_id, r.token, reason, message=reason)
        )
        uri = write_manifest(self.store, job_id, r.run_id, r.token, exit_code=-15)
        rep = runs.Report(node, r.run_id, r.token, runs.Outcome.STOPPED, -15, uri)
        assert runs.complete_run(self.db, self.store, rep)[0] == runs.CompletionResult.ACCEPTED

    def fence(self, node: str) -> None:
        def tx(s: Any) -> None:
            nodes.fence_node(s, node, reason="test: node lost", max_node_failures=3)
            nodes.release_gone_quarantined(s, node, None, message="test: confirmed dead")

        self.db.run_write(tx)


def build_history(db: Database, store: ObjectStore, n_jobs: int = 200) -> dict[str, str]:
    """3 teams x 2 named tokens, 4 nodes of 2 GPU types, ``n_jobs`` jobs of 1-8 GPUs whose
    attempts succeed, fail and retry, are cancelled, preempted and requeued, or lost with
    their node. Returns token name -> raw token (plus ``admin``)."""
    raw: dict[str, str] = {}
    for team in TEAMS:
        for user in USERS:
            raw[f"{team}/{user}"] = db.run_write(
                lambda s, t=team, u=user: auth.create_token(
                    s, t, name=u, create_team_if_missing=True
                )
            )
    raw["admin"] = db.run_write(
        lambda s: auth.create_token(
            s, "ops", name="root", is_admin=True, create_team_if_missing=True
        )
    )
    token_ids = {
        f"{t.team_id}/{t.name}": t.id
        for t in db.run_write(lambda s: list(s.scalars(select(ApiTokenRow))))
    }
    for node, gpu_type in NODES.items():
        create_node(db, node, gpus=8, gpu_type=gpu_type)
    # a long lease: building the history can take over a minute on a loaded machine
    sim = Sim(db, store, become_leader(db, lease_s=3600), seed=20261130)
    node_ids = list(NODES)
    for i in range(n_jobs):
        team, user = TEAMS[i % 3], USERS[(i // 3) % 2]
        gpus = (1, 2, 4, 8, 3)[i % 5]
        node = node_ids[i % 4]
        kind = (i // 5) % 5
        job = submit_job(
            db,
            team_id=team,
            idempotency_key=str(uuid.uuid4()),
            spec=_spec(gpus, 1 if kind == 1 else 0, NODES[node]),
            submitted_by=token_ids[f"{team}/{user}"],
        ).job_id
        r = sim.start(job, gpus, node)
        if kind == 0:  # succeeds
            sim.exit(job, node, r, 0)
        elif kind == 1:  # fails, retried, succeeds
            sim.exit(job, node, r, 3)
            sim.exit(job, node, sim.start(job, gpus, node), 0)
        elif kind == 2:  # cancelled while running
            sim.stop(job, node, r, "cancel")
        elif kind == 3:  # preempted, requeued, then fails for good
            sim.stop(job, node, r, "preempt")
            sim.exit(job, node, sim.start(job, gpus, node), 1)
        else:  # its node is lost: fenced, re-placed elsewhere, succeeds
            sim.fence(node)
            other = node_ids[(i + 1) % 4] if NODES[node_ids[(i + 1) % 4]] == NODES[node] else node
            sim.exit(job, other, sim.start(job, gpus, other), 0)
    return raw


def expected(
    db: Database, by: str, since: datetime | None = None, until: datetime | None = None
) -> dict[str, float]:
    """GPU-seconds by team / user computed from ``job_runs`` (not from usage records)."""
    out: dict[str, float] = defaultdict(float)
    with db.read() as s:
        rows = s.execute(
            select(
                JobRunRow.created_at,
                JobRunRow.finished_at,
                JobRunRow.gpu_ids,
                JobRow.team_id,
                ApiTokenRow.name,
            )
            .join(JobRow, JobRow.id == JobRunRow.job_id)
            .join(ApiTokenRow, ApiTokenRow.id == JobRow.submitted_by)
        ).all()
    for start, end, gpu_ids, team, user in rows:
        assert end is not None, "every attempt has ended"
        lo = max(start, since) if since else start
        hi = min(end, until) if until else end
        secs = max(0.0, (hi - lo).total_seconds()) * len(gpu_ids)
        out[team if by == "team" else f"{team}/{user}"] += secs
    return dict(out)


@pytest.fixture
def history(db: Database, tmp_path: Path) -> dict[str, str]:
    return build_history(db, ObjectStore(str(tmp_path / "objects")))


def _url(db: Database) -> str:
    return db.engine.url.render_as_string(hide_password=False)


def test_usage_of_200_jobs_matches_their_attempts_to_the_second(
    db: Database, history: dict[str, str], tmp_path: Path
) -> None:
    with db.read() as s:
        n_runs = len(s.scalars(select(JobRunRow.id)).all())
        recs = s.scalars(select(UsageRecordRow)).all()
        outcomes = {r.outcome for r in recs}
    assert len(recs) == n_runs > 200  # one record per attempt, retries included
    assert outcomes == {"SUCCEEDED", "FAILED", "CANCELLED", "PREEMPTED", "FENCED"}
    want_team = expected(db, "team")
    want_user = expected(db, "user")
    assert sum(want_team.values()) > 100 * 3600  # hours of GPU-time, not milliseconds

    server = ServerProcess(
        tmp_path, {"GPUFLEET_DATABASE_URL": _url(db), "GPUFLEET_REDIS_URL": ""}
    ).start()
    try:
        admin = {"Authorization": f"Bearer {history['admin']}"}
        with httpx.Client(base_url=server.url, timeout=30) as http:
            got = http.get("/v1/usage", params={"by": "team"}, headers=admin).json()
            by_team = {ln["key"]: ln["gpu_seconds"] for ln in got["items"]}
            assert by_team.keys() == want_team.keys()
            for team, secs in want_team.items():
                assert abs(by_team[team] - secs) < 1.0, (team, by_team[team], secs)
            assert abs(got["total_gpu_hours"] * 3600 - sum(want_team.values())) < 1.0
            # the work each team lost to preemption (what the waste cap counts)
            with db.read() as s:
                want_waste = waste_per_team(s, None, None)
            assert sum(want_waste.values()) > 0
            for ln in got["items"]:
                lost = want_waste.get(ln["key"], 0.0)
                assert abs(ln["preemption_waste_gpu_hours"] - lost) < 1e-3, (ln, lost)

            got = http.get("/v1/usage", params={"by": "user"}, headers=admin).json()
            by_user = {f"{ln['team']}/{ln['key']}": ln["gpu_seconds"] for ln in got["items"]}
            assert by_user.keys() == want_user.keys() and len(by_user) == 6
            for user, secs in want_user.items():
                assert abs(by_user[user] - secs) < 1.0, (user, by_user[user], secs)

            # a window clips each attempt to [since, until) (sreport semantics)
            with db.read() as s:
                ends = sorted(s.scalars(select(UsageRecordRow.end_at)).all())
            since = ends[0] - timedelta(minutes=30)
            until = ends[len(ends) // 2]
            want_win = expected(db, "team", since, until)
            got = http.get(
                "/v1/usage",
                params={"by": "team", "since": since.isoformat(), "until": until.isoformat()},
                headers=admin,
            ).json()
            for team, secs in want_win.items():
                line = next(ln for ln in got["items"] if ln["key"] == team)
                assert abs(line["gpu_seconds"] - secs) < 1.0
            assert sum(want_win.values()) < sum(want_team.values())

            # CSV through Accept; a team token sees its own team only
            vision = {"Authorization": f"Bearer {history['vision/alice']}"}
            resp = http.get(
                "/v1/usage", params={"by": "user"}, headers={**vision, "Accept": "text/csv"}
            )
            assert resp.headers["content-type"].startswith("text/csv")
            rows = list(csv.DictReader(io.StringIO(resp.text)))
            assert {(r["team"], r["user"]) for r in rows} == {
                ("vision", "alice"),
                ("vision", "bob"),
            }
            for r in rows:
                assert abs(float(r["gpu_seconds"]) - want_user[f"vision/{r['user']}"]) < 1.0
            denied = http.get("/v1/usage", params={"team": "nlp"}, headers=vision)
            assert denied.status_code == 403 and denied.json()["field"] == "team"
            bad = http.get("/v1/usage", params={"since": "last tuesday"}, headers=admin)
            assert bad.status_code == 422 and bad.json()["field"] == "since"

        # the CLI, as a user would run it
        env = dict(
            os.environ,
            GPUFLEET_URL=server.url,
            GPUFLEET_TOKEN=history["nlp/bob"],
            GPUFLEET_CONFIG=str(tmp_path / "none.yaml"),
        )
        done = subprocess.run(
            [sys.executable, "-m", "gpufleet.cli.main", "usage", "--by", "user", "-o", "csv"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        rows = list(csv.DictReader(io.StringIO(done.stdout)))
        assert sorted(r["user"] for r in rows) == ["alice", "bob"]
        for r in rows:
            assert abs(float(r["gpu_hours"]) * 3600 - want_user[f"nlp/{r['user']}"]) < 1.0
    finally:
        server.stop()
