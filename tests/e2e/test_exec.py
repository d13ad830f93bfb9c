"""Getting into a running job (issue 26): ``gpufleet exec``, ``shell`` and ``port-forward``
through a real API server (WebSocket), the agent's ``Agent.Exec`` (mutual TLS, the API's own
``api`` certificate) and the job's containment: a per-attempt uid, its cgroup, its network
and mount namespaces (this development machine: root, cgroup v1, job network namespaces).
"""

from __future__ import annotations

import contextlib
import os
import pty
import re
import select
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from gpufleet.agent.runtime.containment import detect
from tests.e2e.harness import Fleet
from tests.ports import free_port

SYSTEM_PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (job users, cgroups, netns)"),
    pytest.mark.skipif(
        not detect("probe").kind.startswith("cgroup"), reason="no cgroup containment here"
    ),
]


def _cli_env(fleet: Fleet, team: str = "vision") -> dict[str, str]:
    return {
        **os.environ,
        "GPUFLEET_URL": fleet.api.url,
        "GPUFLEET_TOKEN": fleet.tokens[team],
        "GPUFLEET_CONFIG": "/nonexistent/client.yaml",
    }


def _gpufleet(
    fleet: Fleet, *args: str, team: str = "vision", timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", *args],
        env=_cli_env(fleet, team),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _sleeper(fleet: Fleet) -> list[str]:
    """A job command that sleeps; its argv carries the fleet's marker (``Fleet.stop`` kills
    what is left by it)."""
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    return [SYSTEM_PY, "-c", "import time; time.sleep(600)", marker]


def _http_server(fleet: Fleet, port: int) -> list[str]:
    marker = f"gpufleet-test-marker-{fleet.tmp.name}"
    code = (
        "import runpy, sys; "
        f"sys.argv = ['http.server', '{port}', '--bind', '127.0.0.1', "
        "'--directory', '/usr/share']; "
        "runpy.run_module('http.server', run_name='__main__')"
    )
    return [SYSTEM_PY, "-c", code, marker]


def _running_job(fleet: Fleet, body: dict[str, Any]) -> tuple[str, int]:
    """Submit ``body``; returns (job id, its command's host pid) once it runs."""
    job_id = fleet.submit(body)
    fleet.wait_status(job_id, {"RUNNING"}, 60)
    from gpufleet.store.tables import JobRunRow

    pids: list[int] = []

    def started() -> bool:  # the pid comes with the agent's confirmation
        with fleet.db.read() as s:
            run = s.query(JobRunRow).filter_by(job_id=job_id, status="RUNNING").one()
            if run.pid:
                pids.append(int(run.pid))
        return bool(pids)

    fleet.wait_for(started, 60, f"{job_id}'s pid")
    return job_id, pids[0]


def _ns(pid: int | str, kind: str) -> str:
    return os.readlink(f"/proc/{pid}/ns/{kind}")


def _status_uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError("no Uid line")


def _environ(pid: int) -> dict[str, str]:
    items = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(i.decode().split("=", 1) for i in items if b"=" in i)


@pytest.fixture
def fleet_n1(tmp_path: Path) -> Any:
    f = Fleet(tmp_path).start()
    try:
        f.start_agent("n1", gpus="4xH100-80GB", job_uids="per-attempt", wait=False)
        # a first start of an agent with job users and networks takes long on a busy machine
        f.wait_for(
            lambda: f.node("n1")["status"] == "HEALTHY" if f.get("/v1/nodes")["items"] else False,
            120,
            "agent n1",
        )
        yield f
    finally:
        f.stop()


def test_exec_runs_as_the_job_in_its_cgroup_namespaces_and_gpus(fleet_n1: Fleet) -> None:
    fleet = fleet_n1
    job_id, pid = _running_job(fleet, {"command": _sleeper(fleet), "gpu_count": 2})
    probe = (
        "id -u; cat /proc/self/cgroup | grep memory; readlink /proc/self/ns/net; "
        'readlink /proc/self/ns/mnt; echo "cvd=$CUDA_VISIBLE_DEVICES"; echo oops >&2; exit 7'
    )
    r = _gpufleet(fleet, "exec", job_id, "--", "sh", "-c", probe)
    assert r.returncode == 7, r.stderr
    uid, cgroup, netns, mntns, cvd = r.stdout.splitlines()
    assert int(uid) == _status_uid(pid)
    assert int(uid) not in (0, os.geteuid())  # the job's per-attempt uid, not the agent's
    job_cgroup = next(
        line for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines() if "memory" in line
    )
    assert cgroup == job_cgroup
    assert "/r-" in cgroup  # the attempt's own group
    assert netns == _ns(pid, "net") != _ns("self", "net")
    assert mntns == _ns(pid, "mnt") != _ns("self", "mnt")
    assert cvd == f"cvd={_environ(pid)['CUDA_VISIBLE_DEVICES']}"
    assert len(cvd.split("=")[1].split(",")) == 2
    assert "oops" in r.stderr

    # audited on the job's trail: who, what, the exit code
    events = [e for e in fleet.get(f"/v1/jobs/{job_id}/events")["items"] if "exec" in e["kind"]]
    assert [e["kind"] for e in events] == ["exec_started", "exec_ended"]
    assert events[1]["details"]["exit_code"] == 7
    assert events[0]["details"]["team_id"] == "vision"
    assert "readlink" in events[0]["details"]["command"]

    # another team's token: as if the job did not exist, nothing ran, nothing recorded
    r = _gpufleet(fleet, "exec", job_id, "--", "touch", "/tmp/x", team="nlp")
    assert r.returncode == 2
    assert "no job" in r.stderr
    after = [e for e in fleet.get(f"/v1/jobs/{job_id}/events")["items"] if "exec" in e["kind"]]
    assert len(after) == 2


def test_port_forward_reaches_the_jobs_own_loopback(fleet_n1: Fleet) -> None:
    fleet = fleet_n1
    remote = free_port()
    job_id, _pid = _running_job(
        fleet,
        {"command": _http_server(fleet, remote)},
    )
    # the job's server listens on its own loopback, not the node's
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{remote}/", timeout=2)
    local = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufleet.cli.main", "port-forward", job_id, f"{local}:{remote}"],
        env=_cli_env(fleet),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        body = ""
        while time.monotonic() < deadline:
            try:
                resp = httpx.get(f"http://127.0.0.1:{local}/", timeout=10)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            assert resp.status_code == 200
            body = resp.text
            break
        assert "Directory listing" in body
        # a second connection over a new session
        assert httpx.get(f"http://127.0.0.1:{local}/", timeout=10).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    kinds = [e["details"] for e in fleet.get(f"/v1/jobs/{job_id}/events")["items"]]
    assert any(d and d.get("forward_port") == remote for d in kinds)

    # refused before listening: a job that does not exist, a local port in use (exit 2, a
    # message, no traceback)
    cli = [sys.executable, "-m", "gpufleet.cli.main", "port-forward"]
    gone = subprocess.run(
        [*cli, "j-doesnotexist00", f"{free_port()}:{remote}"],
        env=_cli_env(fleet),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert gone.returncode == 2 and "Traceback" not in gone.stderr, gone.stderr
    assert "forwarding" not in gone.stderr
    with socket.create_server(("127.0.0.1", 0)) as busy:
        taken = subprocess.run(
            [*cli, job_id, f"{busy.getsockname()[1]}:{remote}"],
            env=_cli_env(fleet),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert taken.returncode == 2 and "cannot listen" in taken.stderr, taken.stderr
    assert "Traceback" not in taken.stderr
    # nothing listens on that port in the job: the local connection is closed, not left hanging
    local = free_port()
    proc = subprocess.Popen(
        [*cli, job_id, f"{local}:{free_port()}"],
        env=_cli_env(fleet),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline, outcome = time.monotonic() + 30, None
        while time.monotonic() < deadline and outcome is None:
            try:
                httpx.get(f"http://127.0.0.1:{local}/", timeout=15)
                outcome = "answered"
            except httpx.ConnectError:
                time.sleep(0.2)  # not listening yet
            except httpx.TimeoutException:
                outcome = "hung"
            except httpx.TransportError:
                outcome = "closed"
        assert outcome == "closed"
    finally:
        proc.terminate()
        _out, err = proc.communicate(timeout=10)
    assert b"Traceback" not in err, err.decode(errors="replace")


def test_shell_on_a_pty_exits_with_the_shells_code(fleet_n1: Fleet) -> None:
    fleet = fleet_n1
    job_id, _pid = _running_job(fleet, {"command": _sleeper(fleet)})
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufleet.cli.main", "shell", job_id],
        env=_cli_env(fleet),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    os.close(slave)
    seen = b""
    os.write(master, b"tty; echo ppid=$PPID; exit 3\n")  # typed ahead, before the prompt
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([master], [], [], 0.2)[0]:
            try:
                seen += os.read(master, 4096)
            except OSError:
                break
    rc = proc.wait(timeout=10)
    os.close(master)
    text = seen.decode(errors="replace")
    assert rc == 3, text
    assert "ppid=" in text
    assert "/dev/pts/" in text  # a terminal on the job's side too


@pytest.mark.skipif(shutil.which("script") is None, reason="needs script (util-linux)")
def test_exec_tty_without_stdin_prints_only_the_output(fleet_n1: Fleet, tmp_path: Path) -> None:
    """``exec -t`` on a terminal whose own stdin ends (``script < /dev/null``, as a CI log or
    a recorder runs it): stdin is not forwarded without ``-i`` (it was, and the EOF byte that
    ``script`` writes came back echoed by the job's terminal as a stray ``^@``), and lines end
    with one CR LF."""
    fleet = fleet_n1
    job_id, _pid = _running_job(fleet, {"command": _sleeper(fleet)})
    cli = shlex.join(
        [sys.executable, "-m", "gpufleet.cli.main", "exec", "-t", job_id, "--", "echo", "only"]
    )
    r = subprocess.run(
        ["script", "-qec", cli, str(tmp_path / "typescript")],
        env=_cli_env(fleet),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert r.returncode == 0, r
    assert r.stdout == b"only\r\n", r.stdout


@pytest.mark.skipif(shutil.which("podman") is None, reason="needs podman")
def test_exec_into_a_container_job(fleet_n1: Fleet) -> None:
    from tests.container_support import BUSYBOX

    fleet = fleet_n1
    job_id, pid = _running_job(fleet, {"image": BUSYBOX, "command": ["sleep", "600"]})
    r = _gpufleet(fleet, "exec", job_id, "--", "sh", "-c", "id -u; hostname; exit 4", timeout=60)
    assert r.returncode == 4, r.stderr
    uid = r.stdout.splitlines()[0]
    assert int(uid) not in (0, os.geteuid())
    assert int(uid) == _status_uid(pid)  # the container's user (the attempt's uid)


def test_interactive_job_holds_until_no_session_for_its_idle_timeout(fleet_n1: Fleet) -> None:
    """``submit --interactive`` (like ``salloc``): it waits for RUNNING and opens a shell on a
    terminal; an open session keeps the job past its idle timeout (3 s here), leaving the
    shell does not end it, and once no session is open for 3 s it ends SUCCEEDED."""
    fleet = fleet_n1
    master, slave = pty.openpty()
    args = ["submit", "--interactive", "--idle-timeout", "3s", "--workdir", "-", "--gpus", "1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpufleet.cli.main", *args],
        env=_cli_env(fleet),
        stdin=slave,
        stdout=slave,
        stderr=slave,
        start_new_session=True,
    )
    os.close(slave)
    os.write(master, b"sleep 4; echo in-job-$GPUFLEET_JOB_ID; exit 0\n")  # typed ahead
    seen = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([master], [], [], 0.2)[0]:
            try:
                seen += os.read(master, 4096)
            except OSError:
                break
    rc = proc.wait(timeout=10)
    with contextlib.suppress(OSError):
        while select.select([master], [], [], 0.2)[0]:
            seen += os.read(master, 4096)
    os.close(master)
    text = seen.decode(errors="replace")
    assert rc == 0, text
    job_id = re.findall(r"\bj-[0-9a-z]+", text)[0]
    assert f"in-job-{job_id}" in text  # the shell ran in the job
    assert f"gpufleet shell {job_id}" in text and f"gpufleet cancel {job_id}" in text
    # 4 s in the shell, past the 3 s idle timeout: the job still holds its GPUs
    assert fleet.job(job_id)["status"] == "RUNNING"

    r = _gpufleet(fleet, "exec", job_id, "--", "sh", "-c", "sleep 4; echo still-here")
    assert r.returncode == 0 and "still-here" in r.stdout, r.stderr
    assert fleet.job(job_id)["status"] == "RUNNING"  # kept alive by the open session

    done = fleet.wait_status(job_id, {"SUCCEEDED", "FAILED", "CANCELLED"}, 30)
    assert done["status"] == "SUCCEEDED", done
    assert done["attempts"][-1]["exit_code"] == 0
