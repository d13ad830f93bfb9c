"""Job network isolation with real namespaces, veths, nftables, processes and containers.

A hostile job (a process job, then the same probe in a container) tries the node's database,
Redis, an API-like service bound to every address, the agent's gRPC and metrics ports (on
loopback, on its gateway and on the node's other addresses), a denied host:port and raw
sockets; it must be refused everything but an "internet" server in a namespace of the test's
own and its own loopback. The same probe run in the host namespace reaches the services, so
the refusals are the namespace's doing. Needs root, ``ip`` and ``nft``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from gpufleet.agent.runner import agent_scope
from gpufleet.agent.runtime.jobnet import NETNS_DIR, JobNet, NetPolicy
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc
from tests.integration import test_agent_support as support
from tests.integration.test_agent_support import (
    FakeController,
    InProcessAgent,
    fake_controller,
    inprocess_agent,
    make_settings,
    wait_until,
)

A = pb.AssignJobResponse
R = pb.ReportCompletionRequest
SYSTEM_PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
REDIS_URL = "redis://127.0.0.1:6379/15"
REDIS_KEY = "gpufleet:test:jobnet:bucket"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nftables)"),
    pytest.mark.skipif(
        not (shutil.which("ip") and shutil.which("nft")), reason="needs iproute2 and nftables"
    ),
]

PROBE = r"""
import json, os, socket, sys
targets = json.loads(os.environ["TARGETS"])
gateway = ""
try:
    for line in open("/proc/net/route").read().splitlines()[1:]:
        f = line.split()
        if f[1] == "00000000":
            gateway = socket.inet_ntoa(bytes.fromhex(f[2])[::-1])
except OSError:
    pass
res = {}
for name, (host, port) in targets.items():
    host = gateway if host == "GATEWAY" else host
    if not host:
        res[name] = "no-gateway"
        continue
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect((host, port))
        if name.startswith("redis"):  # what the hostile job did: another team's bucket
            s.sendall(b"*3\r\n$6\r\nSELECT\r\n$2\r\n15\r\n")
            s.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$11\r\n-1000000000\r\n"
                      % (len(os.environ["REDIS_KEY"]), os.environ["REDIS_KEY"].encode()))
        data = s.recv(64) if name.startswith("internet") else b""
        res[name] = "connected" + (":" + data.decode().strip() if data else "")
    except ConnectionRefusedError:
        res[name] = "refused"
    except socket.timeout:
        res[name] = "timeout"
    except OSError as exc:
        res[name] = "unreachable:%s" % exc.errno
    finally:
        s.close()
srv = socket.socket()
srv.bind(("127.0.0.1", 0))
srv.listen(1)
try:
    socket.create_connection(srv.getsockname(), timeout=3).close()
    res["own_loopback"] = "connected"
except OSError as exc:
    res["own_loopback"] = "failed:%s" % exc
try:
    socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3)).close()
    res["sniff"] = "opened"
except PermissionError:
    res["sniff"] = "refused"
res["interfaces"] = sorted(name for _, name in socket.if_nameindex())
print("RESULT " + json.dumps(res, sort_keys=True), flush=True)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class CountingListener:
    """A TCP service on every address of the node (as an API server on 0.0.0.0 would be)
    that counts the connections it accepted."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("0.0.0.0", 0))
        self.sock.listen(16)
        self.port = int(self.sock.getsockname()[1])
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()


def node_addresses() -> list[str]:
    """The node's IPv4 addresses outside loopback and job subnets (its own; a connection
    to them never leaves the host)."""
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True)
    found = []
    for line in out.stdout.splitlines():
        parts = line.split()
        addr = parts[3].split("/")[0]
        if not addr.startswith(("127.", "10.231.", "10.233.")):
            found.append(addr)
    return found


@pytest.fixture(scope="module")
def internet() -> Iterator[dict[str, Any]]:
    """A namespace standing in for the internet: 10.233.7.2, a server that answers "hello"
    on one port and another port the agent's deny list names."""
    ns, dev = f"gt-inet-{os.getpid()}", f"gti{os.getpid() % 100000}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    subprocess.run(
        ["ip", "link", "add", dev, "type", "veth", "peer", "name", "eth0", "netns", ns],
        check=True,
    )
    subprocess.run(["ip", "addr", "add", "10.233.7.1/30", "dev", dev], check=True)
    subprocess.run(["ip", "link", "set", dev, "up"], check=True)
    for cmd in ("addr add 10.233.7.2/30 dev eth0", "link set eth0 up", "link set lo up"):
        subprocess.run(["ip", "-n", ns, *cmd.split()], check=True)
    ports = [free_port(), free_port()]
    code = (
        "import socket, sys, threading\n"
        "def serve(port):\n"
        "    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
        "    s.bind(('10.233.7.2', port)); s.listen(16)\n"
        "    while True:\n"
        "        c, _ = s.accept(); c.sendall(b'hello\\n'); c.close()\n"
        "for p in sys.argv[1:]:\n"
        "    threading.Thread(target=serve, args=(int(p),), daemon=True).start()\n"
        "threading.Event().wait()\n"
    )
    server = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code, *map(str, ports)]
    )
    try:
        wait_until(lambda: _reachable("10.233.7.2", ports[0]), timeout_s=10)
        yield {"ns": ns, "ok_port": ports[0], "denied_port": ports[1]}
    finally:
        server.kill()
        server.wait()
        subprocess.run(["ip", "link", "del", dev], check=False)
        subprocess.run(["ip", "netns", "del", ns], check=False)


def _reachable(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def public_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gpufleet-jobnet-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def node(
    internet: dict[str, Any], public_tmp: Path
) -> Iterator[tuple[FakeController, InProcessAgent, dict[str, Any]]]:
    """An agent (per-attempt uids, podman) whose deny list names the internet's second
    port, with an API-like service and a metrics port on the node."""
    api = CountingListener()
    metrics = free_port()
    with fake_controller() as (fake, address):
        settings = make_settings(address, public_tmp / "data")
        with inprocess_agent(
            fake,
            settings,
            public_tmp / "state",
            job_uids="per-attempt",
            metrics_port=metrics,
            job_egress_deny=f"10.233.7.2:{internet['denied_port']}",
        ) as agent:
            agent_port = int(agent.address.rsplit(":", 1)[1])
            net = JobNet("netns", agent_scope((public_tmp / "state").resolve(), "node-test"))
            yield (
                fake,
                agent,
                {
                    "api": api,
                    "metrics": metrics,
                    "agent_port": agent_port,
                    "net": net,
                    "state": public_tmp / "state",
                },
            )


def targets(info: dict[str, Any], internet: dict[str, Any]) -> dict[str, list[Any]]:
    services = {
        "postgres": 5432,
        "redis": 6379,
        "api": info["api"].port,
        "agent_grpc": info["agent_port"],
        "agent_metrics": info["metrics"],
    }
    out: dict[str, list[Any]] = {}
    for name, port in services.items():
        out[f"{name}_loopback"] = ["127.0.0.1", port]
        out[f"{name}_gateway"] = ["GATEWAY", port]
        for i, addr in enumerate(node_addresses()):
            out[f"{name}_node{i}"] = [addr, port]
    out["internet_ok"] = ["10.233.7.2", internet["ok_port"]]
    out["internet_denied"] = ["10.233.7.2", internet["denied_port"]]
    return out


def result_of(log: Path) -> dict[str, Any]:
    for line in log.read_text().splitlines():
        if line.startswith("RESULT "):
            return dict(json.loads(line[len("RESULT ") :]))
    raise AssertionError(f"no RESULT line in {log}: {log.read_text()[-2000:]}")


def nft_table(net: JobNet) -> str:
    return subprocess.run(
        ["nft", "list", "table", "inet", net.table], capture_output=True, text=True, check=True
    ).stdout


def links_with(prefix: str) -> list[str]:
    return sorted(p.name for p in Path("/sys/class/net").iterdir() if p.name.startswith(prefix))


@pytest.fixture
def redis_bucket() -> Iterator[redis.Redis]:
    r = redis.Redis.from_url(REDIS_URL)
    r.set(REDIS_KEY, "5")
    yield r
    r.delete(REDIS_KEY)


def assert_isolated(res: dict[str, Any], names: list[str]) -> None:
    reached = {
        n: res[n]
        for n in names
        if not n.startswith("internet") and not res[n].startswith(("refused", "unreachable"))
    }
    assert reached == {}, f"the job reached the node: {reached}"
    assert res["internet_ok"] == "connected:hello", res
    assert res["internet_denied"] == "refused", res
    assert res["own_loopback"] == "connected"
    assert res["sniff"] == "refused"
    assert res["interfaces"] == ["eth0", "lo"], "the job sees the node's interfaces"


class TestControl:
    def test_the_probe_reaches_the_services_from_the_host_namespace(
        self, node: Any, internet: dict[str, Any], public_tmp: Path
    ) -> None:
        """Without a namespace the same probe reaches them: the refusals below are real."""
        _, _, info = node
        want = targets(info, internet)
        env = {"TARGETS": json.dumps(want), "REDIS_KEY": "gpufleet:test:jobnet:control"}
        out = subprocess.run(
            [
                "setpriv",
                "--reuid=65534",
                "--regid=65534",
                "--clear-groups",
                SYSTEM_PY,
                "-c",
                PROBE,
            ],
            env={**env, "PATH": "/usr/bin:/bin"},
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
        )
        redis.Redis.from_url(REDIS_URL).delete("gpufleet:test:jobnet:control")
        log = public_tmp / "control.log"
        log.write_text(out.stdout + out.stderr)
        res = result_of(log)
        for name in (
            "postgres_loopback",
            "redis_loopback",
            "api_loopback",
            "agent_grpc_loopback",
            "agent_metrics_loopback",
            "internet_ok",
        ):
            assert res[name].startswith("connected"), (name, res[name])


class TestProcessJob:
    def test_hostile_process_job_reaches_nothing_of_the_node(
        self, node: Any, internet: dict[str, Any], redis_bucket: redis.Redis
    ) -> None:
        fake, agent, info = node
        net: JobNet = info["net"]
        table_before = nft_table(net)
        accepted = info["api"].accepted
        want = targets(info, internet)
        resp = agent.assign(
            run_id="r-hostile",
            job_id="j-hostile",
            token=1,
            command=[SYSTEM_PY, "-c", PROBE],
            env={"TARGETS": json.dumps(want), "REDIS_KEY": REDIS_KEY, "PATH": "/usr/bin:/bin"},
        )
        assert resp.result == A.STARTED, resp.message
        assert fake.registrations[-1].labels["gpufleet/job-network"] == "netns"
        report = fake.wait_report("r-hostile", timeout_s=120)
        assert report.outcome == R.EXITED and report.exit_code == 0, report
        res = result_of(info["state"] / "runs" / "r-hostile" / "output.log")
        assert_isolated(res, list(want))
        assert info["api"].accepted == accepted, "the node's service accepted a connection"
        assert redis_bucket.get(REDIS_KEY) == b"5", "the job changed Redis"
        # the namespace and its veth are gone once the attempt ended; the table is as before
        wait_until(lambda: not (NETNS_DIR / net.ns_name("r-hostile")).exists(), timeout_s=15)
        wait_until(lambda: not links_with(net.host_if("r-hostile")), timeout_s=15)
        assert nft_table(net) == table_before

    def test_many_attempts_leave_no_namespace_or_veth(self, node: Any) -> None:
        fake, agent, info = node
        net: JobNet = info["net"]
        runs = [f"r-leak-{i}" for i in range(12)]
        for i, run_id in enumerate(runs):
            resp = agent.assign(
                run_id=run_id, job_id=f"j-leak-{i}", token=1, command=[SYSTEM_PY, "-c", "pass"]
            )
            assert resp.result == A.STARTED, resp.message
        for run_id in runs:
            assert fake.wait_report(run_id, timeout_s=120).exit_code == 0
        wait_until(lambda: net.existing() == [], timeout_s=30)
        wait_until(lambda: links_with(net.if_prefix) == [], timeout_s=30)


class TestContainerJob:
    def test_hostile_container_job_reaches_nothing_of_the_node(
        self, node: Any, internet: dict[str, Any], redis_bucket: redis.Redis
    ) -> None:
        from tests.container_support import PYTHON

        fake, agent, info = node
        net: JobNet = info["net"]
        accepted = info["api"].accepted
        want = targets(info, internet)
        resp = agent.assign(
            run_id="r-hostile-ctr",
            job_id="j-hostile-ctr",
            token=1,
            image=PYTHON,
            command=["python3", "-c", PROBE],
            env={"TARGETS": json.dumps(want), "REDIS_KEY": REDIS_KEY},
        )
        assert resp.result == A.STARTED, resp.message
        report = fake.wait_report("r-hostile-ctr", timeout_s=240)
        log = info["state"] / "runs" / "r-hostile-ctr" / "output.log"
        assert report.outcome == R.EXITED and report.exit_code == 0, (report, log.read_text())
        res = result_of(log)
        assert_isolated(res, list(want))
        assert info["api"].accepted == accepted
        assert redis_bucket.get(REDIS_KEY) == b"5"
        wait_until(lambda: not (NETNS_DIR / net.ns_name("r-hostile-ctr")).exists(), timeout_s=30)


def test_restarted_agent_keeps_a_running_attempts_namespace_and_prunes_stale_ones(
    public_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = public_tmp / "restart-state"
    net = JobNet("netns", agent_scope(state.resolve(), "node-test"), NetPolicy())
    stale = net.create("r-ended-long-ago")  # left by a crash: no attempt owns it
    job = (
        "import socket, time\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1)\n"
        "while True:\n"
        "    socket.create_connection(s.getsockname()).close(); time.sleep(0.2)\n"
    )
    with fake_controller() as (fake, address):
        settings = make_settings(address, public_tmp / "restart-data")
        # the harness kills leftover jobs when an agent stops: not this time
        monkeypatch.setattr(support, "kill_leftover_groups", lambda _state: None)
        with inprocess_agent(fake, settings, state, job_uids="per-attempt") as agent:
            resp = agent.assign(
                run_id="r-long", job_id="j-long", token=1, command=[SYSTEM_PY, "-c", job]
            )
            assert resp.result == A.STARTED, resp.message
            assert not stale.path.exists(), "a stale namespace survived the agent's start"
            ns = net.lookup("r-long")
            assert ns is not None
            inode = os.stat(ns.path).st_ino
        # the agent stopped; the attempt runs on in its namespace
        assert os.readlink(f"/proc/{resp.pid}/ns/net") == _ns_link(ns.path)
        monkeypatch.undo()
        with inprocess_agent(fake, settings, state, job_uids="per-attempt") as agent:
            time.sleep(1.0)  # the restarted agent has adopted and pruned by now
            kept = net.lookup("r-long")
            assert kept is not None and os.stat(kept.path).st_ino == inode
            assert os.readlink(f"/proc/{resp.pid}/ns/net") == _ns_link(kept.path)
            agent.stop_run(run_id="r-long", token=1, grace_s=0.5, reason="cancel")
            assert fake.wait_report("r-long", timeout_s=30).outcome == R.STOPPED
            wait_until(lambda: net.lookup("r-long") is None, timeout_s=15)
        assert net.existing() == []


def _ns_link(path: Path) -> str:
    """``net:[inode]`` of a bound namespace file, as /proc/PID/ns/net reads."""
    return f"net:[{os.stat(path).st_ino}]"


class TestGangMember:
    @pytest.mark.parametrize("kind", ["process", "container"])
    def test_gang_member_in_the_host_namespace_is_filtered_by_its_uid(
        self, node: Any, internet: dict[str, Any], redis_bucket: redis.Redis, kind: str
    ) -> None:
        """A multi-node job's member shares the node's namespace (its peers dial the node's
        address) but its uid is refused the database, Redis, the agent's ports and the deny
        list; an ephemeral port on the node (where MASTER_PORT and NCCL/gloo listen) and
        the internet stay reachable."""
        fake, agent, info = node
        net: JobNet = info["net"]
        rendezvous = CountingListener()  # an ephemeral port, as the rank 0 agent picks
        want = targets(info, internet)
        want = {k: v for k, v in want.items() if not k.endswith("_gateway")}
        want["rendezvous"] = ["127.0.0.1", rendezvous.port]
        run_id = f"r-gang-{kind}"
        image: dict[str, Any] = {}
        command = [SYSTEM_PY, "-c", PROBE]
        if kind == "container":
            from tests.container_support import PYTHON

            image, command = {"image": PYTHON}, ["python3", "-c", PROBE]
        resp = agent.assign(
            run_id=run_id,
            job_id=f"j-gang-{kind}",
            token=1,
            gang_size=2,
            rank=0,
            command=command,
            **image,
            env={
                "TARGETS": json.dumps(want),
                "REDIS_KEY": REDIS_KEY,
                "PATH": "/usr/bin:/bin",
                "GPUFLEET_GANG_SIZE": "2",
            },
        )
        assert resp.result == A.STARTED, resp.message
        assert fake.wait_report(run_id, timeout_s=240).exit_code == 0
        res = result_of(info["state"] / "runs" / run_id / "output.log")
        assert not (NETNS_DIR / net.ns_name(run_id)).exists()
        # the node's own interfaces (the internet's host-side veth among them)
        assert any(n.startswith("gti") for n in res["interfaces"]), res["interfaces"]
        for name in ("postgres", "redis", "agent_grpc", "agent_metrics"):
            assert res[f"{name}_loopback"] == "refused", (name, res)
            for key in [k for k in res if k.startswith(f"{name}_node")]:
                assert res[key] == "refused", (key, res)
        assert res["internet_denied"] == "refused"
        assert res["internet_ok"] == "connected:hello"
        assert res["rendezvous"] == "connected" and rendezvous.accepted == 1
        assert res["sniff"] == "refused"
        assert redis_bucket.get(REDIS_KEY) == b"5"


def test_agent_killed_and_restarted_keeps_the_namespace_of_a_running_attempt(
    tmp_path: Path,
) -> None:
    """kill -9 of the agent: no cleanup of any kind. The restarted agent adopts the running
    attempt in the namespace it had; the attempt that ended meanwhile loses its namespace
    once reported; nothing is left after the last attempt and a clean stop."""
    from tests.integration.test_agent_support import agent_subprocess, kill_leftover_groups

    state = tmp_path / "state"
    go = tmp_path / "go"
    net = JobNet("netns", agent_scope(state.resolve(), "node-sub"))
    wait = f"import os, time\nwhile not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
    with fake_controller() as (fake, address):
        agent = agent_subprocess(address, tmp_path, state)
        try:
            reg = fake.wait_for(lambda: [r for r in fake.registrations if r.agent_epoch == 1], 30)
            channel = support.test_pki().agent_channel(reg[0].address, reg[0].node_id)
            stub = pb_grpc.AgentStub(channel)
            for run_id, code in (("r-ends", "pass"), ("r-runs", wait)):
                resp = stub.AssignJob(
                    pb.AssignJobRequest(
                        run_id=run_id,
                        job_id=f"j-{run_id}",
                        token=1,
                        attempt=1,
                        leader_epoch=support.LEADER_EPOCH,
                        command=[SYSTEM_PY, "-c", code],
                    ),
                    timeout=30,
                )
                assert resp.result == A.STARTED, resp.message
            pid = resp.pid
            ns = wait_until(lambda: net.lookup("r-runs"), timeout_s=10)
            assert ns is not None
            inode = os.stat(ns.path).st_ino
            fake.wait_for(lambda: {c.run_id for c in fake.confirms} >= {"r-ends", "r-runs"})
            channel.close()
            agent.kill()
            agent.wait()

            agent = agent_subprocess(address, tmp_path, state)
            fake.wait_for(lambda: [r for r in fake.registrations if r.agent_epoch == 2], 30)
            assert fake.wait_report("r-ends", timeout_s=30).exit_code == 0
            kept = net.lookup("r-runs")
            assert kept is not None and os.stat(kept.path).st_ino == inode
            assert os.readlink(f"/proc/{pid}/ns/net") == _ns_link(kept.path)
            wait_until(lambda: net.lookup("r-ends") is None, timeout_s=15)
            go.touch()
            assert fake.wait_report("r-runs", timeout_s=30).exit_code == 0
            wait_until(lambda: net.existing() == [], timeout_s=15)
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(timeout=30) == 0
            tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
            assert net.table not in tables.stdout, "the stopped agent left its table"
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
            kill_leftover_groups(state)
            net.prune(keep=())
            net.teardown_rules()


def _sub_agent(
    fake: FakeController, address: str, tmp: Path, state: Path
) -> tuple[subprocess.Popen[bytes], Any, pb_grpc.AgentStub]:
    """An agent subprocess on ``state``, registered: (process, channel, stub)."""
    from tests.integration.test_agent_support import agent_subprocess

    before = len(fake.registrations)
    tmp.mkdir(parents=True, exist_ok=True)
    proc = agent_subprocess(address, tmp, state)
    reg = fake.wait_for(lambda: fake.registrations[before:], 30)[0]
    channel = support.test_pki().agent_channel(reg.address, reg.node_id)
    return proc, channel, pb_grpc.AgentStub(channel)


def _assign(stub: pb_grpc.AgentStub, run_id: str, code: str) -> int:
    resp = stub.AssignJob(
        pb.AssignJobRequest(
            run_id=run_id,
            job_id=f"j-{run_id}",
            token=1,
            attempt=1,
            leader_epoch=support.LEADER_EPOCH,
            command=[SYSTEM_PY, "-c", code],
        ),
        timeout=30,
    )
    assert resp.result == A.STARTED, resp.message
    return int(resp.pid)


def _gone(pid: int) -> bool:
    from gpufleet.agent import procfs

    st = procfs.read_stat(pid)
    return st is None or st.state in "ZX"


def _tables() -> str:
    return subprocess.run(["nft", "list", "tables"], capture_output=True, text=True).stdout


def test_a_killed_agents_network_is_swept_by_an_agent_on_another_state_dir(
    tmp_path: Path,
) -> None:
    """kill -9 of an agent and of one of its jobs, its state dir never used again (a wiped
    node): the next agent to start on the host, on a state dir of its own, removes that
    job's namespace and veth; the namespace of its job that still runs stays, with the
    table that filters it, until that job has ended; a live agent's namespace and table are
    never touched."""
    dead_state, live_state = tmp_path / "dead-state", tmp_path / "live-state"
    dead = JobNet("netns", agent_scope(dead_state.resolve(), "node-sub"))
    live = JobNet("netns", agent_scope(live_state.resolve(), "node-sub"))
    assert dead.tag != live.tag
    held_go, live_go = tmp_path / "held-go", tmp_path / "live-go"

    def wait(path: Path) -> str:
        return f"import os, time\nwhile not os.path.exists({str(path)!r}): time.sleep(0.05)\n"

    procs: list[subprocess.Popen[bytes]] = []
    with fake_controller() as (fake, address):
        try:
            killed, channel, stub = _sub_agent(fake, address, tmp_path / "dead", dead_state)
            procs.append(killed)
            gone_pid = _assign(stub, "r-gone", wait(tmp_path / "never"))
            held_pid = _assign(stub, "r-held", wait(held_go))
            channel.close()
            other, channel, stub = _sub_agent(fake, address, tmp_path / "live", live_state)
            procs.append(other)
            live_pid = _assign(stub, "r-live", wait(live_go))
            channel.close()
            fake.wait_for(lambda: {c.run_id for c in fake.confirms} >= {"r-gone", "r-live"})
            held = wait_until(lambda: dead.lookup("r-held"), timeout_s=10)
            assert dead.lookup("r-gone") is not None and live.lookup("r-live") is not None

            killed.kill()  # the agent and one of its jobs: kill -9, no cleanup of any kind
            killed.wait()
            claim = json.loads((dead_state / "runs" / "r-gone" / "shim.json").read_text())
            os.killpg(int(claim["pgid"]), signal.SIGKILL)
            wait_until(lambda: _gone(gone_pid), timeout_s=10)

            fresh = tmp_path / "fresh"  # another agent starts, on a state dir of its own
            with inprocess_agent(fake, make_settings(address, fresh), fresh / "state"):
                assert not (NETNS_DIR / dead.ns_name("r-gone")).exists()
                assert links_with(dead.host_if("r-gone")) == []
                kept = dead.lookup("r-held")  # a job runs in it: kept, with its filter
                assert kept is not None and os.stat(kept.path).st_ino == os.stat(held.path).st_ino
                assert os.readlink(f"/proc/{held_pid}/ns/net") == _ns_link(kept.path)
                assert f"inet {dead.table}\n" in _tables() + "\n"
                assert live.lookup("r-live") is not None  # the live agent's: untouched
                assert f"inet {live.table}\n" in _tables() + "\n"

                held_go.touch()  # the held job ends; the next sweep removes the rest
                wait_until(lambda: _gone(held_pid), timeout_s=10)
                from gpufleet.agent.runtime import jobnet_owners

                swept = jobnet_owners.sweep()
                assert dead.ns_name("r-held") in swept.namespaces, swept
                assert dead.existing() == [] and links_with(dead.if_prefix) == []
                assert f"inet {dead.table}\n" not in _tables() + "\n"
                assert jobnet_owners.read(dead.tag) is None
                assert live.lookup("r-live") is not None
                assert f"inet {live.table}\n" in _tables() + "\n"
                owner = jobnet_owners.read(live.tag)
                assert owner is not None and owner.pid == other.pid
                assert os.readlink(f"/proc/{live_pid}/ns/net") == _ns_link(
                    NETNS_DIR / live.ns_name("r-live")
                )
        finally:
            held_go.touch()
            live_go.touch()
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            for state, net in ((dead_state, dead), (live_state, live)):
                support.kill_leftover_groups(state)
                net.prune(keep=())
                net.teardown_rules()
