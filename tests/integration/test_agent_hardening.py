"""Hostile process jobs, with real processes, cgroups, loop mounts, namespaces and job users.

A fork bomb stops at its pids limit; a job filling its scratch filesystem fails alone
(DISK_FULL) while the node stays HEALTHY and a neighbour succeeds; a job cannot see another
job's processes, command line or /tmp; a setuid-root binary gives a job no privilege; a
restarted agent keeps the scratch mount of an attempt it adopts and removes stale ones.

The agent runs in this process and talks real gRPC to a fake controller. Needs root and cgroup
containment with a ``pids`` controller (this development machine: cgroup v1, root). Jobs run
``/usr/bin/python3`` so that per-attempt job uids can execute it. Shared files live under
``/var/lib/gpufleet`` (not /tmp: each job has its own /tmp).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.agent.runner import JOBS_ROOT, agent_scope
from gpufleet.agent.runtime import jobns
from gpufleet.agent.runtime.containment import detect
from gpufleet.agent.scratch import ScratchDisks
from gpufleet.agent.workdir import StartError
from gpufleet.domain.labels import value_problem
from gpufleet.objectstore import ObjectStore
from gpufleet.rpc.protos import fleet_pb2 as pb
from tests.integration.test_agent_support import (
    FakeController,
    InProcessAgent,
    fake_controller,
    inprocess_agent,
    make_settings,
    pid_alive,
    wait_until,
)

A = pb.AssignJobResponse
R = pb.ReportCompletionRequest
SYSTEM_PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
FOUND = detect("probe")
ISOLATION = jobns.detect()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, mounts, job users)"),
    pytest.mark.skipif(not FOUND.pids, reason=f"no pids controller ({FOUND.kind})"),
]

NODE_PIDS_MAX = 200
NODE_DISK_MB = 48


def py(code: str, *args: str) -> list[str]:
    return [SYSTEM_PY, "-c", code, *args]


@pytest.fixture(scope="module")
def public() -> Iterator[Path]:
    """A directory job users can traverse, outside /tmp (which every job has its own of)."""
    base = Path("/var/lib/gpufleet")
    base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="test-hardening-", dir=base))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def env(public: Path) -> Iterator[tuple[FakeController, InProcessAgent, ObjectStore, Path]]:
    with fake_controller() as (fake, address):
        root = public / "agent"
        root.mkdir()
        settings = make_settings(address, root / "data")
        with inprocess_agent(
            fake,
            settings,
            root / "state",
            job_uids="per-attempt",
            job_pids_max=NODE_PIDS_MAX,
            job_disk_mb=NODE_DISK_MB,
        ) as agent:
            yield fake, agent, ObjectStore(settings.resolved_object_store_url()), root


def job_root(agent: InProcessAgent, run_id: str) -> Path:
    return JOBS_ROOT / agent_scope(agent.state_dir.resolve(), "node-test") / run_id


def started_event(agent: InProcessAgent, run_id: str) -> dict:
    lines = (agent.state_dir / "assignments.jsonl").read_text().splitlines()
    return next(json.loads(x) for x in lines if '"started"' in x and f'"{run_id}"' in x)


def healthy(fake: FakeController) -> bool:
    return bool(fake.heartbeats) and fake.heartbeats[-1].health == "HEALTHY"


def stop(fake: FakeController, agent: InProcessAgent, run_id: str) -> pb.ReportCompletionRequest:
    agent.stop_run(run_id=run_id, token=1, grace_s=0.5, reason="cancel")
    return fake.wait_report(run_id, timeout_s=60)


def test_agent_says_what_isolation_it_has(env) -> None:
    fake, _, _, _ = env
    labels = dict(fake.registrations[-1].labels)
    assert labels["gpufleet/job-pids-max"] == str(NODE_PIDS_MAX)
    assert labels["gpufleet/job-disk-mb"] == str(NODE_DISK_MB)
    text = labels["gpufleet/job-isolation"]
    want = "no-new-privs.private-tmp" + (".hidepid" if ISOLATION.hide_pids else "")
    want += ".no-node-sockets" if ISOLATION.hide_dirs else ""
    assert text == want
    for value in (text, labels["gpufleet/job-pids-max"], labels["gpufleet/job-disk-mb"]):
        assert value_problem("gpufleet/job-isolation", value) is None, value


FORK_BOMB = r"""
import os, sys, time
print("bomb", flush=True)
while True:
    try:
        os.fork()   # parent and child both keep forking
    except OSError:
        time.sleep(0.05)
"""


def test_fork_bomb_stops_at_its_pids_limit_and_a_neighbour_starts_and_succeeds(env) -> None:
    fake, agent, store, _ = env
    limit = 40
    bomb = agent.assign(
        run_id="r-bomb", job_id="j-bomb", token=1, pids_limit=limit, command=py(FORK_BOMB)
    )
    assert bomb.result == A.STARTED, bomb.message
    cgroup = started_event(agent, "r-bomb")["runtime_state"]["cgroup"]["dirs"]
    pids_dir = Path(cgroup.get("pids") or cgroup["unified"])
    try:
        assert (pids_dir / "pids.max").read_text().strip() == str(limit)
        # the bomb reaches its limit (the kernel refuses forks past it) ...
        wait_until(lambda: int((pids_dir / "pids.current").read_text()) >= limit, 30)
        time.sleep(1.0)
        assert int((pids_dir / "pids.current").read_text()) <= limit
        assert len((pids_dir / "cgroup.procs").read_text().split()) <= limit
        # ... and the node carries on: a neighbour (node default limit) starts, forks, succeeds
        code = (
            "import os, subprocess, sys\n"
            "out = subprocess.run(['/bin/sh', '-c', 'echo child'], capture_output=True)\n"
            "open(os.path.join(os.environ['GPUFLEET_ARTIFACTS_DIR'], 'ok'), 'wb')"
            ".write(out.stdout)\n"
        )
        nb = agent.assign(run_id="r-nb-bomb", job_id="j-nb-bomb", token=1, command=py(code))
        assert nb.result == A.STARTED, nb.message
        nb_dirs = started_event(agent, "r-nb-bomb")["runtime_state"]["cgroup"]["dirs"]
        report = fake.wait_report("r-nb-bomb", timeout_s=60)
        assert (report.outcome, report.exit_code) == (R.EXITED, 0), report.message
        prefix = "jobs/j-nb-bomb/attempts/r-nb-bomb"
        assert store.get_bytes(f"{prefix}/artifacts/ok") == b"child\n"
        nb_pids = Path(nb_dirs.get("pids") or nb_dirs["unified"])
        assert not nb_pids.exists()  # removed after the end
    finally:
        report = stop(fake, agent, "r-bomb")
    assert report.outcome == R.STOPPED
    assert not pids_dir.exists(), "the bomb's cgroup is gone: every process of it was killed"


def test_node_default_pids_limit_applies_to_a_job_without_one(env) -> None:
    fake, agent, _, _ = env
    resp = agent.assign(
        run_id="r-defpids", job_id="j-defpids", token=1, command=py("import time; time.sleep(60)")
    )
    assert resp.result == A.STARTED, resp.message
    dirs = started_event(agent, "r-defpids")["runtime_state"]["cgroup"]["dirs"]
    try:
        pids = Path(dirs.get("pids") or dirs["unified"])
        assert (pids / "pids.max").read_text().strip() == str(NODE_PIDS_MAX)
    finally:
        stop(fake, agent, "r-defpids")


FILLER = r"""
import os
path = os.path.join(os.environ["GPUFLEET_CHECKPOINT_DIR"], "huge.bin")
chunk = b"x" * (1024 * 1024)
written = 0
with open(os.path.join(os.environ["GPUFLEET_CHECKPOINT_DIR"], "step.txt"), "w") as f:
    f.write("step 7\n")
with open(path, "wb") as f:
    while True:
        f.write(chunk)   # raises OSError(ENOSPC) once the scratch filesystem is full
        f.flush()
        written += 1
"""

NEIGHBOUR = r"""
import os, time
art = os.environ["GPUFLEET_ARTIFACTS_DIR"]
while not os.path.exists(os.path.join(art, "go")):
    time.sleep(0.05)
with open(os.path.join(art, "result.bin"), "wb") as f:
    f.write(b"y" * (4 * 1024 * 1024))
print("neighbour done", flush=True)
"""


def test_job_filling_its_scratch_fails_alone_node_healthy_neighbour_succeeds(env) -> None:
    fake, agent, store, _ = env
    nb = agent.assign(run_id="r-nb-disk", job_id="j-nb-disk", token=1, command=py(NEIGHBOUR))
    assert nb.result == A.STARTED, nb.message
    nb_root = job_root(agent, "r-nb-disk")
    assert os.path.ismount(nb_root), "the neighbour has its own scratch filesystem"
    disk_free_before = dict(fake.heartbeats[-1].disk_free_mb)

    filler = agent.assign(
        run_id="r-fill", job_id="j-fill", token=1, disk_mb=32, command=py(FILLER)
    )
    assert filler.result == A.STARTED, filler.message
    fill_root = job_root(agent, "r-fill")
    assert os.path.ismount(fill_root)
    report = fake.wait_report("r-fill", timeout_s=60)

    assert report.outcome == R.EXITED and report.exit_code == 1
    assert report.reason == "DISK_FULL"
    assert "disk_mb=32" in report.message
    log = store.get_bytes("jobs/j-fill/attempts/r-fill/logs/output.log").decode()
    assert "No space left on device" in log
    # what the job wrote before the disk was full is uploaded
    ckpt = "jobs/j-fill/attempts/r-fill/checkpoints"
    assert store.get_bytes(f"{ckpt}/step.txt") == b"step 7\n"
    assert len(store.get_bytes(f"{ckpt}/huge.bin")) > 16 * 1024 * 1024
    # the node stays healthy (its own disks barely moved) and the neighbour runs on
    n = len(fake.heartbeats)
    fake.wait_for(lambda: len(fake.heartbeats) > n + 1, timeout_s=20)
    assert healthy(fake), fake.heartbeats[-1].health
    after = dict(fake.heartbeats[-1].disk_free_mb)
    for path, free in disk_free_before.items():
        assert abs(after[path] - free) < 512, (path, free, after[path])
    assert pid_alive(nb.pid)
    (nb_root / "artifacts" / "go").touch()
    nb_report = fake.wait_report("r-nb-disk", timeout_s=60)
    assert (nb_report.outcome, nb_report.exit_code) == (R.EXITED, 0), nb_report.message
    result = store.get_bytes("jobs/j-nb-disk/attempts/r-nb-disk/artifacts/result.bin")
    assert len(result) == 4 * 1024 * 1024
    # once reported, each attempt's filesystem is unmounted and its image deleted
    images = agent.state_dir / "scratch"
    wait_until(lambda: not os.path.ismount(fill_root) and not os.path.ismount(nb_root), 30)
    wait_until(lambda: not list(images.glob("r-fill*")) and not list(images.glob("r-nb-d*")), 30)
    assert healthy(fake)


def test_a_disk_mb_larger_than_the_node_fails_the_start_as_the_jobs_fault(env) -> None:
    fake, agent, _, _ = env
    resp = agent.assign(
        run_id="r-bigdisk",
        job_id="j-bigdisk",
        token=1,
        disk_mb=64 * 1024 * 1024,
        command=py("print('never')"),
    )
    assert resp.result == A.FAILED_TO_START
    assert "disk_mb=" in resp.message
    report = fake.wait_report("r-bigdisk", timeout_s=30)
    assert report.outcome == R.NEVER_STARTED and not report.node_fault


KEEPER = r"""
import os, subprocess, time
with open("/tmp/keeper-secret.txt", "w") as f:
    f.write("team A's secret")
art = os.environ["GPUFLEET_ARTIFACTS_DIR"]
import ctypes
libc = ctypes.CDLL(None, use_errno=True)
shmid = libc.shmget(0x47460001, 4096, 0o1000 | 0o666)  # IPC_CREAT, key 0x47460001
open(os.path.join(art, "shmid"), "w").write(str(shmid))
open(os.path.join(art, "ready"), "w").close()
time.sleep(600)
"""

SNOOP = r"""
import json, os, subprocess, sys
targets = json.loads(sys.argv[1])
seen = {}
me = os.getuid()
pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
seen["foreign_pids"] = sorted(p for p in pids if os.stat(f"/proc/{p}").st_uid != me)
for name, pid in targets["pids"].items():
    try:
        seen[name] = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace")
    except OSError as exc:
        seen[name] = f"ERROR {type(exc).__name__}"
seen["tmp"] = sorted(os.listdir("/tmp"))
seen["ipcs"] = subprocess.run(["ipcs", "-m"], capture_output=True, text=True).stdout
seen["var_tmp"] = sorted(os.listdir("/var/tmp"))
with open("/tmp/snoop-own.txt", "w") as f:
    f.write("mine")
seen["nnp"] = [l for l in open("/proc/self/status") if l.startswith("NoNewPrivs")][0].split()[1]
seen["setuid_id_euid"] = subprocess.run(
    [targets["setuid_id"], "-u"], capture_output=True, text=True
).stdout.strip()
seen["uid"] = me
with open(os.path.join(os.environ["GPUFLEET_ARTIFACTS_DIR"], "seen.json"), "w") as f:
    json.dump(seen, f)
"""


def test_job_cannot_see_another_jobs_processes_argv_or_tmp_nor_gain_setuid_root(
    env, public: Path
) -> None:
    fake, agent, store, _ = env
    secret_arg = "--api-key=sk-victim-4711"
    keeper = agent.assign(
        run_id="r-victim", job_id="j-victim", token=1, command=py(KEEPER, secret_arg)
    )
    assert keeper.result == A.STARTED, keeper.message
    ready = job_root(agent, "r-victim") / "artifacts" / "ready"
    wait_until(ready.exists, timeout_s=20)
    assert secret_arg.encode() in Path(f"/proc/{keeper.pid}/cmdline").read_bytes()
    shim_pid = started_event(agent, "r-victim")["shim_pid"]
    assert secret_arg.encode() in Path(f"/proc/{shim_pid}/cmdline").read_bytes()
    assert not Path("/tmp/keeper-secret.txt").exists(), "the job's /tmp is its own"
    assert int((ready.parent / "shmid").read_text()) >= 0, "the job made its SysV segment"
    host_ipcs = subprocess.run(["ipcs", "-m"], capture_output=True, text=True).stdout
    assert "0x47460001" not in host_ipcs, "the job's SysV memory is in its own IPC namespace"
    # a setuid-root copy of id(1) on the host, executable by anyone
    setuid_dir = public / "bin"
    setuid_dir.mkdir(exist_ok=True)
    setuid_dir.chmod(0o755)
    setuid_id = setuid_dir / "id"
    shutil.copy2("/usr/bin/id", setuid_id)
    os.chown(setuid_id, 0, 0)
    setuid_id.chmod(0o4755)
    # control: without no_new_privs the copy does elevate a job uid (so the check can fail)
    control = subprocess.run(
        [
            "setpriv",
            "--reuid=1999999999",
            "--regid=1999999999",
            "--clear-groups",
            "--",
            str(setuid_id),
            "-u",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert control.stdout.strip() == "0"
    targets = {
        "pids": {"victim_cmdline": keeper.pid, "victim_shim_cmdline": shim_pid},
        "setuid_id": str(setuid_id),
    }

    snoop = agent.assign(
        run_id="r-snoop", job_id="j-snoop", token=1, command=py(SNOOP, json.dumps(targets))
    )

    assert snoop.result == A.STARTED, snoop.message
    report = fake.wait_report("r-snoop", timeout_s=60)
    assert (report.outcome, report.exit_code) == (R.EXITED, 0), report.message
    seen = json.loads(store.get_bytes("jobs/j-snoop/attempts/r-snoop/artifacts/seen.json"))
    assert seen["uid"] not in (0, os.getuid())
    assert "keeper-secret.txt" not in seen["tmp"] and "keeper-secret.txt" not in seen["var_tmp"]
    assert not Path("/tmp/snoop-own.txt").exists()
    assert "0x47460001" not in seen["ipcs"], seen["ipcs"]
    assert seen["nnp"] == "1"
    assert seen["setuid_id_euid"] == str(seen["uid"]), "the setuid-root binary elevated the job"
    if ISOLATION.hide_pids:
        assert seen["foreign_pids"] == []
        assert seen["victim_cmdline"].startswith("ERROR"), seen["victim_cmdline"]
        assert seen["victim_shim_cmdline"].startswith("ERROR"), seen["victim_shim_cmdline"]
    for text in (
        json.dumps(seen),
        store.get_bytes("jobs/j-snoop/attempts/r-snoop/logs/output.log").decode(),
    ):
        assert "sk-victim-4711" not in text
    stop(fake, agent, "r-victim")


SLEEPER = r"""
import os, time
open(os.path.join(os.environ["GPUFLEET_CHECKPOINT_DIR"], "c1"), "w").write("1")
time.sleep(600)
"""


PG_SOCKET = Path("/var/run/postgresql/.s.PGSQL.5432")

KNOCK = r"""
import json, os, socket, sys
seen = {"uid": os.getuid()}
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        seen[path] = "connected"
    except OSError as exc:
        seen[path] = f"ERROR {type(exc).__name__}"
    finally:
        s.close()
seen["resolv"] = open("/etc/resolv.conf").read()
seen["run"] = sorted(os.listdir("/run"))
with open(os.path.join(os.environ["GPUFLEET_ARTIFACTS_DIR"], "knock.json"), "w") as f:
    json.dump(seen, f)
"""


@pytest.mark.skipif(not PG_SOCKET.exists(), reason="no local PostgreSQL Unix socket")
def test_job_cannot_connect_to_the_nodes_unix_sockets_postgresql_or_one_under_run(env) -> None:
    import socket

    fake, agent, store, _ = env
    assert ISOLATION.hide_dirs, ISOLATION.problems
    run_dir = Path(tempfile.mkdtemp(prefix="gf-test-sock-", dir="/run"))
    run_dir.chmod(0o755)
    ours = run_dir / "daemon.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(ours))
        ours.chmod(0o777)
        listener.listen(8)
        targets = [str(PG_SOCKET), str(ours)]
        # control: the same connects work from outside a job, as an unprivileged uid too
        dial = (
            "import socket, sys\n"
            "for p in sys.argv[1:]:\n"
            "    s = socket.socket(socket.AF_UNIX); s.connect(p); print('connected', p)"
        )
        as_nobody = ["setpriv", "--reuid=1999999999", "--regid=1999999999", "--clear-groups"]
        control = subprocess.run(
            [*as_nobody, "--", *py(dial, *targets)],
            capture_output=True,
            text=True,
        )
        assert control.returncode == 0, control.stderr
        assert control.stdout.count("connected") == 2
        host_resolv = Path("/etc/resolv.conf").read_text()

        knock = agent.assign(
            run_id="r-knock", job_id="j-knock", token=1, command=py(KNOCK, *targets)
        )

        assert knock.result == A.STARTED, knock.message
        report = fake.wait_report("r-knock", timeout_s=60)
        assert (report.outcome, report.exit_code) == (R.EXITED, 0), report.message
        seen = json.loads(store.get_bytes("jobs/j-knock/attempts/r-knock/artifacts/knock.json"))
        assert seen["uid"] not in (0, os.getuid())
        assert seen[str(PG_SOCKET)].startswith("ERROR"), seen
        assert seen[str(ours)].startswith("ERROR"), seen
        assert run_dir.name not in seen["run"] and "postgresql" not in seen["run"], seen["run"]
        assert seen["resolv"] == host_resolv, "the job still resolves names as the node does"
    finally:
        listener.close()
        shutil.rmtree(run_dir, ignore_errors=True)


def test_restarted_agent_keeps_an_adopted_attempts_mount_and_removes_stale_ones(
    public: Path,
) -> None:
    root = public / "restart"
    root.mkdir()
    state = root / "state"
    with fake_controller() as (fake, address):
        settings = make_settings(address, root / "data")
        kw = {"job_uids": "per-attempt", "job_disk_mb": NODE_DISK_MB}
        with inprocess_agent(fake, settings, state, **kw) as first:
            resp = first.assign(run_id="r-live", job_id="j-live", token=1, command=py(SLEEPER))
            assert resp.result == A.STARTED, resp.message
            live = job_root(first, "r-live")
            wait_until((live / "checkpoints" / "c1").exists, timeout_s=20)
            fake.wait_for(lambda: fake.confirms)
            first.stop_event.set()  # the agent stops, its attempts run on
            first.thread.join(timeout=20)
            assert not first.thread.is_alive()
            assert pid_alive(resp.pid) and os.path.ismount(live)
            # a crash left the mount and image of an attempt that ended and was cleaned
            stale = live.parent / "r-stale"
            stale.mkdir()
            disks = ScratchDisks(state.resolve() / "scratch", NODE_DISK_MB)
            disks.create("r-stale", stale, 16, 0, 0)
            assert os.path.ismount(stale)
            other = live.parent / "r-operator"  # a mount that is not a scratch filesystem
            other.mkdir()
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(other)], check=True
            )

            with inprocess_agent(fake, settings, state, **kw) as agent:
                assert not os.path.ismount(stale), "the stale mount is removed at start"
                assert os.path.ismount(other), "only the agent's own images are unmounted"
                subprocess.run(["umount", str(other)], check=True)
                other.rmdir()
                assert not disks.image("r-stale").exists()
                assert os.path.ismount(live), "the adopted attempt keeps its filesystem"
                assert (live / "checkpoints" / "c1").read_text() == "1"
                assert pid_alive(resp.pid)
                report = stop(fake, agent, "r-live")
                assert report.outcome == R.STOPPED
                store = ObjectStore(settings.resolved_object_store_url())
                assert store.get_bytes("jobs/j-live/attempts/r-live/checkpoints/c1") == b"1"
                image = disks.image("r-live")
                wait_until(lambda: not os.path.ismount(live) and not image.exists(), 30)


def test_an_agent_that_cannot_bound_or_hide_says_so_at_start_and_in_its_label(
    public: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = public / "degraded"
    root.mkdir()
    with fake_controller() as (fake, address), caplog.at_level("WARNING", "gpufleet.agent"):
        settings = make_settings(address, root / "data")
        # a PID namespace has no cgroup (no pids.max); jobs as the agent's user get no
        # scratch filesystem and no mount namespace
        with inprocess_agent(fake, settings, root / "state", containment="pidns"):
            labels = dict(fake.registrations[-1].labels)
    assert labels["gpufleet/job-pids-max"] == "none"
    assert labels["gpufleet/job-disk-mb"] == "none"
    assert labels["gpufleet/job-isolation"] == "no-new-privs"
    warnings = [r.getMessage() for r in caplog.records if "job isolation" in r.getMessage()]
    assert any("no pids limit" in w for w in warnings), warnings
    assert any("no scratch filesystem" in w for w in warnings), warnings
    assert any("no private /tmp" in w for w in warnings), warnings


PRELOAD_C = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void gf_probe(void) {
    FILE *f = fopen(GF_OUT, "a");
    if (f) { fprintf(f, "%d %d\n", (int)getuid(), (int)geteuid()); fclose(f); }
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None, reason="needs gcc for the preload library")
def test_loader_variables_of_the_job_reach_its_command_but_no_root_helper(
    env, public: Path
) -> None:
    """LD_PRELOAD (and the loader's other variables) in a job's env must not be honoured by
    the programs that run as root around it (setpriv, unshare, sh, mount), yet the command
    gets them as submitted."""
    fake, agent, store, _ = env
    lib_dir = public / "preload"
    lib_dir.mkdir(exist_ok=True)
    lib_dir.chmod(0o755)
    out = lib_dir / "loaded-by.txt"
    out.touch()
    out.chmod(0o666)
    src = lib_dir / "probe.c"
    src.write_text(PRELOAD_C)
    lib = lib_dir / "probe.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", f'-DGF_OUT="{out}"', "-o", str(lib), str(src)], check=True
    )
    lib.chmod(0o755)
    code = (
        "import os\n"
        "open(os.path.join(os.environ['GPUFLEET_ARTIFACTS_DIR'], 'env.txt'), 'w').write("
        "os.environ.get('LD_PRELOAD', '') + '|' + os.environ.get('LD_LIBRARY_PATH', ''))\n"
    )
    with fake_controller() as (fake2, address):
        settings = make_settings(address, public / "pidns-data")
        state = public / "pidns-state"
        with inprocess_agent(
            fake2, settings, state, job_uids="per-attempt", containment="pidns"
        ) as pidns_agent:
            pidns_store = ObjectStore(settings.resolved_object_store_url())
            runs = [
                (fake, agent, store, "r-preload", ""),
                (fake, agent, store, "r-preload-wd", str(lib_dir)),
                (fake2, pidns_agent, pidns_store, "r-preload-pidns", ""),
            ]
            _check_loader_runs(runs, code, lib, out)


def _check_loader_runs(runs: list, code: str, lib: Path, out: Path) -> None:
    for fake, agent, store, run_id, working_dir in runs:
        out.write_text("")
        resp = agent.assign(
            run_id=run_id,
            job_id=f"j-{run_id}",
            token=1,
            command=py(code),
            working_dir=working_dir,
            env={"LD_PRELOAD": str(lib), "LD_LIBRARY_PATH": "/opt/gf-libs"},
        )
        assert resp.result == A.STARTED, resp.message
        report = fake.wait_report(run_id, timeout_s=60)
        assert (report.outcome, report.exit_code) == (R.EXITED, 0), report.message
        prefix = f"jobs/j-{run_id}/attempts/{run_id}"
        seen = store.get_bytes(f"{prefix}/artifacts/env.txt").decode()
        assert seen == f"{lib}|/opt/gf-libs", "the command gets the job's env as submitted"
        loads = [tuple(map(int, line.split())) for line in out.read_text().splitlines()]
        assert loads, "the command itself loaded the library"
        assert all(uid != 0 and euid != 0 for uid, euid in loads), loads


def test_scratch_promises_never_exceed_the_hosts_free_space(public: Path) -> None:
    """Sparse images are promises: on a short disk the node's default shrinks to half the
    room left (so a second default-size attempt still starts: the CI machine's 9 GiB free
    once failed every start after the first 10 GiB default), an explicit disk_mb that does
    not fit is refused as the node's fault, and the room comes back when an image is
    removed."""
    mib = 1024 * 1024
    disks = ScratchDisks(public / "promise-images", default_mb=4096)
    disks.images_dir.mkdir()
    free_mb = shutil.disk_usage(public).free // mib
    disks.reserve_mb = free_mb - 400  # ~400 MiB of room above the reserve
    first, second, third = public / "p1", public / "p2", public / "p3"
    for point in (first, second, third):
        point.mkdir()
    try:
        size = disks.create("p1", first, 4096, 0, 0, shrink_to_fit=True)
        assert 150 < size < 210, size
        assert os.statvfs(first).f_blocks * os.statvfs(first).f_frsize < 210 * mib
        size2 = disks.create("p2", second, 4096, 0, 0, shrink_to_fit=True)
        assert 50 < size2 < 110, size2
        with pytest.raises(StartError) as refused:
            disks.create("p3", third, 256, 0, 0)
        assert refused.value.node_fault and "promised" in str(refused.value)
        assert not os.path.ismount(third) and not disks.image("p3").exists()
        disks.remove("p1", first)
        disks.remove("p2", second)
        assert disks.create("p3", third, 256, 0, 0) == 256
    finally:
        for run_id, point in (("p1", first), ("p2", second), ("p3", third)):
            disks.remove(run_id, point)


def test_a_resolv_conf_target_inside_a_hidden_directory_stays_readable(public: Path) -> None:
    """systemd-resolved's layout: /etc/resolv.conf -> /run/systemd/resolve/stub-resolv.conf.
    Replayed with a hidden directory of the test's own (the real shim, mount and unshare)."""
    from gpufleet.agent import shim

    assert ISOLATION.mount_ns, ISOLATION.problems
    hidden = public / "run-like"
    (hidden / "systemd" / "resolve").mkdir(parents=True)
    target = hidden / "systemd" / "resolve" / "stub-resolv.conf"
    target.write_text("nameserver 127.0.0.53\n")
    (hidden / "daemon.sock").write_text("a socket would be here")
    iso = jobns.Isolation(
        ISOLATION.setpriv,
        ISOLATION.unshare,
        ISOLATION.mount,
        hide_dirs=(str(hidden),),
        keep_file=str(target),
    )
    tmp = public / "shim-tmp"
    tmp.mkdir()
    log, exit_file = public / "shim.log", public / "shim.exit"
    code = (
        "import os, sys; d = sys.argv[1]; print(sorted(os.listdir(d)));"
        " print(open(sys.argv[2]).read().strip(), flush=True); print('err', file=sys.stderr)"
    )
    argv = [
        *iso.shim_prefix(namespace=True),
        *shim.argv(
            exit_file=exit_file,
            log_file=log,
            command=py(code, str(hidden), str(target)),
            **iso.shim_options(namespace=True, tmp_dir=str(tmp)),
        ),
    ]
    subprocess.run(argv, check=True, timeout=30)
    assert json.loads(exit_file.read_text())["exit_code"] == 0, log.read_text()
    lines = log.read_text().splitlines()
    # stderr too: the shim's own quiet open of the kept file must not silence the command
    assert lines == ["['systemd']", "nameserver 127.0.0.53", "err"], lines
    assert (hidden / "daemon.sock").exists(), "nothing of it reached the host"
