"""Completion webhooks end to end on SQLite and PostgreSQL: a job submitted with ``notify``
runs to SUCCEEDED through the API and the controller's servicer, its outbox row is written
with the completion, and the delivery worker POSTs it to a real HTTP server in this test,
signed with the team's secret (services.notify, docs/design/security.md)."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from gpufleet.domain import webhooks
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.services import notify
from gpufleet.settings import Settings
from gpufleet.store.db import Database
from gpufleet.store.tables import NotifyOutboxRow, SchedulingEventRow
from tests.store.test_runs import write_manifest
from tests.store.test_sql_budget import Platform


class Receiver:
    """A local HTTP server answering the statuses in ``answers`` in turn (then 200)."""

    def __init__(self, answers: list[int] | None = None) -> None:
        self.answers = list(answers or [])
        self.got: list[tuple[dict[str, str], bytes]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                outer.got.append(({k.lower(): v for k, v in self.headers.items()}, body))
                code = outer.answers.pop(0) if outer.answers else 200
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/hook"
        self._t = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._t.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def platform(db: Database, tmp_path: Path) -> Iterator[Platform]:
    p = Platform(db, tmp_path)
    yield p
    p.close()


def fail(p: Platform, job_id: str, run_id: str, token: int) -> None:
    """The attempt exited 1 (no retries left: the job FAILED)."""
    uri = write_manifest(p.store, job_id, run_id, token)
    resp = p.servicer.ReportCompletion(
        pb.ReportCompletionRequest(
            node_id="n1",
            run_id=run_id,
            token=token,
            outcome=pb.ReportCompletionRequest.EXITED,
            exit_code=1,
            manifest_uri=uri,
        ),
        None,  # type: ignore[arg-type]
    )
    assert resp.result == pb.ReportCompletionResponse.ACCEPTED, resp.message


def run_job(p: Platform, urls: list[str], *, failed: bool = False) -> str:
    p.state.principals.clear()
    r = p.client.post(
        "/v1/jobs",
        json={"command": ["true"], "gpu_count": 1, "notify": urls},
        headers={"Authorization": f"Bearer {p.token}", "Idempotency-Key": str(uuid.uuid4())},
    )
    assert r.status_code == 201, r.text
    job_id = str(r.json()["job_id"])
    assert p.schedule()
    p.wait_dispatched()
    run_id, token = p.run_of(job_id)
    p.confirm(run_id, token)
    if failed:
        fail(p, job_id, run_id, token)
    else:
        p.complete(job_id, run_id, token)
    return job_id


def outbox(db: Database, job_id: str) -> NotifyOutboxRow:
    with db.read() as s:
        row = s.get(NotifyOutboxRow, job_id)
        assert row is not None
        return row


def events(db: Database, job_id: str) -> list[SchedulingEventRow]:
    with db.read() as s:
        return list(
            s.query(SchedulingEventRow)
            .filter(SchedulingEventRow.job_id == job_id, SchedulingEventRow.kind == "notify")
            .order_by(SchedulingEventRow.id)
        )


LOOPBACK = Settings(notify_allow_private=True, notify_backoff_s=0.01, notify_max_attempts=3)


def test_signed_delivery_of_the_final_record(platform: Platform, receiver: Receiver) -> None:
    db = platform.db
    job_id = run_job(platform, [receiver.url])
    assert outbox(db, job_id).status == "SUCCEEDED"
    assert notify.deliver_due(db, LOOPBACK) == 1
    assert len(receiver.got) == 1
    headers, body = receiver.got[0]
    secret = db.run_write(lambda s: notify.team_secret(s, "team-a"))
    assert headers["x-gpufleet-signature"].startswith("sha256=")
    assert webhooks.verify(
        secret, body, headers["x-gpufleet-signature"], headers["x-gpufleet-timestamp"]
    )
    assert not webhooks.verify(
        "another", body, headers["x-gpufleet-signature"], headers["x-gpufleet-timestamp"]
    )
    assert headers["x-gpufleet-delivery"] == job_id
    record = json.loads(body)
    assert record["job_id"] == job_id and record["status"] == "SUCCEEDED"
    row = outbox(db, job_id)
    assert row.delivered_at is not None and not row.gave_up and row.urls == []
    assert [e.details["outcome"] for e in events(db, job_id)] == ["delivered"]
    assert notify.deliver_due(db, LOOPBACK) == 0  # delivered once


def test_retry_after_a_500(platform: Platform, receiver: Receiver) -> None:
    db = platform.db
    receiver.answers = [500]
    job_id = run_job(platform, [receiver.url])
    assert notify.deliver_due(db, LOOPBACK) == 1
    row = outbox(db, job_id)
    assert row.delivered_at is None and row.attempts == 1 and row.last_error
    assert "HTTP 500" in row.last_error
    # the claim's lease was replaced by the backoff (0.01 s): due again at once
    import time

    time.sleep(0.05)
    assert notify.deliver_due(db, LOOPBACK) == 1
    assert len(receiver.got) == 2
    assert receiver.got[0][0]["x-gpufleet-delivery"] == receiver.got[1][0]["x-gpufleet-delivery"]
    row = outbox(db, job_id)
    assert row.delivered_at is not None and not row.gave_up and row.attempts == 2
    assert [e.details["outcome"] for e in events(db, job_id)] == ["retry", "delivered"]


def test_a_refused_address_is_given_up(platform: Platform, receiver: Receiver) -> None:
    db = platform.db
    job_id = run_job(platform, [receiver.url])
    strict = Settings(notify_backoff_s=0.01)  # loopback not allowed
    assert notify.deliver_due(db, strict) == 1
    assert receiver.got == []
    row = outbox(db, job_id)
    assert row.gave_up and row.delivered_at is not None
    assert row.last_error and "non-public address 127.0.0.1" in row.last_error
    (ev,) = events(db, job_id)
    assert ev.details["outcome"] == "given_up"


def test_allow_hosts_lets_one_host_through(platform: Platform, receiver: Receiver) -> None:
    job_id = run_job(platform, [receiver.url])
    assert notify.deliver_due(platform.db, Settings(notify_allow_hosts="127.0.0.1")) == 1
    assert len(receiver.got) == 1 and not outbox(platform.db, job_id).gave_up


def test_a_requeued_job_is_told_of_its_second_end(platform: Platform, receiver: Receiver) -> None:
    db = platform.db
    job_id = run_job(platform, [receiver.url], failed=True)
    assert outbox(db, job_id).status == "FAILED"
    assert notify.deliver_due(db, LOOPBACK) == 1
    r = platform.client.post(
        f"/v1/jobs/{job_id}/requeue", headers={"Authorization": f"Bearer {platform.token}"}
    )
    assert r.status_code == 200, r.text
    with db.read() as s:  # the earlier end's row went with the revival
        assert s.get(NotifyOutboxRow, job_id) is None
    assert platform.schedule()
    platform.wait_dispatched()
    run_id, token = platform.run_of(job_id)
    platform.confirm(run_id, token)
    platform.complete(job_id, run_id, token)
    assert outbox(db, job_id).delivered_at is None
    assert notify.deliver_due(db, LOOPBACK) == 1
    assert [h["x-gpufleet-delivery"] for h, _ in receiver.got] == [job_id, job_id]
    assert [json.loads(b)["status"] for _, b in receiver.got] == ["FAILED", "SUCCEEDED"]
