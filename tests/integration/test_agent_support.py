"""Shared pieces of the agent tests: a fake controller (a real gRPC server that records every
call), an in-process agent, a subprocess agent, and process-group checks written independently
of the agent's own ``procfs`` module. Holds no tests itself."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from gpufleet.agent.main import run_agent
from gpufleet.rpc import tls
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc
from gpufleet.settings import Settings

T = TypeVar("T")
LEADER_EPOCH = 1
HEARTBEAT_S = 0.1
# The agents of the lifecycle tests run jobs as themselves (--job-uids agent): their jobs run
# this interpreter (which may be private to root, e.g. pyenv under a 0700 /root) and share
# files with the test through pytest's 0700 tmp dirs. Job users, cgroups and isolation are
# tested with per-attempt uids and a system Python in test_agent_containment.py.
JOB_UIDS = "agent"

Confirm = pb.ConfirmAssignmentResponse
Report = pb.ReportCompletionResponse


class FakeController(pb_grpc.ControllerServicer):
    """Records calls; answers are configurable per run_id."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.registrations: list[pb.RegisterNodeRequest] = []
        self.confirms: list[pb.ConfirmAssignmentRequest] = []
        self.heartbeats: list[pb.HeartbeatRequest] = []
        self.reports: list[pb.ReportCompletionRequest] = []
        self.confirm_results: dict[str, int] = {}
        self.pending_stops: list[pb.StopRunRequest] = []
        self.on_report: Callable[[pb.ReportCompletionRequest], Any] | None = None
        self.observed_at_report: dict[str, Any] = {}
        self.calls: list[tuple[str, str]] = []  # (method, run_id) in arrival order
        self.reregister_once = False

    def _record(self, items: list[Any], request: Any, method: str = "") -> None:
        with self.cond:
            items.append(request)
            if method:
                self.calls.append((method, getattr(request, "run_id", "")))
            self.cond.notify_all()

    def RegisterNode(self, request: pb.RegisterNodeRequest, context: Any) -> Any:
        self._record(self.registrations, request, "register")
        return pb.RegisterNodeResponse(leader_epoch=LEADER_EPOCH, heartbeat_interval_s=5.0)

    def ConfirmAssignment(self, request: pb.ConfirmAssignmentRequest, context: Any) -> Any:
        self._record(self.confirms, request, "confirm")
        result = self.confirm_results.get(request.run_id, Confirm.CONFIRMED)
        return pb.ConfirmAssignmentResponse(result=result)  # type: ignore[arg-type]

    def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> Any:
        with self.cond:
            stops, self.pending_stops = self.pending_stops, []
            reregister, self.reregister_once = self.reregister_once, False
        self._record(self.heartbeats, request)
        return pb.HeartbeatResponse(leader_epoch=LEADER_EPOCH, stop=stops, reregister=reregister)

    def ReportCompletion(self, request: pb.ReportCompletionRequest, context: Any) -> Any:
        if self.on_report is not None:
            self.observed_at_report[request.run_id] = self.on_report(request)
        self._record(self.reports, request, "report")
        return pb.ReportCompletionResponse(result=Report.ACCEPTED)

    def wait_for(self, predicate: Callable[[], T], timeout_s: float = 10.0) -> T:
        """Wait until ``predicate()`` is truthy (re-checked on every recorded call)."""
        deadline = time.monotonic() + timeout_s
        with self.cond:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out after {timeout_s} s waiting")
                self.cond.wait(min(left, 0.1))

    def reports_for(self, run_id: str) -> list[pb.ReportCompletionRequest]:
        with self.cond:
            return [r for r in self.reports if r.run_id == run_id]

    def wait_report(self, run_id: str, timeout_s: float = 10.0) -> pb.ReportCompletionRequest:
        return self.wait_for(lambda: self.reports_for(run_id), timeout_s)[0]


class TestPki:
    """A fleet CA for the agent tests (made once per test process): the fake controller
    serves the real mutual TLS with a controller certificate, and agents find a node
    certificate in their state dir, as after a join."""

    def __init__(self) -> None:
        self.ca = tls.init_ca(Path(tempfile.mkdtemp(prefix="gpufleet-test-pki-")) / "pki")
        self.key_pem, self.chain_pem = self.ca.issue_controller([])

    def provision(self, state_dir: Path, node_id: str) -> None:
        key = tls.new_key()
        cert = self.ca.sign_node_csr(tls.make_csr(key, node_id), node_id, 3600)
        tls.NodeCredentials(
            tls.key_pem(key), tls.cert_pem(cert) + self.ca.cert_pem, self.ca.cert_pem
        ).save(state_dir / "tls")

    def agent_channel(self, address: str, node_id: str) -> grpc.Channel:
        """The controller's channel to ``node_id``'s agent at ``address``."""
        creds = tls.channel_credentials(self.ca.cert_pem, self.key_pem, self.chain_pem)
        return tls.secure_channel(address, creds, tls.node_target_name(node_id))


_PKI: TestPki | None = None


def test_pki() -> TestPki:
    global _PKI
    if _PKI is None:
        _PKI = TestPki()
    return _PKI


test_pki.__test__ = False  # type: ignore[attr-defined]  # a helper, not a test
TestPki.__test__ = False  # type: ignore[attr-defined]


@contextmanager
def fake_controller(port: int = 0) -> Iterator[tuple[FakeController, str]]:
    fake = FakeController()
    pki = test_pki()
    server = grpc.server(ThreadPoolExecutor(max_workers=8))
    pb_grpc.add_ControllerServicer_to_server(fake, server)
    creds = tls.server_credentials(
        pki.key_pem, pki.chain_pem, pki.ca.cert_pem, require_client_auth=True
    )
    port = server.add_secure_port(f"127.0.0.1:{port}", creds)
    server.start()
    try:
        yield fake, f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def make_settings(controller_address: str, tmp: Path) -> Settings:
    return Settings(
        controller_address=controller_address,
        data_dir=tmp,
        object_store_url=f"file://{tmp / 'objects'}",
        default_grace_s=5.0,
    )


@dataclass
class InProcessAgent:
    """An agent running in a thread of the test process."""

    state_dir: Path
    stop_event: threading.Event
    thread: threading.Thread
    address: str = ""
    channel: grpc.Channel | None = None
    stub: pb_grpc.AgentStub | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def assign(self, **kw: Any) -> pb.AssignJobResponse:
        kw.setdefault("leader_epoch", LEADER_EPOCH)
        kw.setdefault("attempt", 1)
        assert self.stub is not None
        return self.stub.AssignJob(pb.AssignJobRequest(**kw), timeout=30)

    def stop_run(self, **kw: Any) -> pb.StopRunResponse:
        kw.setdefault("leader_epoch", LEADER_EPOCH)
        assert self.stub is not None
        return self.stub.StopRun(pb.StopRunRequest(**kw), timeout=10)


@contextmanager
def inprocess_agent(
    fake: FakeController,
    settings: Settings,
    state_dir: Path,
    gpus: str | None = "4xA100-40GB",
    **agent_kw: Any,
) -> Iterator[InProcessAgent]:
    stop = threading.Event()
    agent_kw.setdefault("job_uids", JOB_UIDS)
    before = len(fake.registrations)
    test_pki().provision(state_dir, "node-test")
    thread = threading.Thread(
        target=run_agent,
        kwargs={
            "settings": settings,
            "node_id": "node-test",
            "gpus": gpus,
            "port": 0,
            "state_dir": state_dir,
            "labels": {"rack": "r1"},
            "heartbeat_interval_s": HEARTBEAT_S,
            "stop_event": stop,
            **agent_kw,
        },
        daemon=True,
    )
    thread.start()
    agent = InProcessAgent(state_dir, stop, thread)
    try:
        reg = fake.wait_for(lambda: fake.registrations[before:], 15)[0]
        agent.address = reg.address
        agent.channel = test_pki().agent_channel(reg.address, reg.node_id)
        agent.stub = pb_grpc.AgentStub(agent.channel)
        yield agent
    finally:
        stop.set()
        thread.join(timeout=20)
        if agent.channel is not None:
            agent.channel.close()
        kill_leftover_groups(state_dir)


def kill_leftover_groups(state_dir: Path) -> None:
    """Test hygiene: SIGKILL every shim group recorded under ``state_dir``."""
    for claim in state_dir.glob("runs/*/shim.json"):
        data = json.loads(claim.read_text())
        if "pgid" in data:
            with suppress(ProcessLookupError, PermissionError):
                os.killpg(int(data["pgid"]), signal.SIGKILL)


def agent_subprocess(
    controller_address: str, tmp: Path, state_dir: Path, *, job_uids: str = JOB_UIDS
) -> subprocess.Popen[bytes]:
    """The agent as its own process (so the test can kill -9 it)."""
    test_pki().provision(state_dir, "node-sub")
    code = (
        "import logging, pathlib, sys\n"
        "from gpufleet.agent.main import run_agent\n"
        "from gpufleet.settings import Settings\n"
        "logging.basicConfig(level=logging.INFO)\n"
        f"s = Settings(controller_address={controller_address!r}, data_dir={str(tmp)!r},\n"
        f"             object_store_url={('file://' + str(tmp / 'objects'))!r})\n"
        f"run_agent(s, node_id='node-sub', gpus='2xH100-80GB', port=0,\n"
        f"          state_dir=pathlib.Path({str(state_dir)!r}), labels={{}},\n"
        f"          heartbeat_interval_s={HEARTBEAT_S}, job_uids={job_uids!r})\n"
    )
    log = open(tmp / f"agent-{time.monotonic_ns()}.log", "wb")  # noqa: SIM115 (child keeps it)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT, env=env
    )


def python_cmd(code: str) -> list[str]:
    return [sys.executable, "-c", code]


# ---------------------------------------------------------------- independent process checks


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, pgrp) of a pid, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    return fields[0], int(fields[2])


def live_group_members(pgid: int) -> list[int]:
    """Non-zombie pids in process group ``pgid`` ([] when os.killpg says it does not exist).
    Zombies count as gone: orphans are reaped by PID 1, which in some containers never reaps."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return []
    members = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            st = _stat(int(name))
            if st is not None and st[1] == pgid and st[0] not in "ZX":
                members.append(int(name))
    return members


def pid_alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] not in "ZX"


def wait_until(predicate: Callable[[], T], timeout_s: float = 10.0, step_s: float = 0.05) -> T:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s")
        time.sleep(step_s)
