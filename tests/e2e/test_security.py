"""The attacks of issue 6 (part 1), re-run against a real fleet: controller with mutual TLS
(gRPC on loopback in this process, as ``gpufleet up`` runs it), agents as real subprocesses
that joined with join tokens, jobs as real processes.

The attacker is this test process, with no credentials (plaintext, or TLS without a client
certificate), or with the certificate and key of another node (``n1``, read from its state
dir, as if that node were compromised). Every attack must be refused with an error at the
caller, change nothing, and leave the legitimate job on ``n2`` running to success.
"""

from __future__ import annotations

import shutil
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest
from sqlalchemy import select

from gpufleet.rpc import tls
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc
from gpufleet.services import node_identity
from gpufleet.services import nodes as nodes_service
from gpufleet.store.tables import JobRow, JobRunRow, NodeCertRow, NodeRow, SchedulingEventRow
from tests.e2e.harness import TERMINAL, Fleet

pytestmark = pytest.mark.slow

HUGE_EPOCH = 2**62
REFUSED_AT_HANDSHAKE = grpc.StatusCode.UNAVAILABLE
"""A call without a certificate the server accepts never gets past the TLS handshake."""


# ---------------------------------------------------------------- attacker's tools


def creds_of(fleet: Fleet, node_id: str) -> tls.NodeCredentials:
    creds = tls.NodeCredentials.load(fleet.tmp / "agents" / node_id / "tls")
    assert creds is not None, f"{node_id} has no saved credentials"
    return creds


def ca_pem(fleet: Fleet) -> bytes:
    return tls.read_ca_cert(fleet.settings.resolved_pki_dir())


def channel(
    fleet: Fleet, address: str, server_name: str, as_node: str | None, plaintext: bool = False
) -> grpc.Channel:
    if plaintext:
        return grpc.insecure_channel(address)
    if as_node is None:
        return tls.secure_channel(address, tls.channel_credentials(ca_pem(fleet)), server_name)
    c = creds_of(fleet, as_node)
    return tls.secure_channel(
        address, tls.channel_credentials(c.ca_pem, c.key_pem, c.chain_pem), server_name
    )


def controller_stub(fleet: Fleet, as_node: str | None, plaintext: bool = False) -> Any:
    ch = channel(fleet, fleet.settings.controller_address, tls.CONTROLLER_NAME, as_node, plaintext)
    return pb_grpc.ControllerStub(ch)


def agent_stub(fleet: Fleet, node_id: str, as_node: str | None, plaintext: bool = False) -> Any:
    with fleet.db.read() as s:
        address = s.execute(select(NodeRow.address).where(NodeRow.id == node_id)).scalar_one()
    return pb_grpc.AgentStub(
        channel(fleet, address, tls.node_target_name(node_id), as_node, plaintext)
    )


def refused(method: Callable[..., Any], request: Any) -> grpc.StatusCode:
    """The status code of a call that must fail."""
    try:
        answer = method(request, timeout=5)
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    raise AssertionError(f"the call was accepted: {answer}")


CREDENTIALS: list[tuple[str, dict[str, Any], set[grpc.StatusCode]]] = [
    ("plaintext", {"as_node": None, "plaintext": True}, {REFUSED_AT_HANDSHAKE}),
    ("tls-without-cert", {"as_node": None}, {REFUSED_AT_HANDSHAKE}),
    ("cert-of-n1", {"as_node": "n1"}, {grpc.StatusCode.PERMISSION_DENIED}),
]


# ---------------------------------------------------------------- the fleet under attack


def snapshot(fleet: Fleet, job_id: str) -> dict[str, Any]:
    """What an attack must not change: the job, its attempts, the nodes' registrations."""
    with fleet.db.read() as s:
        job = s.get(JobRow, job_id)
        assert job is not None
        runs = [
            (r.id, r.node_id, r.status, r.token, r.exit_code)
            for r in s.scalars(select(JobRunRow).where(JobRunRow.job_id == job_id))
        ]
        nodes = [
            (n.id, n.address, n.agent_epoch, n.labels, n.status)
            for n in s.scalars(select(NodeRow).order_by(NodeRow.id))
        ]
    return {
        "job": (job.status, job.current_run_id, job.fencing_epoch),
        "runs": runs,
        "nodes": nodes,
    }


@pytest.fixture
def victim(fleet: Fleet) -> tuple[Fleet, str, Path]:
    """n2 (H100) runs another team's job that holds a secret and waits for a go file;
    n1 (A100) is the node whose key the attacker stole."""
    fleet.start_agent("n2", gpus="2xH100-80GB")
    go = fleet.tmp / "go"
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    code = (
        "import os, sys, time\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
        "print('secret seen by the job:', os.environ['SECRET'])\n"
    )
    job_id = fleet.submit(
        {
            "command": [sys.executable, "-c", code, marker],
            "gpu_type": "H100",
            "env": {"SECRET": "s3cr3t-of-nlp"},
        },
        team="nlp",
    )
    fleet.wait_status(job_id, {"RUNNING"}, team="nlp")
    fleet.start_agent("n1", gpus="1xA100-40GB")
    return fleet, job_id, go


def finish_and_check(fleet: Fleet, job_id: str, go: Path) -> None:
    """The legitimate job ran through every attack: it ends SUCCEEDED, on n2, first attempt."""
    go.touch()
    done = fleet.wait_status(job_id, TERMINAL, team="nlp")
    assert done["status"] == "SUCCEEDED", done
    assert [a["node_id"] for a in done["attempts"]] == ["n2"]
    assert fleet.check() == []


def refusal_logged(fleet: Fleet, text: str) -> bool:
    logs = [fleet.tmp / "agent-n2.log", fleet.tmp / "agent-n1.log"]
    return any(text in p.read_text(errors="replace") for p in logs if p.exists())


# ---------------------------------------------------------------- controller -> agent attacks


def test_agent_refuses_assign_stop_and_list_from_anyone_but_a_controller(
    victim: tuple[Fleet, str, Path],
) -> None:
    fleet, job_id, go = victim
    before = snapshot(fleet, job_id)
    pwned = fleet.tmp / "pwned"
    run_id = before["job"][1]
    for name, how, codes in CREDENTIALS:
        stub = agent_stub(fleet, "n2", **how)
        assign = pb.AssignJobRequest(
            run_id=f"r-evil-{name}",
            job_id="j-evil",
            token=1,
            leader_epoch=HUGE_EPOCH,
            gpu_ids=[0],
            command=["touch", str(pwned)],
            attempt=1,
        )
        assert refused(stub.AssignJob, assign) in codes, name
        # the "huge leader epoch" StopRun: refused before the agent reads the epoch
        stop = pb.StopRunRequest(
            run_id=run_id, token=1, leader_epoch=HUGE_EPOCH, grace_s=0, reason="cancel"
        )
        assert refused(stub.StopRun, stop) in codes, name
        # ListRuns would show every team's run ids and fencing tokens
        assert refused(stub.ListRuns, pb.ListRunsRequest()) in codes, name
    time.sleep(0.5)
    assert not pwned.exists()
    assert snapshot(fleet, job_id) == before
    assert refusal_logged(fleet, "refused AssignJob from")
    assert refusal_logged(fleet, "needs a controller certificate")
    # the agent still takes real work from the controller (no epoch was persisted): a second
    # job on n2 starts and ends while the first is still running
    second = fleet.submit({"command": [sys.executable, "-c", "print(1)"], "gpu_type": "H100"})
    assert fleet.wait_status(second, TERMINAL)["status"] == "SUCCEEDED"
    finish_and_check(fleet, job_id, go)


def test_agent_verifies_it_is_called_by_the_fleet_controller_only(
    victim: tuple[Fleet, str, Path], tmp_path: Path
) -> None:
    """A controller certificate from another CA does not get past the handshake."""
    fleet, job_id, go = victim
    rogue = tls.init_ca(tmp_path / "rogue")
    key, chain = rogue.issue_controller([])
    with fleet.db.read() as s:
        address = s.execute(select(NodeRow.address).where(NodeRow.id == "n2")).scalar_one()
    ch = tls.secure_channel(
        address,
        tls.channel_credentials(ca_pem(fleet), key, chain),
        tls.node_target_name("n2"),
    )
    code = refused(pb_grpc.AgentStub(ch).ListRuns, pb.ListRunsRequest())
    assert code == REFUSED_AT_HANDSHAKE
    finish_and_check(fleet, job_id, go)


# ---------------------------------------------------------------- agent -> controller attacks


def test_forged_completion_and_confirm_for_another_nodes_run_are_refused(
    victim: tuple[Fleet, str, Path],
) -> None:
    fleet, job_id, go = victim
    before = snapshot(fleet, job_id)
    (run_id, _, _, token, _) = before["runs"][0]
    for name, how, codes in CREDENTIALS:
        stub = controller_stub(fleet, **how)
        for claimed in ("n2", "n1"):  # speak for n2, or for n1 about n2's run
            fail = pb.ReportCompletionRequest(
                node_id=claimed,
                run_id=run_id,
                token=token,
                outcome=pb.ReportCompletionRequest.EXITED,
                exit_code=1,
            )
            assert refused(stub.ReportCompletion, fail) in codes, name
            success = pb.ReportCompletionRequest(
                node_id=claimed,
                run_id=run_id,
                token=token,
                outcome=pb.ReportCompletionRequest.EXITED,
                exit_code=0,
                manifest_uri=f"file:///{fleet.tmp}/forged/MANIFEST.json",
            )
            assert refused(stub.ReportCompletion, success) in codes, name
            confirm = pb.ConfirmAssignmentRequest(
                node_id=claimed, run_id=run_id, token=token, pid=1
            )
            assert refused(stub.ConfirmAssignment, confirm) in codes, name
    assert snapshot(fleet, job_id) == before
    assert fleet.job(job_id, team="nlp")["status"] == "RUNNING"
    finish_and_check(fleet, job_id, go)


def test_n1_cannot_heartbeat_or_register_as_n2(victim: tuple[Fleet, str, Path]) -> None:
    fleet, job_id, go = victim
    before = snapshot(fleet, job_id)
    stub = controller_stub(fleet, as_node="n1")
    beat = pb.HeartbeatRequest(node_id="n2", agent_epoch=HUGE_EPOCH)
    assert refused(stub.Heartbeat, beat) == grpc.StatusCode.PERMISSION_DENIED
    # re-registering n2 with a huge agent epoch used to move the node to the caller for good
    grab = pb.RegisterNodeRequest(
        node_id="n2",
        address="127.0.0.1:1",
        agent_epoch=HUGE_EPOCH,
        gpus=[pb.Gpu(index=0, uuid="GPU-evil", gpu_type="H100", memory_mb=81920)],
    )
    code = refused(stub.RegisterNode, grab)
    assert code == grpc.StatusCode.PERMISSION_DENIED
    for how in ({"as_node": None, "plaintext": True}, {"as_node": None}):
        anon = controller_stub(fleet, **how)
        assert refused(anon.RegisterNode, grab) == REFUSED_AT_HANDSHAKE
    assert snapshot(fleet, job_id) == before
    # and n2 keeps heartbeating as itself
    with fleet.db.read() as s:
        seen = s.get(NodeRow, "n2").last_heartbeat_at  # type: ignore[union-attr]
    fleet.wait_for(lambda: _last_heartbeat(fleet, "n2") > seen, 10, "n2's next heartbeat")
    finish_and_check(fleet, job_id, go)


def _last_heartbeat(fleet: Fleet, node_id: str) -> Any:
    with fleet.db.read() as s:
        node = s.get(NodeRow, node_id)
        return None if node is None else node.last_heartbeat_at


def test_a_process_cannot_become_a_node_without_a_join_token(
    victim: tuple[Fleet, str, Path],
) -> None:
    """No join token, a made-up one, or a token bound to another id: no certificate, no node;
    so the next job (and its secrets) never goes to the impostor."""
    fleet, job_id, go = victim
    before = snapshot(fleet, job_id)
    join_ch = tls.secure_channel(
        fleet.settings.resolved_join_address(),
        tls.channel_credentials(ca_pem(fleet)),
        tls.CONTROLLER_NAME,
    )
    boot = pb_grpc.BootstrapStub(join_ch)
    csr = tls.make_csr(tls.new_key(), "evil")
    for secret in ("", "made-up-secret"):
        req = pb.JoinRequest(token=secret, node_id="evil", csr_pem=csr)
        assert refused(boot.Join, req) == grpc.StatusCode.UNAUTHENTICATED
    token, _ = _join_token(fleet, "n7")
    bound = pb.JoinRequest(token=token, node_id="evil", csr_pem=csr)
    assert refused(boot.Join, bound) == grpc.StatusCode.PERMISSION_DENIED
    # an unbound token cannot take over an existing node id either
    free, _ = _join_token(fleet, None)
    grab = pb.JoinRequest(token=free, node_id="n2", csr_pem=tls.make_csr(tls.new_key(), "n2"))
    assert refused(boot.Join, grab) == grpc.StatusCode.PERMISSION_DENIED
    # Renew needs a certificate: on the join port there is none
    renew = pb.RenewRequest(csr_pem=csr)
    assert refused(boot.Renew, renew) == grpc.StatusCode.PERMISSION_DENIED
    with fleet.db.read() as s:
        assert s.get(NodeRow, "evil") is None
        assert s.scalars(select(NodeCertRow).where(NodeCertRow.node_id == "evil")).all() == []
    assert snapshot(fleet, job_id) == before
    finish_and_check(fleet, job_id, go)


def _join_token(fleet: Fleet, node_id: str | None) -> tuple[str, Any]:
    return fleet.db.run_write(partial(node_identity.create_join_token, node_id=node_id, ttl_s=600))


def test_a_join_token_is_single_use(fleet: Fleet) -> None:
    token, _ = _join_token(fleet, None)
    boot = pb_grpc.BootstrapStub(
        tls.secure_channel(
            fleet.settings.resolved_join_address(),
            tls.channel_credentials(ca_pem(fleet)),
            tls.CONTROLLER_NAME,
        )
    )
    first = boot.Join(
        pb.JoinRequest(token=token, node_id="j1", csr_pem=tls.make_csr(tls.new_key(), "j1")),
        timeout=5,
    )
    assert first.node_id == "j1" and b"BEGIN CERTIFICATE" in first.certificate_pem
    again = pb.JoinRequest(token=token, node_id="j2", csr_pem=tls.make_csr(tls.new_key(), "j2"))
    assert refused(boot.Join, again) == grpc.StatusCode.UNAUTHENTICATED


# ---------------------------------------------------------------- revocation and rejoin


def test_a_revoked_node_certificate_is_refused_within_one_second(
    victim: tuple[Fleet, str, Path],
) -> None:
    fleet, job_id, go = victim
    stub = controller_stub(fleet, as_node="n1")
    beat = pb.HeartbeatRequest(node_id="n1", agent_epoch=HUGE_EPOCH)
    stub.Heartbeat(beat, timeout=5)  # accepted (a stale epoch changes nothing) and cached
    fleet.db.run_write(partial(node_identity.revoke_node, node_id="n1"))
    revoked_at = time.monotonic()
    failure: grpc.RpcError | None = None
    while failure is None:
        try:
            stub.Heartbeat(beat, timeout=5)
        except grpc.RpcError as exc:
            failure = exc
        assert time.monotonic() - revoked_at < 1.0, "still accepted 1 s after revocation"
        time.sleep(0.01)
    assert failure.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "revoked" in (failure.details() or "")
    took = time.monotonic() - revoked_at
    assert took < 1.0
    print(f"revoked certificate refused after {took * 1000:.0f} ms")
    finish_and_check(fleet, job_id, go)


def test_revocation_reaches_every_controller_replica_within_one_second(fleet: Fleet) -> None:
    """A standby controller on the same database (and CA) refuses the revoked certificate as
    soon as the leader does: each replica reads revocations from the database."""
    from gpufleet.controller.main import Controller
    from gpufleet.queue import InProcWaker
    from tests.ports import free_port

    fleet.start_agent("n1", gpus="1xA100-40GB")
    standby_settings = fleet.settings.model_copy(
        update={
            "controller_address": f"127.0.0.1:{free_port()}",
            "join_address": f"127.0.0.1:{free_port()}",
        }
    )
    standby = Controller(standby_settings, fleet.db, InProcWaker())
    standby.start()
    try:
        c = creds_of(fleet, "n1")
        stubs = [
            pb_grpc.ControllerStub(
                tls.secure_channel(
                    address,
                    tls.channel_credentials(c.ca_pem, c.key_pem, c.chain_pem),
                    tls.CONTROLLER_NAME,
                )
            )
            for address in (fleet.settings.controller_address, standby_settings.controller_address)
        ]
        beat = pb.HeartbeatRequest(node_id="n1", agent_epoch=HUGE_EPOCH)
        for stub in stubs:
            stub.Heartbeat(beat, timeout=5)  # accepted on both replicas
        fleet.db.run_write(partial(node_identity.revoke_node, node_id="n1"))
        revoked_at = time.monotonic()
        pending = list(stubs)
        while pending:
            assert time.monotonic() - revoked_at < 1.0, "a replica still accepts it after 1 s"
            for stub in list(pending):
                try:
                    stub.Heartbeat(beat, timeout=5)
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.PERMISSION_DENIED  # noqa: PT017
                    pending.remove(stub)
            time.sleep(0.01)
    finally:
        standby.stop()


def test_a_reinstalled_node_rejoins_under_its_id_and_its_old_key_stops_working(
    fleet: Fleet,
) -> None:
    fleet.start_agent("n1", gpus="1xA100-40GB")
    old = creds_of(fleet, "n1")
    fleet.kill_agent("n1")
    # re-installed: the state dir is gone; the harness makes a join token for n1 (as an
    # operator would with `gpufleet admin node join-token --node-id n1`)
    shutil.rmtree(fleet.tmp / "agents" / "n1")
    fleet.start_agent("n1", gpus="1xA100-40GB", wait=False)

    def registered_again() -> bool:
        with fleet.db.read() as s:
            n1 = s.get(NodeRow, "n1")
            return n1 is not None and n1.agent_epoch == 1 and n1.status == "HEALTHY"

    fleet.wait_for(lambda: (fleet.tmp / "agents/n1/tls/node.crt").exists(), 30, "the rejoin")
    fleet.wait_for(registered_again, 30, "n1 to register after its rejoin")
    new = creds_of(fleet, "n1")
    assert tls.serial_hex(new.cert) != tls.serial_hex(old.cert)
    thief = pb_grpc.ControllerStub(
        tls.secure_channel(
            fleet.settings.controller_address,
            tls.channel_credentials(old.ca_pem, old.key_pem, old.chain_pem),
            tls.CONTROLLER_NAME,
        )
    )
    beat = pb.HeartbeatRequest(node_id="n1", agent_epoch=HUGE_EPOCH)
    assert refused(thief.Heartbeat, beat) == grpc.StatusCode.PERMISSION_DENIED
    job = fleet.submit({"command": [sys.executable, "-c", "print(1)"]})
    assert fleet.wait_status(job, TERMINAL)["status"] == "SUCCEEDED"
    with fleet.db.read() as s:
        kinds = s.scalars(
            select(SchedulingEventRow.kind).where(SchedulingEventRow.node_id == "n1")
        ).all()
    assert kinds.count("node_joined") == 2


def test_agent_renews_its_certificate_before_it_expires(tmp_path: Path) -> None:
    """Node certificates of 6 s: the agent renews at 4 s over mutual TLS, and keeps working
    after its first certificate expired (an expired certificate is refused by the controller
    even on an open connection)."""
    fleet = Fleet(tmp_path, node_cert_ttl_s=6.0).start()
    try:
        fleet.start_agent("n1", gpus="1xA100-40GB")
        first = creds_of(fleet, "n1")

        def renewed() -> bool:
            with fleet.db.read() as s:
                return bool(
                    s.scalars(
                        select(NodeCertRow).where(
                            NodeCertRow.node_id == "n1", NodeCertRow.reason == "renew"
                        )
                    ).first()
                )

        fleet.wait_for(renewed, 20, "a renewed certificate")
        fleet.wait_for(
            lambda: datetime.now(UTC) > first.not_after + timedelta(seconds=1),
            20,
            "the first certificate to expire",
        )
        assert tls.serial_hex(creds_of(fleet, "n1").cert) != tls.serial_hex(first.cert)
        job = fleet.submit({"command": [sys.executable, "-c", "print(1)"]})
        assert fleet.wait_status(job, TERMINAL)["status"] == "SUCCEEDED"
        assert fleet.get("/v1/nodes")["items"][0]["status"] == "HEALTHY"
    finally:
        fleet.stop()


def test_a_rejoin_after_the_certificate_expired_keeps_the_running_job(tmp_path: Path) -> None:
    """Issue 24, item 11: node certificates of 6 s; the agent is stopped (kill -9: its job
    runs on under its shim) until its certificate has expired, then started again with a
    join token (as ``gpufleet up`` does). Its state dir is intact, so the join keeps the
    attempt the agent still holds: the job is not fenced and not run again (one attempt,
    SUCCEEDED)."""
    fleet = Fleet(tmp_path, node_cert_ttl_s=6.0).start()
    try:
        fleet.start_agent("n1", gpus="1xA100-40GB")
        go = fleet.tmp / "go"
        code = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
        marker = f"gpufleet-test-marker-{fleet.tmp.name}"
        job_id = fleet.submit({"command": [sys.executable, "-c", code, marker]})
        fleet.wait_status(job_id, {"RUNNING"})
        fleet.kill_agent("n1")  # stopped; the job's shim and process live on
        expiry = creds_of(fleet, "n1").not_after
        fleet.wait_for(
            lambda: datetime.now(UTC) > expiry + timedelta(seconds=1),
            20,
            "the certificate to expire",
        )
        fleet.start_agent("n1", gpus="1xA100-40GB", wait=False)  # with a join token

        def rejoined() -> bool:
            with fleet.db.read() as s:
                n1 = s.get(NodeRow, "n1")
                joins = s.scalars(
                    select(SchedulingEventRow.message).where(
                        SchedulingEventRow.node_id == "n1",
                        SchedulingEventRow.kind == "node_joined",
                    )
                ).all()
            return len(joins) == 2 and n1 is not None and n1.agent_epoch == 2

        fleet.wait_for(rejoined, 30, "n1 to rejoin and register")
        assert fleet.job(job_id)["status"] == "RUNNING"
        go.touch()
        done = fleet.wait_status(job_id, TERMINAL)
        assert done["status"] == "SUCCEEDED", done
        assert [a["status"] for a in done["attempts"]] == ["SUCCEEDED"]
        assert fleet.node("n1")["status"] == "HEALTHY"
        assert fleet.check() == []
    finally:
        fleet.stop()


def test_a_running_agent_whose_certificate_expired_joins_again_from_its_token_file(
    tmp_path: Path,
) -> None:
    """Node certificates of 6 s; a running agent, started with --join-token-file, is frozen
    (SIGSTOP) until its certificate has expired. Resumed with only the spent token in the
    file, it says what to do (one error line naming the command) instead of failing renewal
    after renewal; once a new token is written there it joins again without a restart,
    keeping its running job (one attempt, SUCCEEDED)."""
    import signal

    from gpufleet.processes import new_join_token

    fleet = Fleet(tmp_path, node_cert_ttl_s=6.0).start()
    token_file = fleet.tmp / "join-token"
    token_file.write_text(new_join_token(fleet.db, fleet.settings, "n1", 900)[0] + "\n")
    log = fleet.tmp / "agent-n1.log"
    try:
        fleet.start_agent(
            "n1",
            gpus="1xA100-40GB",
            env={"GPUFLEET_JOIN_TOKEN": ""},
            args=("--join-token-file", str(token_file)),
        )
        go = fleet.tmp / "go"
        code = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
        job_id = fleet.submit({"command": [sys.executable, "-c", code]})
        fleet.wait_status(job_id, {"RUNNING"})
        fleet.signal_agent("n1", signal.SIGSTOP)
        expiry = creds_of(fleet, "n1").not_after
        fleet.wait_for(
            lambda: datetime.now(UTC) > expiry + timedelta(seconds=1),
            20,
            "the certificate to expire",
        )
        fleet.signal_agent("n1", signal.SIGCONT)
        fleet.wait_for(
            lambda: "has no unspent join token" in log.read_text(), 20, "the agent to say so"
        )
        said = log.read_text()
        assert "gpufleet admin node join-token --node-id n1" in said, said[-2000:]
        assert str(token_file) in said
        token_file.write_text(new_join_token(fleet.db, fleet.settings, "n1", 900)[0] + "\n")

        def rejoined() -> bool:
            with fleet.db.read() as s:
                joins = s.scalars(
                    select(SchedulingEventRow.kind).where(
                        SchedulingEventRow.node_id == "n1",
                        SchedulingEventRow.kind == "node_joined",
                    )
                ).all()
            return len(joins) == 2 and fleet.node("n1")["status"] == "HEALTHY"

        fleet.wait_for(rejoined, 30, "n1 to join again and be HEALTHY")
        assert creds_of(fleet, "n1").not_after > expiry
        assert fleet.job(job_id)["status"] == "RUNNING"
        go.touch()
        done = fleet.wait_status(job_id, TERMINAL)
        assert done["status"] == "SUCCEEDED", done
        assert [a["status"] for a in done["attempts"]] == ["SUCCEEDED"]
        assert log.read_text().count("has no unspent join token") == 1
        assert fleet.check() == []
    finally:
        fleet.stop()


def test_operator_cli_joins_lists_revokes_and_forgets_a_node(fleet: Fleet) -> None:
    """The operator's path end to end, through the CLI: a join token, an agent that gets the
    CA from the controller by the token's fingerprint (no --ca-cert), then revoke and forget."""
    import json
    import os
    import subprocess

    from gpufleet.services import auth

    admin = fleet.db.run_write(
        lambda s: auth.create_token(s, "ops", is_admin=True, create_team_if_missing=True)
    )
    env = {
        **os.environ,
        "GPUFLEET_DATA_DIR": str(fleet.tmp),
        "GPUFLEET_DATABASE_URL": fleet.settings.resolved_database_url(),
        "GPUFLEET_OBJECT_STORE_URL": fleet.settings.resolved_object_store_url(),
        # `admin node ...` goes through the API with an admin token
        "GPUFLEET_URL": fleet.api.url,
        "GPUFLEET_TOKEN": admin,
        "GPUFLEET_CONFIG": str(fleet.tmp / "none.yaml"),
    }

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "gpufleet.cli.main", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    def listing() -> dict[str, Any]:
        rows = json.loads(cli("admin", "node", "list", "-o", "json").stdout)
        return {r["node_id"]: r for r in rows}

    again = cli("admin", "ca", "init")
    assert again.returncode == 2 and "exists already" in again.stderr
    made = cli("admin", "node", "join-token", "--node-id", "n5", "--ttl", "2m")
    assert made.returncode == 0, made.stderr
    token = made.stdout.strip().splitlines()[-1]
    assert token.startswith("gfj1.")
    log = open(fleet.tmp / "agent-n5.log", "ab")  # noqa: SIM115 (the child keeps it)
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpufleet.cli.main",
            "agent",
            "--node-id",
            "n5",
            "--gpus",
            "1xL4-24GB",
            "--state-dir",
            str(fleet.tmp / "agents" / "n5"),
            "--controller",
            fleet.settings.controller_address,
            "--join-address",
            fleet.settings.resolved_join_address(),
        ],
        env={**env, "GPUFLEET_JOIN_TOKEN": token},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    fleet.agents["n5"] = agent
    try:
        fleet.wait_for(lambda: _last_heartbeat(fleet, "n5") is not None, 30, "n5 to register")
        listed = {
            r["node_id"]: r for r in json.loads(cli("admin", "node", "list", "-o", "json").stdout)
        }
        assert listed["n5"]["cert_serial"] == tls.serial_hex(creds_of(fleet, "n5").cert)
        # the token was spent: a second agent cannot use it
        reuse = cli(
            "agent", "--node-id", "n6", "--gpus", "1xL4-24GB",
            "--state-dir", str(fleet.tmp / "agents" / "n6"),
            "--controller", fleet.settings.controller_address,
            "--join-address", fleet.settings.resolved_join_address(),
            "--join-token", token,
        )  # fmt: skip
        assert reuse.returncode == 4 and "UNAUTHENTICATED" in reuse.stderr
        # n5 is alive (heartbeats accepted): forgetting it needs --force, and says so
        live = cli("admin", "node", "forget", "n5")
        assert live.returncode == 2 and "looks alive" in live.stderr and "--force" in live.stderr
        assert "n5" in listing() and listing()["n5"]["status"] == "HEALTHY"
        revoked = cli("admin", "node", "revoke", "n5")
        assert revoked.returncode == 0 and "1 certificate(s) revoked" in revoked.stdout
        fleet.wait_for(
            lambda: (
                "heartbeat failed (PERMISSION_DENIED" in (fleet.tmp / "agent-n5.log").read_text()
            ),
            10,
            "n5's heartbeats to be refused",
        )
        forgot = cli("admin", "node", "forget", "n5")
        assert forgot.returncode == 0, forgot.stderr
        listed = {
            r["node_id"]: r for r in json.loads(cli("admin", "node", "list", "-o", "json").stdout)
        }
        assert (listed["n5"]["status"], listed["n5"]["cert_serial"]) == ("FORGOTTEN", None)
        assert all(n["node_id"] != "n5" for n in fleet.get("/v1/nodes")["items"])
        first_serial = tls.serial_hex(creds_of(fleet, "n5").cert)

        # the node comes back with a new join token for its id, its old (revoked)
        # certificate still saved in its state dir: the agent joins again instead of
        # presenting the revoked one forever (a new user's run retried it for minutes)
        fleet.kill_agent("n5")
        made = cli("admin", "node", "join-token", "--node-id", "n5", "--ttl", "2m")
        assert made.returncode == 0, made.stderr
        agent = subprocess.Popen(
            list(agent.args),  # the same command line
            env={**env, "GPUFLEET_JOIN_TOKEN": made.stdout.strip().splitlines()[-1]},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        fleet.agents["n5"] = agent
        fleet.wait_for(
            lambda: listing().get("n5", {}).get("status") == "HEALTHY", 30, "n5 to rejoin"
        )
        back = listing()["n5"]
        assert back["cert_serial"] == tls.serial_hex(creds_of(fleet, "n5").cert) != first_serial
        assert "refused this node's certificate" in (fleet.tmp / "agent-n5.log").read_text()
    finally:
        fleet.kill_agent("n5")


def test_a_revoked_node_gets_no_work_and_its_jobs_move_elsewhere(fleet: Fleet) -> None:
    """Revocation answers a compromised node: in the same transaction the node is FENCED (no
    placement, no AssignJob with another team's command and env ever reaches it), its running
    attempt is fenced and the job re-placed on a trusted node with a higher token, and its
    GPUs stay QUARANTINED until an operator confirms it dead. A rejoin lifts it."""
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    sleeper = [sys.executable, "-c", "import time; time.sleep(600)", marker]
    fleet.start_agent("n1", gpus="1xA100-40GB")
    first = fleet.submit({"command": sleeper, "gpu_type": "A100"}, team="nlp")
    fleet.wait_status(first, {"RUNNING"}, team="nlp")

    fleet.db.run_write(partial(node_identity.revoke_node, node_id="n1"))
    node = fleet.node("n1")
    assert node["status"] == "FENCED" and "revoked" in node["status_reason"]
    moved = fleet.job(first, team="nlp")
    assert moved["status"] == "PENDING", moved
    assert moved["attempts"][0]["status"] == "FENCED"
    fleet.wait_for(
        lambda: [p["node_id"] for p in fleet.job(first, team="nlp")["node_problems"]] == ["n1"],
        10,
        "why to name the fenced node",
    )

    # new work for the node's GPU type never goes there, even with its GPUs the only fit
    second = fleet.submit({"command": sleeper, "gpu_type": "A100"}, team="vision")
    time.sleep(3)  # several scheduling passes
    assert fleet.job(second)["attempts"] == []
    with fleet.db.read() as s:
        assert s.scalars(select(JobRunRow.job_id).where(JobRunRow.node_id == "n1")).all() == [
            first
        ]

    with fleet.http("vision") as c:
        assert c.delete(f"/v1/jobs/{second}").status_code == 202
    fleet.wait_status(second, TERMINAL)
    # a trusted node takes the fenced job: a new attempt there, token 2
    fleet.start_agent("n3", gpus="1xA100-40GB")
    again = fleet.wait_status(first, {"RUNNING"}, team="nlp")
    assert again["attempts"][-1]["node_id"] == "n3" and again["attempts"][-1]["token"] == 2

    # the operator confirms n1 dead: its quarantined GPU is released, nothing is violated
    fleet.db.run_write(
        partial(
            nodes_service.operator_fence, node_id="n1", reason="compromised", max_node_failures=3
        )
    )
    with fleet.http("nlp") as c:
        assert c.delete(f"/v1/jobs/{first}").status_code == 202
    fleet.wait_status(first, TERMINAL, team="nlp")
    assert fleet.check() == []
