"""The container runtime against the real engine (podman) and the local registry.

Needs what ``scripts/ensure-services.sh`` installs: podman, runc, the registry on
127.0.0.1:5000 and the test images. Without them these tests fail (CI installs them).
"""

from __future__ import annotations

import contextlib
import http.server
import os
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from gpufleet.agent.runtime.container import (
    LABEL_RUN,
    LOST_EXIT,
    OOM_KILLED,
    ContainerEngine,
    ContainerHandle,
    ContainerLaunch,
    ContainerRuntime,
    ImageUnavailable,
)
from gpufleet.agent.runtime.containment import detect
from gpufleet.agent.workdir import RunPaths
from tests.container_support import BUSYBOX, REGISTRY, fresh_image
from tests.integration.test_agent_support import wait_until

pytestmark = pytest.mark.slow


@dataclass
class Rec:
    run_id: str
    job_id: str = "j-test"
    token: int = 1
    stop_reason: str = ""
    stop_grace_s: float = 0.0
    pid: int = 0
    boot_id: str = ""
    runtime_state: dict | None = None

    @property
    def stop_requested(self) -> bool:
        return bool(self.stop_reason)


@pytest.fixture
def runtime(tmp_path: Path):
    found = detect(f"ctest-{uuid.uuid4().hex[:8]}")  # cgroup containment, as the agent's
    rt = ContainerRuntime(
        ContainerEngine("podman", state_dir=tmp_path / "engine"), cdi=False, containment=found
    )
    rt.engine.ensure_present(BUSYBOX)
    names: list[str] = []
    yield rt, names
    for n in names:
        rt.release(n)
    found.remove_scope()


def _launch(tmp: Path, run_id: str, command: list[str], **kw) -> tuple[Rec, ContainerLaunch]:
    paths = RunPaths(tmp / run_id)
    for d in (paths.work, paths.checkpoints, paths.artifacts):
        d.mkdir(parents=True, exist_ok=True)
    env = {"GPUFLEET_RUN_ID": run_id, "USER_VAR": "x y"}
    image = kw.pop("image", BUSYBOX)
    return Rec(run_id), ContainerLaunch(paths, image, tuple(command), env, **kw)


def _run_id() -> str:
    return f"ctest-{uuid.uuid4().hex[:10]}"


def _until_exit(rt: ContainerRuntime, rec: Rec, h: ContainerHandle, paths: RunPaths, t=60.0):
    deadline = time.monotonic() + t
    while time.monotonic() < deadline:
        info = rt.poll(rec, h, time.monotonic(), paths)
        if info is not None:
            return info
        time.sleep(0.05)
    raise AssertionError(f"{rec.run_id} did not end in {t} s")


def test_pull_create_start_logs_exit_code_and_mounts(runtime, tmp_path):
    rt, names = runtime
    image = fresh_image(rt.engine)  # cold: the pull phase really pulls from the registry
    rid = _run_id()
    names.append(rid)
    script = (
        'echo "gpus=$CUDA_VISIBLE_DEVICES ids=$GPUFLEET_GPU_IDS var=$USER_VAR";'
        'echo done > "$GPUFLEET_ARTIFACTS_DIR/out.txt"; echo err >&2; exit 7'
    )
    rec, launch = _launch(tmp_path, rid, ["sh", "-c", script], gpu_ids=(2, 3), image=image)
    h = rt.spawn(rec, launch)
    assert h.phases["image"] == "cold" and h.phases["pull_s"] > 0
    assert {"create_s", "start_s"} <= h.phases.keys()
    assert rt.engine.find(LABEL_RUN, rid) == [rid]
    info = _until_exit(rt, rec, h, launch.paths)
    assert info.exit_code == 7 and info.reason == ""
    log = launch.paths.log.read_text()
    assert "gpus=2,3 ids=2,3 var=x y" in log and "err" in log
    assert (launch.paths.artifacts / "out.txt").read_text() == "done\n"
    assert rt.engine.inspect(rid) is None  # removed before the end is reported
    assert not launch.paths.env_file.exists()  # the env file is gone after create

    rid2 = _run_id()
    names.append(rid2)
    rec2, launch2 = _launch(tmp_path, rid2, ["true"], image=image)
    h2 = rt.spawn(rec2, launch2)
    assert h2.phases["image"] == "warm"
    assert _until_exit(rt, rec2, h2, launch2.paths).exit_code == 0
    rt.engine.remove_image(image)


def test_cdi_devices_renumber_cuda_visible_devices(tmp_path):
    rt = ContainerRuntime(ContainerEngine("podman", state_dir=tmp_path), cdi=True)
    _, launch = _launch(tmp_path, _run_id(), ["true"], gpu_ids=(4, 6))
    env = rt.container_env(launch)
    assert env["CUDA_VISIBLE_DEVICES"] == "0,1" and env["GPUFLEET_GPU_IDS"] == "4,6"
    assert env["GPUFLEET_ARTIFACTS_DIR"] == "/gpufleet/artifacts"


def test_stop_of_a_container_that_ignores_sigterm_is_killed_after_grace(runtime, tmp_path):
    rt, names = runtime
    rid = _run_id()
    names.append(rid)
    script = "trap 'echo got-term' TERM; echo ready; while true; do sleep 0.1; done"
    rec, launch = _launch(tmp_path, rid, ["sh", "-c", script])
    h = rt.spawn(rec, launch)
    wait_until(lambda: "ready" in launch.paths.log.read_text(), timeout_s=30)
    rec.stop_reason, rec.stop_grace_s = "cancel", 1.0
    t0 = time.monotonic()
    info = _until_exit(rt, rec, h, launch.paths)
    assert time.monotonic() - t0 >= 1.0
    assert h.term_sent_at is not None and h.kill_sent_at is not None
    assert "got-term" in launch.paths.log.read_text()
    assert "SIGKILL after 1 s grace" in info.message
    assert rt.engine.inspect(rid) is None
    assert rt.engine.find(LABEL_RUN, rid) == []


def test_adopt_after_restart_does_not_start_again(runtime, tmp_path):
    rt, names = runtime
    rid = _run_id()
    names.append(rid)
    rec, launch = _launch(tmp_path, rid, ["sh", "-c", "echo one; sleep 1; echo two"])
    h = rt.spawn(rec, launch)
    rec.pid, rec.boot_id, rec.runtime_state = h.pid, h.boot_id, h.log_fields()["runtime_state"]
    # A new agent: a fresh runtime object that only has the logged fields.
    rt2 = ContainerRuntime(ContainerEngine("podman", state_dir=tmp_path / "engine2"), cdi=False)
    h2 = rt2.adopt(rec, launch.paths)
    assert h2.name == rid and h2.phases == h.phases
    info = _until_exit(rt2, rec, h2, launch.paths)
    assert info.exit_code == 0
    log = launch.paths.log.read_text()
    assert log.count("one") == 1 and "two" in log  # ran once; the first follower kept logging


def test_resolve_unstarted_adopts_a_created_container_and_abandons_a_missing_one(
    runtime, tmp_path
):
    rt, names = runtime
    rid = _run_id()
    names.append(rid)
    rec, launch = _launch(tmp_path, rid, ["sh", "-c", "echo adopted"])
    assert rt.resolve_unstarted(rec, launch.paths) is None
    # The agent died between create and start.
    launch.paths.env_file.write_text("A=1\n")
    rt.engine.create(
        name=rid,
        image=BUSYBOX,
        command=["sh", "-c", "echo adopted"],
        env_file=launch.paths.env_file,
        labels={LABEL_RUN: rid},
        mounts=[],
        workdir="/",
    )
    h = rt.resolve_unstarted(rec, launch.paths)
    assert h is not None
    assert _until_exit(rt, rec, h, launch.paths).exit_code == 0
    assert launch.paths.log.read_text().count("adopted") == 1


def test_memory_limit_kills_with_oom_reason(runtime, tmp_path):
    rt, names = runtime
    rid = _run_id()
    names.append(rid)
    script = 'echo start; x=$(head -c 200000000 /dev/zero | tr "\\0" a); echo survived'
    rec, launch = _launch(tmp_path, rid, ["sh", "-c", script], memory_mb=32)
    h = rt.spawn(rec, launch)
    info = _until_exit(rt, rec, h, launch.paths)
    assert info.reason == OOM_KILLED, info
    assert "survived" not in launch.paths.log.read_text()


def test_missing_image_is_a_start_error_of_the_job(runtime, tmp_path):
    """The registry answers that the image does not exist: the job's fault (it uses a retry)."""
    from gpufleet.agent.workdir import StartError

    rt, _ = runtime
    rec, launch = _launch(tmp_path, _run_id(), ["true"], image=f"{REGISTRY}/gpufleet/nope:0")
    with pytest.raises(StartError, match="cannot pull image") as err:
        rt.spawn(rec, launch)
    assert err.value.node_fault is False
    assert rt.engine.find(LABEL_RUN, rec.run_id) == []
    rec, launch = _launch(tmp_path, _run_id(), ["true"], image="Bad//Reference")
    with pytest.raises(StartError, match="image reference 'Bad//Reference'") as err:
        rt.spawn(rec, launch)
    assert err.value.node_fault is False


def test_unreachable_registry_is_a_start_error_of_the_job(runtime, tmp_path):
    """Nothing listens where the registry should be: about the image the job named, so the
    job's fault (it uses a retry; the reason is generic, podman's message goes to the agent's
    log), never the node's: a job naming an unreachable registry must not cordon the nodes it
    is placed on."""
    from gpufleet.agent.workdir import StartError

    rt, _ = runtime
    rec, launch = _launch(tmp_path, _run_id(), ["true"], image="127.0.0.1:1/gpufleet/busybox:1")
    with pytest.raises(
        StartError, match=r"registry 127\.0\.0\.1:1 unreachable or not a registry"
    ) as err:
        rt.spawn(rec, launch)
    assert err.value.node_fault is False
    assert rt.engine.find(LABEL_RUN, rec.run_id) == []


def test_a_command_missing_from_the_image_ends_as_the_jobs_exit(runtime, tmp_path):
    """With ``--init`` the container starts and its init reports the missing command as an
    exit code: the job's failure, never the node's."""
    rt, names = runtime
    rid = _run_id()
    names.append(rid)
    rec, launch = _launch(tmp_path, rid, ["/no/such/program"])
    h = rt.spawn(rec, launch)
    info = _until_exit(rt, rec, h, launch.paths)
    assert info.exit_code != 0, info
    assert rt.engine.find(LABEL_RUN, rid) == []


def test_engine_lists_local_images_with_digest_and_size(runtime):
    rt, _ = runtime
    rt.ensure_image(BUSYBOX)
    imgs = {i.name: i for i in rt.engine.images()}
    assert BUSYBOX in imgs
    assert imgs[BUSYBOX].digest.startswith("sha256:") and imgs[BUSYBOX].size_bytes > 0


def test_a_runtime_neutral_launch_keeps_only_the_jobs_and_platform_env(runtime, tmp_path):
    """The agent runtime interface hands every runtime the same ``Launch`` (built for a host
    process): the container gets the job's and the platform's variables, not the host's PATH,
    and runs as the launch's job user (a uid the image's /etc/passwd does not know)."""
    from types import SimpleNamespace

    from gpufleet.agent.runtime.base import JobUser, Launch

    rt, names = runtime
    rid = _run_id()
    names.append(rid)
    paths = RunPaths(tmp_path / rid)
    for d in (paths.work, paths.checkpoints, paths.artifacts):
        d.mkdir(parents=True, exist_ok=True)
    env = {
        "PATH": "/nonexistent/host/bin",
        "HOME": "/home/agent-user",
        "MINE": "1",
        "CUDA_VISIBLE_DEVICES": "5",
        "GPUFLEET_RUN_ID": rid,
        "GPUFLEET_ARTIFACTS_DIR": str(paths.artifacts),
    }
    launch = Launch(
        paths=paths,
        command=(
            "sh",
            "-c",
            'echo "path=$PATH mine=$MINE home=${HOME:-} cuda=$CUDA_VISIBLE_DEVICES"'
            " ids=$(id -u):$(id -g)",
        ),
        env=env,
        cwd=Path("/host/dir"),
        user=JobUser(uid=1900004242, gid=1900004243, switch=True),
        gpu_ids=(5,),
    )
    rec = SimpleNamespace(
        run_id=rid,
        job_id="j",
        token=1,
        image=BUSYBOX,
        env={"MINE": "1"},
        working_dir="",
        stop_reason="",
        stop_grace_s=0.0,
        stop_requested=False,
    )
    h = rt.spawn(rec, launch)
    info = _until_exit(rt, rec, h, paths)  # type: ignore[arg-type]
    assert info.exit_code == 0
    log = paths.log.read_text()
    assert "mine=1" in log and "cuda=5" in log
    assert "ids=1900004242:1900004243" in log
    assert "/nonexistent/host/bin" not in log and "agent-user" not in log


# ---------------------------------------------------------------- hostile and probing registries

HOSTILE_MANIFEST = (
    b'{"errors":[{"code":"MANIFEST_UNKNOWN","message":"write /var/lib/containers/storage:'
    b' no space left on device"}]}'
)


@contextlib.contextmanager
def _http_registry(v2_status: int, body: bytes):
    """A loopback HTTP server: ``/v2/`` answers ``v2_status``, everything else 404 ``body``
    (an OCI error document). Yields (port, paths requested)."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self) -> None:
            seen.append(self.path)
            status, data = (v2_status, b"{}") if self.path == "/v2/" else (404, body)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Docker-Distribution-API-Version", "registry/2.0")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        do_GET = do_HEAD = _answer

        def log_message(self, *args: object) -> None:
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv.server_address[1], seen
    finally:
        srv.shutdown()
        srv.server_close()


@contextlib.contextmanager
def _eof_server():
    """A loopback TCP port that accepts and closes at once (what a non-HTTP service does to
    an HTTP request)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)
    stop = threading.Event()

    def serve() -> None:
        sock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = sock.accept()
            except OSError:
                continue
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        t.join()
        sock.close()


def test_a_registry_answering_with_node_fault_words_fails_only_the_job(runtime, tmp_path):
    """Replay: a loopback registry answers ``/v2/`` 200 and the manifest 404 with "no space
    left on device" in its error message. podman's real message carries that text; the node's
    own check passes, so the attempt is the job's fault, and the registry's text is not in the
    reason."""
    from gpufleet.agent.workdir import StartError

    rt, _ = runtime
    with _http_registry(200, HOSTILE_MANIFEST) as (port, seen):
        rec, launch = _launch(tmp_path, _run_id(), ["id"], image=f"127.0.0.1:{port}/evil/img:1")
        with pytest.raises(StartError, match="cannot pull image") as err:
            rt.spawn(rec, launch)
    assert any("/manifests/" in p for p in seen), seen  # podman did reach the manifest
    assert err.value.node_fault is False
    assert "no space" not in str(err.value), str(err.value)
    assert "not found in registry" in str(err.value), str(err.value)
    assert rt.engine.find(LABEL_RUN, rec.run_id) == []


def test_a_pull_cannot_tell_the_services_behind_loopback_ports_apart(runtime, tmp_path):
    """A closed port, a port that closes at once (EOF) and an HTTP service that answers 404
    give the job one and the same reason (the engine's own message differs each time)."""
    from gpufleet.agent.workdir import StartError

    rt, _ = runtime
    reasons: dict[str, str] = {}
    with _eof_server() as eof_port, _http_registry(404, b"{}") as (http_port, _):
        closed = socket.socket()
        closed.bind(("127.0.0.1", 0))
        closed_port = closed.getsockname()[1]
        closed.close()  # nothing listens there now
        for what, port in (("refused", closed_port), ("eof", eof_port), ("404", http_port)):
            rec, launch = _launch(tmp_path, _run_id(), ["true"], image=f"127.0.0.1:{port}/x/y:1")
            with pytest.raises(StartError) as err:
                rt.spawn(rec, launch)
            assert err.value.node_fault is False
            reasons[what] = str(err.value).replace(str(port), "PORT")
    assert len(set(reasons.values())) == 1, reasons
    assert "unreachable or not a registry" in reasons["refused"], reasons


def test_a_pull_from_a_denied_registry_never_connects(tmp_path):
    """A registry in the agent's job-egress deny list is refused as the job's fault before
    podman is run: the server sees no request."""
    from gpufleet.agent.runtime.jobnet import JobNet, NetPolicy, parse_targets
    from gpufleet.agent.workdir import StartError

    with _http_registry(200, HOSTILE_MANIFEST) as (port, seen):
        net = JobNet("host", "t", NetPolicy(deny=tuple(parse_targets(f"127.0.0.1:{port}"))))
        rt = ContainerRuntime(
            ContainerEngine("podman", state_dir=tmp_path / "engine"), cdi=False, jobnet=net
        )
        rec, launch = _launch(tmp_path, _run_id(), ["true"], image=f"127.0.0.1:{port}/x/y:1")
        with pytest.raises(StartError, match="deny list") as err:
            rt.spawn(rec, launch)
        assert err.value.node_fault is False
        with pytest.raises(ImageUnavailable, match="deny list"):  # prepulls alike
            rt.engine.pull(f"127.0.0.1:{port}/x/y:1")
    assert seen == []


@contextlib.contextmanager
def _silent_server():
    """A loopback TCP port that accepts and never answers (a hung registry)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    try:
        yield sock.getsockname()[1]
    finally:
        sock.close()


def test_a_stop_during_a_pull_from_a_hung_registry_ends_the_pull(tmp_path):
    """Replay: the registry accepts and never answers (the pull would wait the whole pull
    timeout). A stop of the attempt ends the pull: spawn raises a StartError of the job (the
    attempt never started) and no pull of the image is left running."""
    from gpufleet.agent.workdir import StartError

    rt = ContainerRuntime(
        ContainerEngine("podman", state_dir=tmp_path / "engine"), cdi=False, pull_timeout_s=600
    )
    with _silent_server() as port:
        image = f"127.0.0.1:{port}/hung/img:1"
        rec, launch = _launch(tmp_path, _run_id(), ["true"], image=image)
        outcome: list[BaseException] = []

        def spawn() -> None:
            try:
                rt.spawn(rec, launch)
            except BaseException as exc:
                outcome.append(exc)

        t = threading.Thread(target=spawn, daemon=True)
        t.start()
        assert wait_until(lambda: _pulls_of(image) != [], 30), "the pull never started"
        rec.stop_reason = "cancel"
        t.join(60)
        assert not t.is_alive(), "the pull was not ended by the stop"
    assert len(outcome) == 1 and isinstance(outcome[0], StartError), outcome
    assert "stopped during the pull" in str(outcome[0])
    assert outcome[0].node_fault is False
    assert _pulls_of(image) == []
    assert rt.engine.find(LABEL_RUN, rec.run_id) == []


def _pulls_of(image: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"pull" in argv and image.encode() in argv:
            pids.append(int(d.name))
    return pids


# --------------------------------------------------------------------------- issue 24: 7, 8


def _conmon_pid(rt: ContainerRuntime, name: str) -> int:
    st = rt.engine.inspect(name)
    assert st is not None and st.conmon_pid > 0, st
    return st.conmon_pid


def test_a_container_whose_conmon_died_ends_when_its_cgroup_is_empty(runtime, tmp_path):
    """Replay (issue 24, 7): conmon SIGKILLed while the command runs; podman keeps saying
    "running" for good. The attempt ends once the command has (its cgroup is empty), with the
    exit status lost, and the container and its cgroup are removed."""
    rt, names = runtime
    rid = _run_id()
    names.append(rid)
    rec, launch = _launch(tmp_path, rid, ["sh", "-c", "echo ready; sleep 2; exit 3"])
    h = rt.spawn(rec, launch)
    assert h.cgroup is not None and h.cgroup.pids(), h
    wait_until(lambda: "ready" in launch.paths.log.read_text(), timeout_s=30)
    os.kill(_conmon_pid(rt, rid), signal.SIGKILL)
    info = _until_exit(rt, rec, h, launch.paths, t=30)
    assert info.message == LOST_EXIT and info.exit_code == -signal.SIGKILL, info
    assert info.reason == ""
    assert rt.engine.inspect(rid) is None  # the engine's state is cleaned too
    assert not h.cgroup.exists()


def test_a_stop_of_a_container_whose_conmon_died_kills_through_the_cgroup(runtime, tmp_path):
    """Replay (issue 24, 7): with conmon dead, ``podman kill`` cannot end the container for
    podman ("container survives SIGKILL"); the agent kills its processes through the cgroup
    and the stop finishes."""
    rt, names = runtime
    rid = _run_id()
    names.append(rid)
    script = "trap 'echo got-term' TERM; echo ready; while true; do sleep 0.1; done"
    rec, launch = _launch(tmp_path, rid, ["sh", "-c", script])
    h = rt.spawn(rec, launch)
    wait_until(lambda: "ready" in launch.paths.log.read_text(), timeout_s=30)
    os.kill(_conmon_pid(rt, rid), signal.SIGKILL)
    rec.stop_reason, rec.stop_grace_s = "cancel", 0.5
    info = _until_exit(rt, rec, h, launch.paths, t=30)
    assert info.exit_code == -signal.SIGKILL and not h.unkillable, info
    assert rt.engine.inspect(rid) is None
    assert h.cgroup is not None and not h.cgroup.exists()


def test_page_cache_at_the_limit_then_sigkill_is_not_an_oom(runtime, tmp_path):
    """Replay (issue 24, 8): a container with memory_mb 64 that fills its cgroup with page
    cache (no OOM) and then dies of SIGKILL is not OOM_KILLED (it keeps its retries)."""
    rt, names = runtime
    rid = _run_id()
    names.append(rid)
    script = "dd if=/dev/zero of=/tmp/fill bs=1M count=160 2>/dev/null; sync; kill -9 $$"
    rec, launch = _launch(tmp_path, rid, ["sh", "-c", script], memory_mb=64)
    h = rt.spawn(rec, launch)
    info = _until_exit(rt, rec, h, launch.paths)
    assert info.exit_code == 137 and info.reason == "", info


def test_a_child_oom_killed_then_exit_1_is_oom_killed(runtime, tmp_path):
    """Replay (issue 24, 8): the kernel OOM-killed a child and the command then exited 1:
    OOM_KILLED (as the process runtime says), from the kernel's oom_kill counter."""
    rt, names = runtime
    rid = _run_id()
    names.append(rid)
    script = 'sh -c "x=\\$(head -c 200000000 /dev/zero | tr \\"\\\\0\\" a)"; echo child=$?; exit 1'
    rec, launch = _launch(tmp_path, rid, ["sh", "-c", script], memory_mb=32)
    h = rt.spawn(rec, launch)
    info = _until_exit(rt, rec, h, launch.paths)
    assert "child=137" in launch.paths.log.read_text()
    assert info.exit_code == 1 and info.reason == OOM_KILLED, info
