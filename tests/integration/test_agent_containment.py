"""Containment of process jobs, with real processes, cgroups, users and signals.

The agent (in this process, or a subprocess for kill -9) talks real gRPC to a fake controller
that records calls. Process checks scan /proc here, independently of the agent's code.

These tests need root and cgroup containment (this development machine: cgroup v1, root).
Jobs run a system Python (``/usr/bin/python3``) so that unprivileged per-attempt job uids can
execute it whatever the test interpreter's location.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpufleet.agent.runner import JOBS_ROOT, agent_scope
from gpufleet.agent.runtime import jobns
from gpufleet.agent.runtime.containment import detect
from gpufleet.cli.config import client_config_path, write_client_config
from gpufleet.objectstore import ObjectStore
from gpufleet.processes import open_database
from gpufleet.rpc.protos import fleet_pb2 as pb
from gpufleet.rpc.protos import fleet_pb2_grpc as pb_grpc
from gpufleet.settings import Settings
from tests.integration.test_agent_support import (
    LEADER_EPOCH,
    FakeController,
    InProcessAgent,
    agent_subprocess,
    fake_controller,
    inprocess_agent,
    make_settings,
    pid_alive,
    test_pki,
    wait_until,
)

A = pb.AssignJobResponse
S = pb.StopRunResponse
R = pb.ReportCompletionRequest

SYSTEM_PY = shutil.which("python3", path="/usr/bin:/bin") or "/usr/bin/python3"
CONTAINMENT = detect("probe").kind

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (cgroups, job users)"),
    pytest.mark.skipif(
        not CONTAINMENT.startswith("cgroup"), reason=f"no cgroup containment ({CONTAINMENT})"
    ),
]


def processes_with(marker: str) -> list[int]:
    """Live (non-zombie) pids whose command line contains ``marker``."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{name}/cmdline").read_bytes()
            stat = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        if marker.encode() in cmdline and stat[stat.rfind(")") + 2] not in "ZX":
            found.append(int(name))
    return found


def py(code: str, *args: str) -> list[str]:
    return [SYSTEM_PY, "-c", code, *args]


@pytest.fixture(scope="module")
def public_tmp() -> Iterator[Path]:
    """A directory other users can traverse (pytest's own tmp is 0700, which would make every
    refusal below trivially true)."""
    base = Path("/var/lib/gpufleet")  # not /tmp: each job has a /tmp of its own
    base.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="test-containment-", dir=base))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module", params=["auto", "pidns"])
def env(
    request: pytest.FixtureRequest, public_tmp: Path
) -> Iterator[tuple[FakeController, InProcessAgent, ObjectStore, Path]]:
    """One agent per containment: the best (a cgroup here) and the PID-namespace fallback."""
    containment = request.param
    os.environ["AGENT_ONLY_MARKER"] = "agent-secret-4711"  # must never reach a job
    try:
        with fake_controller() as (fake, address):
            root = public_tmp / containment
            root.mkdir()
            root.chmod(0o755)
            settings = make_settings(address, root / "data")
            with inprocess_agent(
                fake,
                settings,
                root / "state",
                job_uids="per-attempt",
                containment=containment,
            ) as agent:
                agent.extra["containment"] = containment
                yield fake, agent, ObjectStore(settings.resolved_object_store_url()), root
    finally:
        os.environ.pop("AGENT_ONLY_MARKER", None)


ESCAPER = r"""
import os, signal, sys, time
marker = sys.argv[1]
if os.fork() == 0:
    os.setsid()  # leaves the job's session and process group
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    os.execv(sys.executable, [sys.executable, "-c", code, marker + "-child"])
print("parent up", flush=True)
time.sleep(600)
"""


class TestStopContainsEverything:
    def test_setsid_child_ignoring_sigterm_is_gone_before_the_report(self, env) -> None:
        fake, agent, _, _ = env
        marker = "gf-escaper-1"
        fake.on_report = lambda r: processes_with(marker) if r.run_id == "r-esc" else None
        resp = agent.assign(run_id="r-esc", job_id="j-esc", token=1, command=py(ESCAPER, marker))
        assert resp.result == A.STARTED, resp.message
        child = wait_until(lambda: processes_with(marker + "-child"), timeout_s=15)[0]
        stat = Path(f"/proc/{child}/stat").read_text()
        fields = stat[stat.rfind(")") + 2 :].split()
        assert int(fields[3]) == child, "the child leads its own session"
        assert int(fields[2]) != resp.pid, "the child left the job's process group"

        stop = agent.stop_run(run_id="r-esc", token=1, grace_s=0.5, reason="cancel")

        assert stop.result == S.STOPPING
        report = fake.wait_report("r-esc", timeout_s=30)
        assert fake.observed_at_report["r-esc"] == [], "job processes alive at report time"
        assert processes_with(marker) == []
        assert report.outcome == R.STOPPED


OOM_JOB = r"""
import sys, time
print("allocating", flush=True)
blocks = []
for _ in range(64):
    blocks.append(bytearray(16 * 1024 * 1024))  # 16 MiB each, touched (zero-filled)
    time.sleep(0.01)
print("survived", flush=True)
"""


class TestMemoryLimit:
    def test_job_over_memory_mb_is_oom_killed_and_a_neighbour_keeps_running(self, env) -> None:
        fake, agent, _, _ = env
        if agent.extra["containment"] == "pidns":
            pytest.skip("a PID namespace sets no memory limit")
        neighbour = agent.assign(
            run_id="r-nb",
            job_id="j-nb",
            token=1,
            memory_mb=256,
            command=py("import time; time.sleep(600)", "gf-neighbour"),
        )
        assert neighbour.result == A.STARTED, neighbour.message

        hog = agent.assign(
            run_id="r-oom", job_id="j-oom", token=1, memory_mb=64, command=py(OOM_JOB)
        )

        assert hog.result == A.STARTED, hog.message
        report = fake.wait_report("r-oom", timeout_s=60)
        assert (report.outcome, report.exit_code) == (R.EXITED, -signal.SIGKILL)
        assert report.reason == "OOM_KILLED"
        assert "memory_mb=64" in report.message
        assert pid_alive(neighbour.pid), "the neighbour job was hit"
        assert processes_with("gf-neighbour")
        fake.wait_for(
            lambda: any(r.run_id == "r-nb" for r in fake.heartbeats[-1].running), timeout_s=10
        )
        agent.stop_run(run_id="r-nb", token=1, grace_s=0.5, reason="cancel")
        assert fake.wait_report("r-nb", timeout_s=30).reason == ""

    def test_limits_are_written_to_the_attempts_cgroup(self, env) -> None:
        fake, agent, _, _ = env
        if agent.extra["containment"] == "pidns":
            pytest.skip("a PID namespace sets no limits")
        resp = agent.assign(
            run_id="r-lim",
            job_id="j-lim",
            token=1,
            memory_mb=100,
            cpu=0.5,
            command=py("import time; time.sleep(600)"),
        )
        assert resp.result == A.STARTED, resp.message
        started = [
            json.loads(line)
            for line in (agent.state_dir / "assignments.jsonl").read_text().splitlines()
            if '"started"' in line and '"r-lim"' in line
        ]
        dirs = {c: Path(d) for c, d in started[0]["runtime_state"]["cgroup"]["dirs"].items()}
        try:
            if "memory" in dirs:  # cgroup v1
                limit = (dirs["memory"] / "memory.limit_in_bytes").read_text()
                assert int(limit) == 100 * 1024 * 1024
                if "cpu" in dirs:
                    assert (dirs["cpu"] / "cpu.cfs_quota_us").read_text().strip() == "50000"
                assert resp.pid in {
                    int(p) for p in (dirs["memory"] / "cgroup.procs").read_text().split()
                }
            else:
                unified = dirs["unified"]
                assert int((unified / "memory.max").read_text()) == 100 * 1024 * 1024
                assert (unified / "cpu.max").read_text().split()[0] == "50000"
        finally:
            agent.stop_run(run_id="r-lim", token=1, grace_s=0.5, reason="cancel")
        fake.wait_report("r-lim", timeout_s=30)
        assert not any(d.exists() for d in dirs.values()), "the cgroup is removed after the stop"


PROBE = r"""
import json, os, sys
targets = json.loads(os.environ["TARGETS"])
results = {}
for name, (how, path) in sorted(targets.items()):
    try:
        if how == "list":
            os.listdir(path)
        else:
            with open(path, "rb") as f:
                f.read(1)
        results[name] = "READ"
    except PermissionError:
        results[name] = "REFUSED"
    except FileNotFoundError as exc:  # /proc mounted with hidepid: other uids are invisible
        results[name] = "HIDDEN" if path.startswith("/proc/") else f"ERROR {exc}"
    except OSError as exc:
        results[name] = f"ERROR {exc}"
    print(name, results[name], flush=True)
art = os.environ["GPUFLEET_ARTIFACTS_DIR"]
with open(os.path.join(art, "probe.json"), "w") as f:
    json.dump({"results": results, "env": sorted(os.environ), "uid": os.getuid()}, f)
sys.exit(sum(v not in ("REFUSED", "HIDDEN") for k, v in results.items() if k[:7] != "control"))
"""

SECRET_KEEPER = r"""
import os, time
art = os.environ["GPUFLEET_ARTIFACTS_DIR"]
with open(os.path.join(art, "secret.txt"), "w") as f:
    f.write("model weights of team A")
open(os.path.join(art, "ready"), "w").close()
time.sleep(600)
"""


class TestJobsCannotReachThePlatform:
    def test_job_is_refused_each_platform_file_and_another_jobs_outputs(self, env) -> None:
        fake, agent, store, public = env
        data = public / "data"
        open_database(Settings(data_dir=data)).engine.dispose()  # as `gpufleet server` does
        write_client_config(client_config_path(data), "http://127.0.0.1:1", "gf_admin_secret")
        assert (data / "gpufleet.db").stat().st_mode & 0o777 == 0o600
        assert data.stat().st_mode & 0o777 == 0o700
        assert agent.state_dir.stat().st_mode & 0o777 == 0o700

        keeper = agent.assign(run_id="r-keep", job_id="j-keep", token=1, command=py(SECRET_KEEPER))
        assert keeper.result == A.STARTED, keeper.message
        scope = agent_scope(agent.state_dir.resolve(), "node-test")
        keeper_root = JOBS_ROOT / scope / "r-keep"
        wait_until(lambda: (keeper_root / "artifacts" / "ready").exists(), timeout_s=15)
        targets = {
            "database": ("read", str(data / "gpufleet.db")),
            "admin_token": ("read", str(client_config_path(data))),
            "agent_environ": ("read", f"/proc/{os.getpid()}/environ"),
            "agent_state_dir": ("list", str(agent.state_dir)),
            "agent_assignment_log": ("read", str(agent.state_dir / "assignments.jsonl")),
            "other_job_artifact": ("read", str(keeper_root / "artifacts" / "secret.txt")),
            "other_job_dir": ("list", str(keeper_root)),
            "other_job_environ": ("read", f"/proc/{keeper.pid}/environ"),
            "jobs_root_listing": ("list", str(keeper_root.parent)),
            "control_world_readable": ("read", "/etc/passwd"),
        }

        probe = agent.assign(
            run_id="r-probe",
            job_id="j-probe",
            token=1,
            command=py(PROBE),
            env={"TARGETS": json.dumps(targets), "PATH": "/usr/bin:/bin"},
        )

        assert probe.result == A.STARTED, probe.message
        report = fake.wait_report("r-probe", timeout_s=30)
        prefix = "jobs/j-probe/attempts/r-probe"
        seen = json.loads(store.get_bytes(f"{prefix}/artifacts/probe.json"))
        log = store.get_bytes(f"{prefix}/logs/output.log").decode()
        hidden = jobns.detect().hide_pids  # then /proc shows the job only its own uid
        want = {
            k: "HIDDEN" if hidden and path.startswith("/proc/") else "REFUSED"
            for k, (_, path) in targets.items()
            if not k.startswith("control")
        }
        assert seen["results"] == {**want, "control_world_readable": "READ"}
        for name, result in want.items():
            assert f"{name} {result}" in log
        assert report.exit_code == 0
        assert seen["uid"] not in (0, os.getuid())
        # the environment is the allow-list: job env + platform variables, nothing of ours
        assert "AGENT_ONLY_MARKER" not in seen["env"]
        allowed = {"PATH", "HOME", "TARGETS", "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER"}
        extra = {
            k
            for k in seen["env"]
            if k not in allowed
            and not k.startswith(("GPUFLEET_", "LC_"))
            and k not in ("LANG", "LANGUAGE", "TZ", "TERM")
        }
        assert extra == set()
        agent.stop_run(run_id="r-keep", token=1, grace_s=0.5, reason="cancel")
        fake.wait_report("r-keep", timeout_s=30)

    def test_working_dir_the_job_user_cannot_enter_fails_the_start_by_name(
        self, env, tmp_path: Path
    ) -> None:
        fake, agent, _, _ = env
        private = tmp_path / "private"  # under pytest's 0700 tmp root
        private.mkdir()

        resp = agent.assign(
            run_id="r-wd",
            job_id="j-wd",
            token=1,
            command=py("print('hi')"),
            working_dir=str(private),
        )

        assert resp.result == A.FAILED_TO_START
        assert "working_dir" in resp.message and str(private) in resp.message
        assert "Permission denied" in resp.message
        assert fake.wait_report("r-wd").outcome == R.NEVER_STARTED


STAGE2_PROBE = r"""
import json, os, sys
seen = {
    "uid": os.getuid(),
    "cwd": os.getcwd(),
    "ld": os.environ.get("LD_LIBRARY_PATH"),
    "stdin": os.readlink("/proc/self/fd/0"),
    "stdin_bytes": len(sys.stdin.buffer.read()),
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
}
with open(os.path.join(os.environ["GPUFLEET_ARTIFACTS_DIR"], "seen.json"), "w") as f:
    json.dump(seen, f)
"""


class TestTheShimsSecondStage:
    """The shim's second stage (run as the job user: a working_dir the job chose, loader
    variables set back, unshare's stage under pidns) reads the script from a descriptor the
    first stage opened as root, never from its path: a package the job user cannot read (a
    venv under /root, any 0700 parent) must still start jobs, with stdin /dev/null."""

    @pytest.fixture
    def unreadable_shim(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
        from gpufleet.agent import shim

        package = tmp_path / "venv" / "gpufleet" / "agent"  # under pytest's 0700 tmp root too
        package.mkdir(parents=True)
        (tmp_path / "venv").chmod(0o700)
        script = package / "shim.sh"
        shutil.copyfile(shim.SHIM_SH, script)
        script.chmod(0o644)
        monkeypatch.setattr(shim, "SHIM_SH", script)
        return script

    def _run(self, setup, run_id: str, **assign: Any) -> dict[str, Any]:
        fake, agent, store, _ = setup
        resp = agent.assign(
            run_id=run_id, job_id=f"j-{run_id}", token=1, command=py(STAGE2_PROBE), **assign
        )
        assert resp.result == A.STARTED, resp.message
        report = fake.wait_report(run_id, timeout_s=30)
        assert (report.outcome, report.exit_code) == (R.EXITED, 0), report.message
        prefix = f"jobs/j-{run_id}/attempts/{run_id}"
        seen = json.loads(store.get_bytes(f"{prefix}/artifacts/seen.json"))
        assert seen["uid"] not in (0, os.getuid())
        # stdin: /dev/null, not the script the stage read; no descriptor of the shim's left
        assert (seen["stdin"], seen["stdin_bytes"]) == ("/dev/null", 0)
        assert [fd for fd in seen["fds"] if fd > 2] == [3], seen["fds"]  # 3: listdir's own
        return seen

    def test_a_working_dir_the_job_chose(self, env, public_tmp: Path, unreadable_shim) -> None:
        workdir = public_tmp / f"workdir-{env[1].extra['containment']}"
        workdir.mkdir()
        workdir.chmod(0o755)

        seen = self._run(env, f"r-s2wd-{env[1].extra['containment']}", working_dir=str(workdir))

        assert seen["cwd"] == str(workdir)

    def test_loader_variables_set_back_as_the_job_user(self, env, unreadable_shim) -> None:
        fake, agent, _, _ = env
        kind = dict(fake.registrations[-1].labels)["gpufleet/containment"]
        if agent.extra["containment"] == "pidns" and kind != "pidns":
            pytest.skip(f"no PID-namespace containment on this machine (the agent got {kind})")

        seen = self._run(
            env, f"r-s2ld-{agent.extra['containment']}", env={"LD_LIBRARY_PATH": "/opt/gf-libs"}
        )

        assert seen["ld"] == "/opt/gf-libs"
        if agent.extra["containment"] == "pidns":
            assert kind == "pidns"  # unshare --setuid ran the second stage


ADOPTEE = r"""
import os, sys, time
marker = sys.argv[1]
with open(os.path.join(os.environ["GPUFLEET_ARTIFACTS_DIR"], "starts"), "a") as f:
    f.write("start\n")
if os.fork() == 0:
    os.setsid()
    code = "import time; time.sleep(600)"
    os.execv(sys.executable, [sys.executable, "-c", code, marker + "-child"])
time.sleep(600)
"""


@pytest.mark.chaos
def test_kill_9_agent_then_restart_adopts_the_cgroup_without_a_second_start(
    public_tmp: Path,
) -> None:
    home = public_tmp / "restart"
    home.mkdir()
    state = home / "state"
    marker = "gf-adoptee-1"
    with fake_controller() as (fake, address):
        agent = agent_subprocess(address, home, state, job_uids="per-attempt")
        try:
            reg = fake.wait_for(lambda: fake.registrations, 20)[0]
            with test_pki().agent_channel(reg.address, reg.node_id) as channel:
                stub = pb_grpc.AgentStub(channel)
                request = pb.AssignJobRequest(
                    run_id="r-adopt",
                    job_id="j-adopt",
                    token=1,
                    leader_epoch=LEADER_EPOCH,
                    attempt=1,
                    memory_mb=128,
                    command=py(ADOPTEE, marker),
                )
                assert stub.AssignJob(request, timeout=30).result == A.STARTED
            wait_until(lambda: processes_with(marker + "-child"), timeout_s=15)
            fake.wait_for(lambda: fake.confirms)

            agent.kill()
            agent.wait()
            before = sorted(processes_with(marker))
            assert before, "the job survives its agent"

            agent = agent_subprocess(address, home, state, job_uids="per-attempt")
            reg = fake.wait_for(lambda: [r for r in fake.registrations if r.agent_epoch == 2])[0]
            with test_pki().agent_channel(reg.address, reg.node_id) as channel:
                stub = pb_grpc.AgentStub(channel)
                again = stub.AssignJob(request, timeout=30)
                runs = stub.ListRuns(pb.ListRunsRequest(), timeout=10).runs
                assert again.result == A.ALREADY_RUNNING
                assert [(r.run_id, r.state) for r in runs] == [("r-adopt", "RUNNING")]
                assert sorted(processes_with(marker)) == before, "started twice"
                starts = JOBS_ROOT / agent_scope(state, "node-sub") / "r-adopt/artifacts/starts"
                assert starts.read_text() == "start\n"
                stop = pb.StopRunRequest(
                    run_id="r-adopt",
                    token=1,
                    leader_epoch=LEADER_EPOCH,
                    grace_s=0.5,
                    reason="cancel",
                )
                assert stub.StopRun(stop, timeout=10).result == S.STOPPING
            report = fake.wait_report("r-adopt", timeout_s=30)
            assert report.outcome == R.STOPPED
            assert processes_with(marker) == []
            lines = [json.loads(x) for x in (state / "assignments.jsonl").read_text().splitlines()]
            # the restart compacted the log into one snapshot line per run
            rec = next(x["run"] for x in lines if x["e"] == "run")
            assert (rec["run_id"], rec["runtime"]) == ("r-adopt", "process")
            cgroup = rec["runtime_state"]["cgroup"]["dirs"]["memory"]
            assert cgroup.endswith(f"/gpufleet/{agent_scope(state, 'node-sub')}/r-adopt")
            assert not Path(cgroup).exists(), "the cgroup is removed once verified empty"
        finally:
            if agent.poll() is None:
                agent.send_signal(signal.SIGKILL)
                agent.wait()
            for pid in processes_with(marker):
                os.kill(pid, signal.SIGKILL)


def test_an_agent_without_containment_says_so_at_start_and_to_the_controller(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with fake_controller() as (fake, address), caplog.at_level("WARNING", "gpufleet.agent"):
        settings = make_settings(address, tmp_path)
        with inprocess_agent(fake, settings, tmp_path / "state", containment="none"):
            labels = dict(fake.registrations[-1].labels)
    assert labels["gpufleet/containment"] == "none"
    assert labels["gpufleet/job-user"] == "jobs-as-agent-user"
    warnings = [r.getMessage() for r in caplog.records if "containment: none" in r.getMessage()]
    assert len(warnings) == 1


def test_agent_start_removes_empty_groups_left_by_a_crash(tmp_path: Path) -> None:
    state = (tmp_path / "state").resolve()
    found = detect(agent_scope(state, "node-test"))
    stale = found.group_for("r-stale")
    assert stale is not None
    stale.create(memory_mb=64, cpu=0)
    assert stale.exists()
    with fake_controller() as (fake, address):
        settings = make_settings(address, tmp_path)
        with inprocess_agent(fake, settings, state, job_uids="per-attempt"):
            assert not stale.exists()
