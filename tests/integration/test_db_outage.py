"""The database goes away under a real API server process and a real controller gRPC
service (PostgreSQL behind a TCP proxy that the test stops and restarts): the REST API
answers 503 + Retry-After with a generic message and logs one line per outage and no
traceback; gRPC answers UNAVAILABLE without host names or driver messages."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from sqlalchemy.engine import make_url

from gpufleet.controller.identity import BootstrapServicer, NodeAuthenticator
from gpufleet.controller.servicer import ControllerServicer
from gpufleet.objectstore import ObjectStore
from gpufleet.rpc import tls
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc
from gpufleet.services import auth
from gpufleet.store.db import Database
from tests.conftest import _empty
from tests.integration.server_proc import ServerProcess
from tests.ports import free_port

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


class TcpProxy:
    """Forwards 127.0.0.1:``port`` to ``target``; ``stop()`` closes the listener and cuts
    every connection (the database "goes away"), ``start()`` brings it back on the same
    port."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.port = free_port()
        self._listener: socket.socket | None = None
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()

    def start(self) -> TcpProxy:
        lst = socket.socket()
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind(("127.0.0.1", self.port))
        lst.listen(64)
        self._listener = lst
        threading.Thread(target=self._accept, args=(lst,), daemon=True).start()
        return self

    def _accept(self, lst: socket.socket) -> None:
        while True:
            try:
                client, _ = lst.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def stop(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):  # wakes the thread blocked in accept()
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()


@pytest.fixture
def proxied(pg_url: str) -> Iterator[tuple[str, TcpProxy, Database]]:
    """(URL of the test database through a proxy, the proxy, a direct Database)."""
    direct = Database(pg_url)
    _empty(direct)
    url = make_url(pg_url)
    proxy = TcpProxy((url.host or "127.0.0.1", url.port or 5432)).start()
    through = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    try:
        yield through, proxy, direct
    finally:
        proxy.stop()
        direct.dispose()


SECRETS = ("127.0.0.1", "5432", "psycopg", "postgres", "connection", "Traceback")


def test_rest_answers_503_and_logs_one_line_per_outage(proxied, tmp_path: Path) -> None:
    url, proxy, direct = proxied
    token = direct.run_write(lambda s: auth.create_token(s, "vision", create_team_if_missing=True))
    server = ServerProcess(tmp_path, {"GPUFLEET_DATABASE_URL": url}).start()
    hdr = {"Authorization": f"Bearer {token}"}
    job = {"command": ["true"], "gpu_count": 1}
    try:
        with httpx.Client(base_url=server.url, headers=hdr, timeout=30) as c:
            assert c.get("/v1/jobs").status_code == 200
            for outage in range(2):
                proxy.stop()
                time.sleep(0.6)  # past the token cache: every request needs the database
                answers = [
                    c.get("/v1/jobs"),
                    c.post("/v1/jobs", json=job, headers={"Idempotency-Key": uuid.uuid4().hex}),
                    *(c.get("/v1/nodes") for _ in range(10)),
                ]
                for r in answers:
                    assert r.status_code == 503, r.text
                    assert r.headers["Retry-After"] == "2"
                    assert r.json()["error"] == "database_unavailable"
                    assert not any(s in r.text for s in SECRETS), r.text
                proxy.start()
                deadline = time.monotonic() + 30
                while c.get("/v1/jobs").status_code != 200:
                    assert time.monotonic() < deadline, "the API did not recover"
                    time.sleep(0.2)
                created = c.post(
                    "/v1/jobs", json=job, headers={"Idempotency-Key": f"after-{outage}"}
                )
                assert created.status_code == 201, created.text
                while server.log().count("database reachable again") < outage + 1:
                    assert time.monotonic() < deadline, "the end of the outage was not logged"
                    time.sleep(0.1)
        log = server.log()
        print(log)
        assert "Traceback" not in log
        assert log.count("database unreachable") == 2  # one line per outage...
        assert log.count("database reachable again") == 2  # ...and one when it ends
    finally:
        server.stop()


def test_grpc_errors_carry_no_database_details(proxied, tmp_path: Path) -> None:
    url, proxy, _direct = proxied
    db = Database(url)
    server = grpc.server(ThreadPoolExecutor(4))
    pb_grpc.add_ControllerServicer_to_server(
        ControllerServicer(
            db,
            ObjectStore(str(tmp_path / "objects")),
            heartbeat_interval_s=1.0,
            leader_epoch=lambda: 1,
            on_change=lambda: None,
        ),
        server,
    )
    ca = tls.init_ca(tmp_path / "pki")
    pb_grpc.add_BootstrapServicer_to_server(
        BootstrapServicer(db, ca, NodeAuthenticator(db), ttl_s=3600), server
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ControllerStub(channel)
            bootstrap = pb_grpc.BootstrapStub(channel)
            csr = tls.make_csr(tls.new_key(), "n1")
            ok = stub.Heartbeat(pb.HeartbeatRequest(node_id="n1", agent_epoch=1), timeout=10)
            assert ok.reregister  # reachable: an unknown node is told to register
            proxy.stop()
            calls = [
                lambda: stub.Heartbeat(
                    pb.HeartbeatRequest(node_id="n1", agent_epoch=1), timeout=20
                ),
                lambda: stub.ConfirmAssignment(
                    pb.ConfirmAssignmentRequest(run_id="r-1", token=1), timeout=20
                ),
                lambda: stub.RegisterNode(
                    pb.RegisterNodeRequest(
                        node_id="n1",
                        address="127.0.0.1:1",
                        agent_epoch=1,
                        gpus=[pb.Gpu(index=0, uuid="g0", gpu_type="H100", memory_mb=80)],
                    ),
                    timeout=20,
                ),
                lambda: stub.ReportCompletion(
                    pb.ReportCompletionRequest(run_id="r-1", token=1, node_id="n1"), timeout=20
                ),
                lambda: bootstrap.Join(
                    pb.JoinRequest(token="gfj1.x.y", node_id="n1", csr_pem=csr), timeout=20
                ),
            ]
            for call in calls:
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                details = err.value.details() or ""
                assert not any(s.lower() in details.lower() for s in SECRETS), details
    finally:
        server.stop(grace=1).wait()
        db.dispose()


def test_a_controller_logs_one_line_per_outage_and_no_traceback(proxied, tmp_path: Path) -> None:
    """A real ``gpufleet controller`` process (its leader, scheduler and upkeep loops, and
    RPCs from this test during the outage) while PostgreSQL goes away for a few seconds,
    twice: one "unreachable" and one "reachable again" line per outage, no traceback."""
    import os
    import subprocess
    import sys

    url, proxy, _direct = proxied
    port = free_port()
    log_path = tmp_path / "controller.log"
    env = dict(
        os.environ,
        GPUFLEET_DATA_DIR=str(tmp_path),
        GPUFLEET_DATABASE_URL=url,
        GPUFLEET_HEARTBEAT_INTERVAL_S="0.5",
        GPUFLEET_LEADER_LEASE_S="3",
        GPUFLEET_SCHEDULER_TICK_S="0.2",
    )
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpufleet.cli.main",
                "controller",
                "--insecure",
                "--address",
                f"127.0.0.1:{port}",
            ],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 60
        while "controller listening" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.2)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = pb_grpc.ControllerStub(channel)
            beat = pb.HeartbeatRequest(node_id="n1", agent_epoch=1)
            stub.Heartbeat(beat, timeout=10)
            for outage in range(2):
                proxy.stop()
                end = time.monotonic() + 6
                while time.monotonic() < end:
                    with contextlib.suppress(grpc.RpcError):
                        stub.Heartbeat(beat, timeout=10)
                    time.sleep(0.3)
                proxy.start()
                deadline = time.monotonic() + 60
                while log_path.read_text().count("database reachable again") < outage + 1:
                    assert time.monotonic() < deadline, log_path.read_text()
                    time.sleep(0.2)
                assert stub.Heartbeat(beat, timeout=10).reregister
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log = log_path.read_text()
    print(log)
    assert "Traceback" not in log
    assert log.count("database unreachable") == 2, log
    assert log.count("database reachable again") == 2, log
