"""Jobs with an ``image`` through the real agent (gRPC, assignment log, outbox) as podman
containers pulled from the local registry; the controller is the recording fake.

Needs what ``scripts/ensure-services.sh`` sets up (podman, runc, the registry on
127.0.0.1:5000, the test images); without it these tests fail.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpufleet.agent.runtime.container import (
    DEFAULT_PIDS_LIMIT,
    LABEL_RUN,
    USERNS_HOST_BASE,
    ContainerEngine,
)
from gpufleet.domain.manifest import Manifest
from gpufleet.objectstore import ObjectStore
from gpufleet.rpc.protos import fleet_pb2 as pb
from tests.container_support import BUSYBOX, PRIVPROBE, fresh_image
from tests.integration.test_agent_restart import _stub
from tests.integration.test_agent_support import (
    LEADER_EPOCH,
    FakeController,
    InProcessAgent,
    agent_subprocess,
    fake_controller,
    inprocess_agent,
    make_settings,
    wait_until,
)

pytestmark = pytest.mark.slow

A = pb.AssignJobResponse
R = pb.ReportCompletionRequest


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> ContainerEngine:
    e = ContainerEngine("podman", state_dir=tmp_path_factory.mktemp("engine"))
    e.ensure_present(BUSYBOX)
    return e


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[FakeController, InProcessAgent, ObjectStore, Path]]:
    with fake_controller() as (fake, address):
        settings = make_settings(address, tmp_path)
        with inprocess_agent(fake, settings, tmp_path / "state") as agent:
            yield fake, agent, ObjectStore(settings.resolved_object_store_url()), tmp_path


def _rid() -> str:
    return f"rc-{uuid.uuid4().hex[:10]}"


JOB = (
    'echo "visible=$CUDA_VISIBLE_DEVICES job=$GPUFLEET_JOB_ID"; '
    'echo "$CUDA_VISIBLE_DEVICES" > "$GPUFLEET_ARTIFACTS_DIR/gpus.txt"; '
    'mkdir -p "$GPUFLEET_CHECKPOINT_DIR/step-1" && echo w > "$GPUFLEET_CHECKPOINT_DIR/step-1/m"; '
    "i=0; while [ $i -lt 200 ]; do echo line-$i; i=$((i+1)); done; echo last-line"
)


def test_image_job_runs_in_a_container_with_its_gpus_outputs_and_log_then_starts_warm(
    env, engine
) -> None:
    fake, agent, store, _ = env
    image = fresh_image(engine)  # the first start must pull it from the registry
    rid = _rid()
    resp = agent.assign(
        run_id=rid,
        job_id=f"j-{rid}",
        token=3,
        attempt=1,
        gpu_ids=[1, 3],
        command=["sh", "-c", JOB],
        env={"CUDA_VISIBLE_DEVICES": "0,1,2,3"},  # cannot widen the pinning
        image=image,
        memory_mb=256,
        cpu=1.0,
    )
    assert resp.result == A.STARTED, resp.message
    report = fake.wait_report(rid, timeout_s=60)
    assert (report.outcome, report.exit_code) == (R.EXITED, 0)
    confirm = next(c for c in fake.confirms if c.run_id == rid)
    p = confirm.start_phases
    assert (p.runtime, p.image) == ("container", "cold") and p.pull_s > 0
    assert p.create_s > 0 and p.start_s > 0

    manifest = Manifest.from_json(store.get_bytes(store.key_of(report.manifest_uri)))
    files = {(f.kind, f.path): f for f in manifest.files}
    assert {("artifact", "gpus.txt"), ("checkpoint", "step-1/m"), ("log", "output.log")} <= set(
        files
    )
    assert store.get_bytes(files["artifact", "gpus.txt"].key) == b"1,3\n"
    log = store.get_bytes(files["log", "output.log"].key).decode()
    assert f"visible=1,3 job=j-{rid}" in log
    assert [ln for ln in log.splitlines() if ln.startswith("line-")] == [
        f"line-{i}" for i in range(200)
    ]
    assert log.rstrip().endswith("last-line")
    assert engine.find(LABEL_RUN, rid) == []

    # the node reports the image it now holds (DD9)
    fake.wait_for(lambda: any(BUSYBOX in {i.name for i in h.images} for h in fake.heartbeats), 15)

    rid2 = _rid()
    resp = agent.assign(
        run_id=rid2,
        job_id=f"j-{rid2}",
        token=1,
        attempt=1,
        gpu_ids=[0],
        command=["true"],
        image=image,
    )
    assert resp.result == A.STARTED, resp.message
    assert fake.wait_report(rid2, timeout_s=60).exit_code == 0
    confirm2 = next(c for c in fake.confirms if c.run_id == rid2)
    assert confirm2.start_phases.image == "warm"
    engine.remove_image(image)


def test_cancel_of_a_container_that_ignores_sigterm_removes_it_before_the_report(
    env, engine
) -> None:
    fake, agent, _, tmp = env
    rid = _rid()
    fake.on_report = lambda r: engine.find(LABEL_RUN, r.run_id)
    script = "trap 'echo ignoring-term' TERM; echo ready; while true; do sleep 0.1; done"
    resp = agent.assign(
        run_id=rid,
        job_id=f"j-{rid}",
        token=1,
        attempt=1,
        gpu_ids=[2],
        command=["sh", "-c", script],
        image=BUSYBOX,
    )
    assert resp.result == A.STARTED, resp.message
    log = tmp / "state" / "runs" / rid / "output.log"
    wait_until(lambda: log.exists() and "ready" in log.read_text(), timeout_s=30)
    t0 = time.monotonic()
    stop = agent.stop_run(run_id=rid, token=1, grace_s=1.0, reason="cancel")
    assert stop.result == pb.StopRunResponse.STOPPING
    report = fake.wait_report(rid, timeout_s=60)
    assert time.monotonic() - t0 >= 1.0  # the grace was served: it ignored SIGTERM
    assert report.outcome == R.STOPPED
    assert "SIGKILL after 1 s grace" in report.message
    assert fake.observed_at_report[rid] == []  # gone before the GPUs can be released
    assert "ignoring-term" in log.read_text()


def test_oom_container_reports_oom_killed(env) -> None:
    fake, agent, _, _ = env
    rid = _rid()
    script = 'x=$(head -c 200000000 /dev/zero | tr "\\0" a); echo survived'
    resp = agent.assign(
        run_id=rid,
        job_id=f"j-{rid}",
        token=1,
        attempt=1,
        gpu_ids=[0],
        command=["sh", "-c", script],
        image=BUSYBOX,
        memory_mb=32,
    )
    assert resp.result == A.STARTED, resp.message
    report = fake.wait_report(rid, timeout_s=60)
    assert report.outcome == R.EXITED and report.exit_code != 0
    assert report.reason == "OOM_KILLED", report


def test_image_job_on_a_node_without_container_runtime_never_starts(tmp_path: Path) -> None:
    """Refused before anything is prepared, as the node's fault (the job is re-placed without
    using a retry); the node says it has no engine in its labels."""
    with fake_controller() as (fake, address):
        settings = make_settings(address, tmp_path)
        with inprocess_agent(
            fake, settings, tmp_path / "state", container_runtime="none"
        ) as agent:
            assert fake.registrations[-1].labels["gpufleet/container-runtime"] == "none"
            resp = agent.assign(
                run_id="r-noengine",
                job_id="j-noengine",
                token=1,
                attempt=1,
                gpu_ids=[0],
                command=["true"],
                image=BUSYBOX,
            )
            assert resp.result == A.FAILED_TO_START
            assert "container runtime" in resp.message
            report = fake.wait_report("r-noengine")
            assert report.outcome == R.NEVER_STARTED
            assert report.node_fault is True


def test_image_job_runs_as_its_own_uid_with_the_env_allow_list(tmp_path: Path, engine) -> None:
    """With per-attempt job uids (the default of a real node) the container runs as the
    attempt's uid, can write its artifacts directory (owned by that uid, 0700) and sees the job's
    and the platform's variables only."""
    with fake_controller() as (fake, address):
        settings = make_settings(address, tmp_path)
        with inprocess_agent(fake, settings, tmp_path / "state", job_uids="per-attempt") as agent:
            rid = _rid()
            script = (
                'echo "ids=$(id -u):$(id -g) mine=$MINE path=$PATH"; '
                'env | sort > "$GPUFLEET_ARTIFACTS_DIR/env.txt"'
            )
            resp = agent.assign(
                run_id=rid,
                job_id=f"j-{rid}",
                token=1,
                attempt=1,
                gpu_ids=[0],
                command=["sh", "-c", script],
                env={"MINE": "1"},
                image=BUSYBOX,
            )
            assert resp.result == A.STARTED, resp.message
            report = fake.wait_report(rid, timeout_s=60)
            assert report.outcome == R.EXITED and report.exit_code == 0, report
            log = (tmp_path / "state" / "runs" / rid / "output.log").read_text()
            ids = log.split("ids=", 1)[1].split()[0]
            uid = int(ids.split(":")[0])
            assert uid >= 1_900_000_000 and uid != 0, log
            assert "mine=1" in log
            store = ObjectStore(settings.resolved_object_store_url())
            manifest = Manifest.from_json(store.get_bytes(store.key_of(report.manifest_uri)))
            files = {(f.kind, f.path): f for f in manifest.files}
            seen = store.get_bytes(files["artifact", "env.txt"].key).decode()
            names = {line.split("=", 1)[0] for line in seen.splitlines()}
            assert {"MINE", "GPUFLEET_RUN_ID", "CUDA_VISIBLE_DEVICES"} <= names, seen
            # nothing of the agent's own environment (pytest's, the test settings')
            assert not {n for n in names if n.startswith(("PYTEST", "GPUFLEET_TEST"))}, seen
            assert "/root" not in seen and ".venv" not in seen, seen


@pytest.mark.chaos
def test_kill_9_agent_then_restart_adopts_the_running_container(tmp_path: Path, engine) -> None:
    state = tmp_path / "state"
    rid = _rid()
    art = state / "runs" / rid / "artifacts"
    script = (
        'echo start >> "$GPUFLEET_ARTIFACTS_DIR/starts"; echo before; '
        'while [ ! -e "$GPUFLEET_ARTIFACTS_DIR/go" ]; do sleep 0.05; done; echo after; exit 7'
    )
    with fake_controller() as (fake, address):
        agent = agent_subprocess(address, tmp_path, state)
        try:
            channel, stub = _stub(fake, 1)
            req = pb.AssignJobRequest(
                run_id=rid,
                job_id=f"j-{rid}",
                token=1,
                leader_epoch=LEADER_EPOCH,
                gpu_ids=[1],
                command=["sh", "-c", script],
                image=BUSYBOX,
                attempt=1,
            )
            assert stub.AssignJob(req, timeout=60).result == A.STARTED
            fake.wait_for(lambda: rid in {c.run_id for c in fake.confirms}, 30)
            channel.close()

            agent.kill()  # SIGKILL: no cleanup of any kind
            agent.wait()
            assert engine.inspect(rid) is not None and engine.inspect(rid).running  # type: ignore[union-attr]

            agent = agent_subprocess(address, tmp_path, state)
            channel, stub = _stub(fake, 2)
            again = stub.AssignJob(req, timeout=30)
            assert again.result == A.ALREADY_RUNNING
            (art / "go").touch()
            report = fake.wait_report(rid, timeout_s=60)
            channel.close()
            assert (report.outcome, report.exit_code) == (R.EXITED, 7)
            assert len(fake.reports_for(rid)) == 1
            log = (state / "runs" / rid / "output.log").read_text()
            assert log.count("before") == 1 and "after" in log
            assert engine.find(LABEL_RUN, rid) == []
            assert json.loads((state / "agent_epoch").read_text()) == 2
            agent.send_signal(signal.SIGTERM)
            assert agent.wait(timeout=30) == 0
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
            engine.remove(rid)


def test_an_image_that_cannot_be_pulled_is_reported_never_started(env) -> None:
    fake, agent, _, _ = env
    rid = _rid()
    resp = agent.assign(
        run_id=rid,
        job_id=f"j-{rid}",
        token=1,
        attempt=1,
        gpu_ids=[0],
        command=["true"],
        image=BUSYBOX.rsplit(":", 1)[0] + ":no-such-tag",
    )
    # the answer does not wait for the pull; the failure comes as the completion
    assert resp.result == A.STARTED, resp.message
    report = fake.wait_report(rid, timeout_s=60)
    assert report.outcome == R.NEVER_STARTED
    assert "cannot pull image" in report.message
    assert not [c for c in fake.confirms if c.run_id == rid]


def _probe_values(log: str) -> dict[str, str]:
    """The ``key=value`` lines ``privprobe`` (and the test's shell) printed."""
    return dict(ln.split("=", 1) for ln in log.splitlines() if "=" in ln and " " not in ln)


PROBE_JOB = (
    "/bin/privprobe /gpufleet/work; "
    "echo pids_max=$(cat /sys/fs/cgroup/pids/pids.max 2>/dev/null"
    " || cat /sys/fs/cgroup/pids.max); "
    "echo ready; while [ ! -e /gpufleet/work/go ]; do sleep 0.05; done"
)


@pytest.mark.parametrize("job_uids", ["per-attempt", "agent"])
def test_a_setuid_root_binary_in_the_image_gains_no_privilege(
    tmp_path: Path, engine: ContainerEngine, job_uids: str
) -> None:
    """The image's own setuid-root ``privprobe`` (owner 0, mode 4755) runs as the job: it stays
    the job's uid (no-new-privileges), holds no capability (``--cap-drop ALL``: effective and
    bounding sets empty), cannot open an AF_PACKET or raw IP socket, cannot setuid(0), and the
    file it plants in its work dir is not setuid-root on the host. The pids limit is the
    node's default. Both with per-attempt job uids and with jobs as the (root) agent's user,
    where the container still never runs as host root."""
    with fake_controller() as (fake, address):
        settings = make_settings(address, tmp_path)
        with inprocess_agent(fake, settings, tmp_path / "state", job_uids=job_uids) as agent:
            rid = _rid()
            resp = agent.assign(
                run_id=rid,
                job_id=f"j-{rid}",
                token=1,
                attempt=1,
                gpu_ids=[0],
                command=["sh", "-c", PROBE_JOB],
                image=PRIVPROBE,
            )
            assert resp.result == A.STARTED, resp.message
            log_path = tmp_path / "state" / "runs" / rid / "output.log"
            wait_until(lambda: log_path.exists() and "ready" in log_path.read_text(), 60)
            seen = _probe_values(log_path.read_text())
            planted = next(
                p
                for p in [
                    tmp_path / "state" / "runs" / rid / "work" / "planted",
                    *Path("/var/lib/gpufleet/jobs").glob(f"*/{rid}/work/planted"),
                ]
                if p.exists()
            )
            st = planted.stat()
            (planted.parent / "go").touch()
            report = fake.wait_report(rid, timeout_s=60)
    assert report.outcome == R.EXITED and report.exit_code == 0, report
    assert seen["ruid"] != "0" and seen["euid"] == seen["ruid"], seen  # setuid bit ignored
    assert seen["setuid0"] == "EPERM" and seen["euid_after"] == seen["ruid"], seen
    assert seen["nnp"] == "1", seen
    assert int(seen["capeff"], 16) == 0 and int(seen["capbnd"], 16) == 0, seen
    assert seen["af_packet"] != "ok" and seen["raw_inet"] != "ok", seen
    assert seen["pids_max"] == str(DEFAULT_PIDS_LIMIT), seen
    # on the host: never root's, never setuid-root; the attempt's own uid (uploads work)
    assert st.st_uid != 0, (st.st_uid, oct(st.st_mode))
    assert not (st.st_uid == 0 and st.st_mode & stat.S_ISUID)
    if job_uids == "per-attempt":
        assert st.st_uid == int(seen["ruid"]) >= 1_900_000_000
    else:
        assert st.st_uid == USERNS_HOST_BASE


def test_read_only_rootfs_and_a_tight_pids_limit_from_the_node(
    tmp_path: Path, engine: ContainerEngine
) -> None:
    """``--container-read-only`` makes the image's filesystem read-only (the mounts stay
    writable); ``--container-pids-limit`` bounds the processes: a fork bomb
    fails inside the container and the job ends on its own."""
    script = (
        'awk \'$2 == "/" {print "rootfs=" substr($4, 1, 2)}\' /proc/self/mounts; '
        "touch /gpufleet/work/w && echo work=rw; "
        "echo pids_max=$(cat /sys/fs/cgroup/pids/pids.max); "
        # a fork bomb in a subshell (ash dies on a refused fork); only builtins after it
        "( i=0; while [ $i -lt 80 ]; do sleep 3 & i=$((i+1)); echo $i > /gpufleet/work/n;"
        " done ) 2>/dev/null; rc=$?; read n < /gpufleet/work/n; echo bomb_exit=$rc;"
        " echo started=$n"
    )
    with fake_controller() as (fake, address):
        settings = make_settings(address, tmp_path)
        with inprocess_agent(
            fake,
            settings,
            tmp_path / "state",
            job_uids="per-attempt",
            container_read_only=True,
            container_pids_limit=32,
        ) as agent:
            rid = _rid()
            resp = agent.assign(
                run_id=rid,
                job_id=f"j-{rid}",
                token=1,
                attempt=1,
                gpu_ids=[0],
                command=["sh", "-c", script],
                image=BUSYBOX,
            )
            assert resp.result == A.STARTED, resp.message
            report = fake.wait_report(rid, timeout_s=90)
            log = (tmp_path / "state" / "runs" / rid / "output.log").read_text()
    seen = _probe_values(log)
    assert report.outcome == R.EXITED, report
    assert (seen["rootfs"], seen["work"]) == ("ro", "rw"), log
    assert seen["pids_max"] == "32", log
    assert seen["bomb_exit"] != "0" and 10 <= int(seen["started"]) < 32, log  # refused


@pytest.mark.parametrize(
    ("image", "says"),
    [
        ("127.0.0.1:1/gpufleet/x:1", "unreachable or not a registry"),  # registry unreachable
        (BUSYBOX.rsplit(":", 1)[0] + ":no-such-tag", "not found in registry"),  # its answer
        ("--privileged", "must not start with '-'"),  # never reaches the engine
        ("UPPER/case", "must be lower-case"),
    ],
)
def test_an_image_the_job_names_badly_is_the_jobs_fault_not_the_nodes(
    env, engine: ContainerEngine, image: str, says: str
) -> None:
    """Whatever is wrong with the image a job names (the reference, the registry's answer, the
    registry unreachable) fails its attempt as the job's fault with a reason of the agent's:
    the node is not charged (no auto-cordon) and no container is left."""
    fake, agent, _, _ = env
    rid = _rid()
    resp = agent.assign(
        run_id=rid,
        job_id=f"j-{rid}",
        token=1,
        attempt=1,
        gpu_ids=[0],
        command=["true"],
        image=image,
    )
    assert resp.result in (A.STARTED, A.FAILED_TO_START), resp.message
    report = fake.wait_report(rid, timeout_s=60)
    assert report.outcome == R.NEVER_STARTED
    assert report.node_fault is False, report
    assert "cannot pull image" in report.message and says in report.message, report.message
    assert engine.find(LABEL_RUN, rid) == []


WRITE_EVERYWHERE = (
    # into the image's own directories (its writable layer would be on the engine's storage)
    "for d in / /data /root /etc /usr; do"
    ' dd if=/dev/zero of="$d/gf-fill" bs=1M count=$1 2>&1; echo "w$d=$?"; done; '
    # into /tmp and /var/tmp: the attempt's scratch, bounded by disk_mb
    'dd if=/dev/zero of=/tmp/gf-fill bs=1M count=$2 2>&1; echo "wtmp=$?"; '
    'echo "tmpdev=$(stat -c %d /tmp)"; echo "vartmpdev=$(stat -c %d /var/tmp)"; '
    'echo "workdev=$(stat -c %d /gpufleet/work)"; '
    "echo end=1"
)


OPEN_DIRS = "localhost/gpufleet-test/open-dirs:1"
"""busybox with a world-writable (1777) /data: a directory any job user could write in the
image's writable layer."""


@pytest.fixture(scope="module")
def open_dirs_image(engine: ContainerEngine, tmp_path_factory: pytest.TempPathFactory) -> str:
    ctx = tmp_path_factory.mktemp("open-dirs")
    (ctx / "Containerfile").write_text(f"FROM {BUSYBOX}\nRUN mkdir -p -m 1777 /data\n")
    subprocess.run(
        [*engine.argv0, "build", "-q", "-t", OPEN_DIRS, str(ctx)],
        env=engine.env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    return OPEN_DIRS


def _root_free_mb() -> float:
    st = os.statvfs("/var/lib/containers/storage")
    return st.f_bavail * st.f_frsize / 2**20


def _write_everywhere(
    tmp_path: Path, image: str, image_mb: int, tmp_mb: int, **agent_kw: Any
) -> dict[str, str]:
    with fake_controller() as (fake, address):
        settings = make_settings(address, tmp_path)
        with inprocess_agent(
            fake, settings, tmp_path / "state", job_uids="per-attempt", **agent_kw
        ) as agent:
            rid = _rid()
            resp = agent.assign(
                run_id=rid,
                job_id=f"j-{rid}",
                token=1,
                attempt=1,
                disk_mb=32,
                command=["sh", "-c", WRITE_EVERYWHERE, "sh", str(image_mb), str(tmp_mb)],
                image=image,
            )
            assert resp.result == A.STARTED, resp.message
            report = fake.wait_report(rid, timeout_s=120)
            state = tmp_path / "state" / "runs" / rid
            log = (state / "output.log").read_text()
    assert report.outcome == R.EXITED, report
    seen = _probe_values(log)
    assert seen.get("end") == "1", log
    seen["log"] = log
    return seen


def test_a_container_writing_past_its_disk_mb_fails_and_the_nodes_disk_keeps_its_space(
    tmp_path: Path, open_dirs_image: str
) -> None:
    """By default a container's root filesystem is read-only: the image's directories refuse
    writes (EROFS) and /tmp, /var/tmp are the attempt's scratch (disk_mb=32): a 200 MiB
    write there stops at ENOSPC. 700 MiB attempted; the node's root disk loses at most the
    scratch image's 32 MiB (plus noise of a shared machine)."""
    free_before = _root_free_mb()
    seen = _write_everywhere(tmp_path, open_dirs_image, image_mb=100, tmp_mb=200)
    dropped = free_before - _root_free_mb()
    assert "can't open '/data/gf-fill': Read-only file system" in seen["log"], seen["log"]
    for d in ("/", "/data", "/root", "/etc", "/usr"):
        assert seen[f"w{d}"] != "0", seen["log"]
    assert seen["wtmp"] != "0" and "No space left on device" in seen["log"], seen["log"]
    assert seen["tmpdev"] == seen["vartmpdev"] == seen["workdev"], "all in the scratch"
    assert dropped < 150, f"the node's root disk lost {dropped:.0f} MiB"


def test_control_without_read_only_the_image_layer_is_writable(
    tmp_path: Path, open_dirs_image: str
) -> None:
    """The control of the test above: with ``--no-container-read-only`` the same writes land
    in the image's writable layer (so the read-only default is what stops them)."""
    seen = _write_everywhere(
        tmp_path, open_dirs_image, image_mb=2, tmp_mb=2, container_read_only=False
    )
    assert seen["w/data"] == "0", seen["log"]
    assert seen["wtmp"] == "0", seen["log"]
