"""A node renewing its certificate in a loop while an operator revokes it (SQLite and
PostgreSQL, a real controller over mutual TLS, a real agent that joined with a join token):
no certificate it obtained before, during or after the revocation is accepted by
RegisterNode, Heartbeat or Renew once the revocation has returned and the controller's
revocation cache (``REVOCATION_CACHE_S``) has passed; a rejoin with a new join token is
trusted again, the old certificates stay refused."""

from __future__ import annotations

import shutil
import threading
import time
from functools import partial

import grpc
import pytest
from sqlalchemy import select

from gpufleet.controller.identity import REVOCATION_CACHE_S
from gpufleet.rpc import tls
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc
from gpufleet.services import node_identity
from gpufleet.store.tables import NodeCertRow, NodeRow
from tests.e2e.harness import Fleet
from tests.e2e.test_security import HUGE_EPOCH, creds_of

pytestmark = pytest.mark.slow

RENEWERS = 4


def _stub(fleet: Fleet, c: tls.NodeCredentials) -> pb_grpc.ControllerStub:
    return pb_grpc.ControllerStub(
        tls.secure_channel(
            fleet.settings.controller_address,
            tls.channel_credentials(c.ca_pem, c.key_pem, c.chain_pem),
            tls.CONTROLLER_NAME,
        )
    )


def _renew(fleet: Fleet, c: tls.NodeCredentials) -> tls.NodeCredentials:
    key = tls.new_key()
    ch = tls.secure_channel(
        fleet.settings.controller_address,
        tls.channel_credentials(c.ca_pem, c.key_pem, c.chain_pem),
        tls.CONTROLLER_NAME,
    )
    try:
        answer = pb_grpc.BootstrapStub(ch).Renew(
            pb.RenewRequest(csr_pem=tls.make_csr(key, "n1")), timeout=10
        )
    finally:
        ch.close()
    return tls.NodeCredentials(tls.key_pem(key), answer.certificate_pem, answer.ca_pem)


def _accepted(
    fleet: Fleet,
    c: tls.NodeCredentials,
    only: tuple[str, ...] = ("Heartbeat", "RegisterNode", "Renew"),
) -> list[str]:
    """The calls (of ``only``: Heartbeat, RegisterNode, Renew) that ``c`` gets answered."""
    stub = _stub(fleet, c)
    calls = {
        "Heartbeat": lambda: stub.Heartbeat(
            pb.HeartbeatRequest(node_id="n1", agent_epoch=HUGE_EPOCH), timeout=10
        ),
        "RegisterNode": lambda: stub.RegisterNode(
            pb.RegisterNodeRequest(node_id="n1", address="127.0.0.1:1", agent_epoch=HUGE_EPOCH),
            timeout=10,
        ),
        "Renew": lambda: _renew(fleet, c),
    }
    out = []
    for name, call in calls.items():
        if name not in only:
            continue
        try:
            call()
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.PERMISSION_DENIED, (name, exc)  # noqa: PT017
            continue
        out.append(name)
    return out


def test_a_renewal_loop_racing_revoke_keeps_no_usable_certificate(fleet: Fleet) -> None:
    fleet.start_agent("n1", gpus="1xA100-40GB")
    fleet.kill_agent("n1")  # the renewing "node" is now this test, with n1's real key
    first = creds_of(fleet, "n1")
    obtained: list[tls.NodeCredentials] = [first]
    lock = threading.Lock()
    stop = threading.Event()
    revoked = threading.Event()
    after_revoke: list[str] = []  # serials signed and recorded after the revoke returned
    errors: list[BaseException] = []

    def renew_loop() -> None:
        mine = first
        while not stop.is_set():
            try:
                mine = _renew(fleet, mine)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.PERMISSION_DENIED:
                    errors.append(exc)
                continue
            except BaseException as exc:  # reported by the test
                errors.append(exc)
                return
            with lock:
                obtained.append(mine)
                if revoked.is_set():
                    after_revoke.append(tls.serial_hex(mine.cert))

    threads = [threading.Thread(target=renew_loop, daemon=True) for _ in range(RENEWERS)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(obtained) < 20 and time.monotonic() < deadline and not errors:
        time.sleep(0.05)
    assert len(obtained) >= 20, f"only {len(obtained)} renewals; errors: {errors}"
    fleet.db.run_write(partial(node_identity.revoke_node, node_id="n1"))
    revoked.set()
    returned = time.monotonic()
    time.sleep(REVOCATION_CACHE_S + 1.0)  # the renewers go on past the cache's bound
    stop.set()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    time.sleep(max(0.0, returned + REVOCATION_CACHE_S + 0.1 - time.monotonic()))
    with fleet.db.read() as s:
        recorded = s.scalars(select(NodeCertRow).where(NodeCertRow.node_id == "n1")).all()
    print(
        f"{len(obtained)} certificates obtained, {len(recorded)} recorded, "
        f"{len(after_revoke)} after the revoke returned"
    )
    escaped = {tls.serial_hex(c.cert): calls for c in obtained if (calls := _accepted(fleet, c))}
    assert escaped == {}, f"certificates still accepted after revoke: {escaped}"
    # the ones renewed after the revoke returned are those of renewals already past their
    # transaction; none may be newer than the cache's bound
    assert len(after_revoke) <= RENEWERS, after_revoke

    # a re-installed node rejoins with a new join token: trusted again, the old ones are not
    shutil.rmtree(fleet.tmp / "agents" / "n1")
    fleet.start_agent("n1", gpus="1xA100-40GB", wait=False)

    def registered_again() -> bool:
        with fleet.db.read() as s:
            n1 = s.get(NodeRow, "n1")
            return n1 is not None and n1.agent_epoch == 1 and n1.status == "HEALTHY"

    fleet.wait_for(lambda: (fleet.tmp / "agents/n1/tls/node.crt").exists(), 30, "the rejoin")
    fleet.wait_for(registered_again, 30, "n1 to register after its rejoin")
    fresh = creds_of(fleet, "n1")
    assert _accepted(fleet, fresh, only=("Heartbeat", "Renew")) == ["Heartbeat", "Renew"]
    time.sleep(REVOCATION_CACHE_S + 0.1)
    assert [c for c in obtained if _accepted(fleet, c)] == []
