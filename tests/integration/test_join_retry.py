"""A join whose answer is lost is answered again when the agent repeats it.

Found by the hollow-node fleet run (300 nodes): the controller committed a node's join (token
spent, certificate recorded) but the answer reached the agent after its 10 s call limit; the
agent retried the same request and was refused "invalid, used or expired join token", so the
node, its certificate lost, could never join. Replayed with a real gRPC join server over TLS
whose first Join answers after the agent's deadline, and the agent's own join code.
"""

from __future__ import annotations

import threading
import time
from concurrent import futures
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy import select

from gpufleet.agent import identity
from gpufleet.controller.identity import BootstrapServicer, ControllerTls, NodeAuthenticator
from gpufleet.domain.errors import Unauthenticated
from gpufleet.rpc import tls
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc
from gpufleet.services import node_identity
from gpufleet.store.db import Database
from gpufleet.store.tables import NodeCertRow


class SlowFirstAnswer(BootstrapServicer):
    """Commits the first Join, then answers it only after the caller's deadline."""

    delay_s = 2.5
    calls = 0

    def Join(self, request: pb.JoinRequest, context: grpc.ServicerContext) -> Any:
        answer = super().Join(request, context)
        SlowFirstAnswer.calls += 1
        if SlowFirstAnswer.calls == 1:
            time.sleep(self.delay_s)
        return answer


@pytest.fixture
def join_server(db: Database, tmp_path: Path) -> Any:
    tls.init_ca(tmp_path / "pki")
    ctl = ControllerTls(tmp_path / "pki", [])
    SlowFirstAnswer.calls = 0
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    pb_grpc.add_BootstrapServicer_to_server(
        SlowFirstAnswer(db, ctl.ca, NodeAuthenticator(db), 3600.0), server
    )
    port = server.add_secure_port("127.0.0.1:0", ctl.server_credentials(require_client_auth=False))
    server.start()
    try:
        yield f"127.0.0.1:{port}", ctl
    finally:
        server.stop(grace=0)


def _certs(db: Database, node_id: str) -> list[NodeCertRow]:
    with db.read() as s:
        return list(s.scalars(select(NodeCertRow).where(NodeCertRow.node_id == node_id)))


def test_a_join_answered_after_the_agents_deadline_is_answered_again(
    join_server: Any, db: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    address, ctl = join_server
    monkeypatch.setattr(identity, "CALL_TIMEOUT_S", 1.0)  # the first answer comes at 2.5 s
    secret = db.run_write(partial(node_identity.create_join_token, node_id=None, ttl_s=600))[0]
    token = tls.format_join_token(tls.fingerprint(ctl.ca_pem), secret)
    found = identity.join(
        tmp_path / "state",
        "slow-1",
        join_address=address,
        join_token=token,
        ca_cert=None,
        stop=threading.Event(),
    )
    assert found is not None
    _creds, facts = found
    assert SlowFirstAnswer.calls >= 2  # the agent did time out and repeat the join
    certs = _certs(db, "slow-1")
    assert facts.serial in {c.serial for c in certs}
    assert len(certs) == SlowFirstAnswer.calls and all(c.revoked_at is None for c in certs)
    assert len({c.trust_epoch for c in certs}) == 1  # one join: the epoch went up once
    assert tls.NodeCredentials.load(identity.tls_dir(tmp_path / "state")) is not None


def _join(db: Database, secret: str, node_id: str, serial: str, key: str) -> None:
    from datetime import UTC, datetime, timedelta

    db.run_write(
        partial(
            node_identity.join,
            secret=secret,
            node_id=node_id,
            serial=serial,
            not_after=datetime.now(UTC) + timedelta(hours=1),
            key_sha256=key,
        )
    )


def test_only_the_same_node_and_key_may_repeat_a_join_and_not_after_a_revocation(
    db: Database,
) -> None:
    secret = db.run_write(partial(node_identity.create_join_token, node_id=None, ttl_s=600))[0]
    _join(db, secret, "r1", "aa01", "k" * 64)
    _join(db, secret, "r1", "aa02", "k" * 64)  # the same join again: answered
    for node_id, key in (("r1", "other" + "k" * 59), ("r2", "k" * 64), ("r1", "")):
        with pytest.raises(Unauthenticated):  # another key, another node, no key: spent
            _join(db, secret, node_id, "aa03", key)
    db.run_write(partial(node_identity.revoke_node, node_id="r1"))
    with pytest.raises(Unauthenticated):  # revoked since: the repeat must not undo it
        _join(db, secret, "r1", "aa04", "k" * 64)
    assert sorted(c.serial for c in _certs(db, "r1")) == ["aa01", "aa02"]
