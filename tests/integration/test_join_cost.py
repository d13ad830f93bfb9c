"""The join port needs no client certificate, so what a caller without a usable token can
make the controller do must be cheap: the token is checked (one indexed read) before the
CSR is parsed or signed. A real gRPC join server over TLS, on SQLite and PostgreSQL; the
CA counts its signatures."""

from __future__ import annotations

import dataclasses
from concurrent import futures
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import grpc
import pytest

from gpufleet.controller.identity import BootstrapServicer, ControllerTls, NodeAuthenticator
from gpufleet.rpc import tls
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc
from gpufleet.services import node_identity
from gpufleet.store.db import Database


@dataclasses.dataclass(frozen=True)
class CountingCA(tls.FleetCA):
    signed: ClassVar[list[str]] = []

    def sign_node_csr(self, csr_pem: bytes, node_id: str, ttl_s: float) -> Any:
        CountingCA.signed.append(node_id)
        return super().sign_node_csr(csr_pem, node_id, ttl_s)


@pytest.fixture
def join_port(db: Database, tmp_path: Path) -> Any:
    tls.init_ca(tmp_path / "pki")
    ctl = ControllerTls(tmp_path / "pki", [])
    ca = CountingCA(ctl.ca.key, ctl.ca.cert)
    CountingCA.signed.clear()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_BootstrapServicer_to_server(
        BootstrapServicer(db, ca, NodeAuthenticator(db), 3600.0), server
    )
    port = server.add_secure_port("127.0.0.1:0", ctl.server_credentials(require_client_auth=False))
    server.start()
    channel = tls.secure_channel(
        f"127.0.0.1:{port}", tls.channel_credentials(ctl.ca_pem), tls.CONTROLLER_NAME
    )
    try:
        yield pb_grpc.BootstrapStub(channel)
    finally:
        channel.close()
        server.stop(grace=0)


def _code(call: Any, request: Any) -> grpc.StatusCode:
    try:
        call(request, timeout=10)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    raise AssertionError("accepted")


def test_a_bad_join_token_costs_no_signature(join_port: Any, db: Database) -> None:
    csr = tls.make_csr(tls.new_key(), "j1")
    used = db.run_write(partial(node_identity.create_join_token, node_id=None, ttl_s=600))[0]
    other = db.run_write(partial(node_identity.create_join_token, node_id="j9", ttl_s=600))[0]
    bad = [
        (pb.JoinRequest(token="no-such-secret", node_id="j1", csr_pem=csr), "UNAUTHENTICATED"),
        (pb.JoinRequest(token=other, node_id="j1", csr_pem=csr), "PERMISSION_DENIED"),
        (pb.JoinRequest(token="x", node_id="j1", csr_pem=b"not a csr" * 1000), "UNAUTHENTICATED"),
    ]
    for request, code in bad * 20:
        assert _code(join_port.Join, request).name == code
    assert CountingCA.signed == []
    first = join_port.Join(pb.JoinRequest(token=used, node_id="j1", csr_pem=csr), timeout=10)
    assert b"BEGIN CERTIFICATE" in first.certificate_pem
    assert CountingCA.signed == ["j1"]
    # spent: refused before signing again
    again = pb.JoinRequest(token=used, node_id="j2", csr_pem=tls.make_csr(tls.new_key(), "j2"))
    assert _code(join_port.Join, again) == grpc.StatusCode.UNAUTHENTICATED
    assert CountingCA.signed == ["j1"]
    # a good token with a bad CSR is refused by the signer (and stays unspent)
    good = db.run_write(partial(node_identity.create_join_token, node_id="j3", ttl_s=600))[0]
    broken = pb.JoinRequest(token=good, node_id="j3", csr_pem=b"garbage")
    assert _code(join_port.Join, broken) == grpc.StatusCode.INVALID_ARGUMENT
    ok = pb.JoinRequest(token=good, node_id="j3", csr_pem=tls.make_csr(tls.new_key(), "j3"))
    assert join_port.Join(ok, timeout=10).node_id == "j3"
