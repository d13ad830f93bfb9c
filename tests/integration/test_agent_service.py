"""The node agent over real gRPC with real processes and signals, against a fake controller.

One agent (declared inventory 4xA100-40GB) serves the whole module; each test uses its own
job and run ids.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.domain.manifest import Manifest
from gpufleet.objectstore import ObjectStore
from gpufleet.rpc.protos import fleet_pb2 as pb
from tests.integration.test_agent_support import (
    FakeController,
    InProcessAgent,
    fake_controller,
    inprocess_agent,
    live_group_members,
    make_settings,
    pid_alive,
    python_cmd,
    wait_until,
)

A = pb.AssignJobResponse
S = pb.StopRunResponse
R = pb.ReportCompletionRequest


@pytest.fixture(scope="module")
def env(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[FakeController, InProcessAgent, ObjectStore, Path]]:
    tmp = tmp_path_factory.mktemp("agent")
    with fake_controller() as (fake, address):
        settings = make_settings(address, tmp)
        with inprocess_agent(fake, settings, tmp / "state") as agent:
            yield fake, agent, ObjectStore(settings.resolved_object_store_url()), tmp


JOB_ENV_SCRIPT = r"""
import json, os, pathlib
keys = ["CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "GPUFLEET_JOB_ID", "GPUFLEET_RUN_ID",
        "GPUFLEET_ATTEMPT", "GPUFLEET_FENCING_TOKEN", "GPUFLEET_CHECKPOINT_DIR",
        "GPUFLEET_ARTIFACTS_DIR", "GPUFLEET_RESUME_FROM", "FOO"]
seen = {k: os.environ.get(k) for k in keys}
ckpt = pathlib.Path(os.environ["GPUFLEET_CHECKPOINT_DIR"])
seen["checkpoint_dir_empty_at_start"] = not any(ckpt.iterdir())
resume = os.environ["GPUFLEET_RESUME_FROM"]
seen["resumed"] = (pathlib.Path(resume) / "step-9" / "state.txt").read_text() if resume else None
art = pathlib.Path(os.environ["GPUFLEET_ARTIFACTS_DIR"])
(art / "env.json").write_text(json.dumps(seen))
(art / "sub").mkdir()
(art / "sub" / "metrics.csv").write_text("step,loss\n1,0.5\n")
(ckpt / "step-10").mkdir()
(ckpt / "step-10" / "model.bin").write_bytes(os.urandom(4096))
print("hello from the job", flush=True)
"""


class TestRunToCompletion:
    def test_runs_with_pinned_gpus_and_env_then_uploads_outputs_and_manifest(self, env) -> None:
        fake, agent, store, _ = env
        store.put_bytes("jobs/j-env/attempts/r-env-0/checkpoints/step-9/state.txt", b"step 9")
        resume_uri = store.uri("jobs/j-env/attempts/r-env-0/checkpoints")

        resp = agent.assign(
            run_id="r-env-1",
            job_id="j-env",
            reservation_id="res-env",
            token=7,
            attempt=2,
            gpu_ids=[1, 3],
            command=python_cmd(JOB_ENV_SCRIPT),
            env={"FOO": "bar", "CUDA_VISIBLE_DEVICES": "0,1,2,3"},  # cannot widen the pinning
            resume_from_uri=resume_uri,
        )

        assert resp.result == A.STARTED, resp.message
        report = fake.wait_report("r-env-1")
        assert (report.outcome, report.exit_code, report.token) == (R.EXITED, 0, 7)
        confirm = next(c for c in fake.confirms if c.run_id == "r-env-1")
        assert (confirm.reservation_id, confirm.token) == ("res-env", 7)
        order = [c for c in fake.calls if c[1] == "r-env-1"]
        assert order.index(("confirm", "r-env-1")) < order.index(("report", "r-env-1"))

        manifest = Manifest.from_json(store.get_bytes(store.key_of(report.manifest_uri)))
        assert (manifest.run_id, manifest.token, manifest.outcome) == ("r-env-1", 7, "EXITED")
        by_path = {(f.kind, f.path): f for f in manifest.files}
        assert set(by_path) == {
            ("log", "output.log"),
            ("artifact", "env.json"),
            ("artifact", "sub/metrics.csv"),
            ("checkpoint", "step-10/model.bin"),
        }
        for f in manifest.files:
            assert f.key.startswith("jobs/j-env/attempts/r-env-1/")
            assert store.sha256(f.key) == f.sha256
            assert store.size(f.key) == f.size
        assert manifest.checkpoint_prefix() == "jobs/j-env/attempts/r-env-1/checkpoints"

        seen = json.loads(store.get_bytes(by_path["artifact", "env.json"].key))
        assert seen["CUDA_VISIBLE_DEVICES"] == "1,3"
        assert seen["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        assert (seen["GPUFLEET_JOB_ID"], seen["GPUFLEET_RUN_ID"]) == ("j-env", "r-env-1")
        attempt, token = seen["GPUFLEET_ATTEMPT"], seen["GPUFLEET_FENCING_TOKEN"]
        assert (attempt, token, seen["FOO"]) == ("2", "7", "bar")
        assert seen["GPUFLEET_CHECKPOINT_DIR"].endswith("/r-env-1/checkpoints")
        assert seen["GPUFLEET_ARTIFACTS_DIR"].endswith("/r-env-1/artifacts")
        assert seen["checkpoint_dir_empty_at_start"] is True
        assert seen["resumed"] == "step 9"
        assert b"hello from the job" in store.get_bytes(by_path["log", "output.log"].key)

    def test_registers_declared_inventory_and_heartbeats(self, env) -> None:
        fake, _agent, _, _ = env
        reg = fake.registrations[0]
        assert reg.node_id == "node-test"
        assert reg.agent_epoch == 1
        labels = dict(reg.labels)
        assert labels.pop("gpufleet/containment") in ("cgroup-v1", "cgroup-v2", "pidns", "none")
        assert labels.pop("gpufleet/job-user")
        assert labels.pop("gpufleet/container-runtime") in ("podman", "docker", "none")
        assert labels.pop("gpufleet/job-isolation")
        assert labels.pop("gpufleet/job-pids-max")
        assert labels.pop("gpufleet/job-disk-mb")
        assert labels.pop("gpufleet/job-network") in ("netns", "host")
        assert labels == {"rack": "r1"}
        assert reg.cpu >= 1
        assert reg.memory_mb > 0
        if reg.inventory_source == "declared":  # a machine with NVML registers its real GPUs
            assert [(g.index, g.gpu_type, g.memory_mb) for g in reg.gpus] == [
                (i, "A100", 40960) for i in range(4)
            ]
            assert reg.gpus[2].uuid == "declared-node-test-2"
        fake.wait_for(lambda: len(fake.heartbeats) >= 2)
        assert fake.heartbeats[-1].health == "HEALTHY"

    def test_reregisters_when_the_controller_asks(self, env) -> None:
        fake, agent, _, _ = env
        before = len(fake.registrations)
        with fake.cond:
            fake.reregister_once = True
        reg = fake.wait_for(lambda: fake.registrations[before:])[0]
        assert (reg.address, reg.agent_epoch) == (agent.address, 1)

    @pytest.mark.parametrize(
        ("code", "want_exit_code"),
        [
            pytest.param("import sys; sys.exit(3)", 3, id="non-zero exit is reported as is"),
            pytest.param(
                "import os, signal; os.kill(os.getpid(), signal.SIGUSR1)",
                -signal.SIGUSR1,
                id="death by signal is a negative exit code",
            ),
        ],
    )
    def test_exit_code_is_reported(self, env, code: str, want_exit_code: int) -> None:
        fake, agent, _, _ = env
        run_id = f"r-exit{want_exit_code}"
        resp = agent.assign(
            run_id=run_id, job_id=f"j-exit{want_exit_code}", token=1, command=python_cmd(code)
        )
        assert resp.result == A.STARTED
        report = fake.wait_report(run_id)
        assert (report.outcome, report.exit_code) == (R.EXITED, want_exit_code)


class TestStartOnce:
    def test_assign_twice_starts_once(self, env) -> None:
        fake, agent, _, tmp = env
        starts, go = tmp / "starts-once.txt", tmp / "go-once"
        code = (
            f"import os, time; open({str(starts)!r}, 'a').write('start\\n')\n"
            f"while not os.path.exists({str(go)!r}): time.sleep(0.02)"
        )
        req = {"run_id": "r-twice", "job_id": "j-twice", "token": 3, "command": python_cmd(code)}

        first, second = agent.assign(**req), agent.assign(**req)
        go.touch()
        fake.wait_report("r-twice")
        third = agent.assign(**req)

        assert (first.result, second.result, third.result) == (
            A.STARTED,
            A.ALREADY_RUNNING,
            A.ALREADY_EXITED,
        )
        assert first.pid == second.pid > 0
        assert starts.read_text() == "start\n"
        assert len(fake.reports_for("r-twice")) == 1

    @pytest.mark.parametrize(
        ("first", "second", "want"),
        [
            pytest.param(
                {"run_id": "r-tok-a", "token": 5},
                {"run_id": "r-tok-b", "token": 4},
                A.REJECTED_STALE,
                id="older token for the same job is stale",
            ),
            pytest.param(
                {"run_id": "r-tok-c", "token": 5},
                {"run_id": "r-tok-c", "token": 4},
                A.REJECTED_STALE,
                id="older token for the same run is stale",
            ),
            pytest.param(
                {"run_id": "r-tok-d", "token": 5},
                {"run_id": "r-tok-e", "token": 6},
                A.STARTED,
                id="newer token for the same job starts",
            ),
            pytest.param(
                {"run_id": "r-tok-f", "token": 5},
                {"run_id": "r-tok-g", "token": 6, "leader_epoch": 0},
                A.REJECTED_STALE,
                id="older leader epoch is stale",
            ),
        ],
    )
    def test_stale_assignments_are_rejected(self, env, first, second, want) -> None:
        _fake, agent, _, _ = env
        job_id = f"j-{first['run_id']}"
        assert agent.assign(job_id=job_id, command=["true"], **first).result == A.STARTED
        resp = agent.assign(job_id=job_id, command=["true"], **second)
        assert resp.result == want, resp.message

    @pytest.mark.parametrize(
        ("run_id", "command", "gpu_ids", "want_message"),
        [
            pytest.param(
                "r-fail-nf", ["/nonexistent/train"], [], "No such file", id="command not found"
            ),
            pytest.param("r-fail-empty", [], [], "empty command", id="empty command"),
            pytest.param(
                "r-fail-gpu", ["true"], [9], "GPU 9 is not on this node", id="GPU not on the node"
            ),
        ],
    )
    def test_failed_start_is_reported_never_started(
        self, env, run_id, command, gpu_ids, want_message
    ):
        fake, agent, _, _ = env
        resp = agent.assign(
            run_id=run_id,
            job_id=f"j-{run_id}",
            token=1,
            command=command,
            gpu_ids=gpu_ids,
        )
        assert resp.result == A.FAILED_TO_START
        assert want_message in resp.message
        report = fake.wait_report(run_id)
        assert report.outcome == R.NEVER_STARTED
        assert report.manifest_uri == ""
        assert want_message in report.message
        assert (
            agent.assign(run_id=run_id, job_id=f"j-{run_id}", token=1, command=command).result
            == A.FAILED_TO_START
        )

    def test_gpu_held_by_a_live_run_is_not_given_twice(self, env) -> None:
        fake, agent, _, _ = env
        sleeper = python_cmd("import time; time.sleep(30)")
        assert (
            agent.assign(
                run_id="r-gpu-a", job_id="j-gpu-a", token=1, gpu_ids=[2], command=sleeper
            ).result
            == A.STARTED
        )
        resp = agent.assign(
            run_id="r-gpu-b", job_id="j-gpu-b", token=1, gpu_ids=[2], command=["true"]
        )
        assert resp.result == A.FAILED_TO_START
        assert "held by live run r-gpu-a" in resp.message
        agent.stop_run(run_id="r-gpu-a", token=1, grace_s=0.1, reason="cancel")
        fake.wait_report("r-gpu-a")


STUBBORN_JOB = r"""
import os, pathlib, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, lambda *a: print("got SIGTERM, ignoring it", flush=True))
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"])
pathlib.Path(sys.argv[1]).write_text(f"{os.getpgid(0)} {child.pid}")
print("ready", flush=True)
while True:
    time.sleep(0.05)
"""


CHECKPOINTING_JOB = r"""
import os, pathlib, sys, time
ckpt = pathlib.Path(os.environ["GPUFLEET_CHECKPOINT_DIR"])
marker = pathlib.Path(sys.argv[1])
marker.write_text("started")  # nothing written yet
while not marker.with_suffix(".go").exists():  # until the test saw a heartbeat without one
    time.sleep(0.05)
(ckpt / "step-1").mkdir()
(ckpt / "step-1" / "model.bin").write_bytes(b"weights")
os.utime(ckpt / "step-1" / "model.bin", (1_700_000_000.5, 1_700_000_000.5))
while True:
    time.sleep(0.05)
"""


class TestCheckpointReports:
    def test_heartbeats_carry_the_newest_checkpoint_file_time(self, env) -> None:
        fake, agent, _, tmp = env
        marker = tmp / "checkpointing.txt"
        resp = agent.assign(
            run_id="r-ckpt",
            job_id="j-ckpt",
            token=3,
            gpu_ids=[2],
            command=[*python_cmd(CHECKPOINTING_JOB), str(marker)],
        )
        assert resp.result == A.STARTED
        wait_until(marker.exists)

        def reported() -> list[float]:
            return [
                r.last_checkpoint_unix
                for h in fake.heartbeats
                for r in h.running
                if r.run_id == "r-ckpt" and r.state == "RUNNING"
            ]

        fake.wait_for(reported)
        assert reported()[0] == 0.0  # nothing written yet: none
        marker.with_suffix(".go").touch()
        fake.wait_for(lambda: 1_700_000_000.5 in reported())
        stop = agent.stop_run(run_id="r-ckpt", token=3, grace_s=5.0, reason="preempt")
        assert stop.result == S.STOPPING
        assert fake.wait_report("r-ckpt").outcome == R.STOPPED


class TestStop:
    def test_sigterm_ignored_then_sigkill_and_group_verified_gone_before_report(self, env):
        fake, agent, store, tmp = env
        marker = tmp / "stubborn.txt"
        fake.on_report = lambda req: (
            live_group_members(int(marker.read_text().split()[0]))
            if req.run_id == "r-stubborn"
            else None
        )
        resp = agent.assign(
            run_id="r-stubborn",
            job_id="j-stubborn",
            token=4,
            gpu_ids=[0],
            command=[*python_cmd(STUBBORN_JOB), str(marker)],
        )
        assert resp.result == A.STARTED
        wait_until(marker.exists)
        pgid, grandchild = map(int, marker.read_text().split())
        log_key = "jobs/j-stubborn/attempts/r-stubborn/logs/output.log"
        wait_until(lambda: store.exists(log_key) and b"ready" in store.get_bytes(log_key))
        fake.wait_for(
            lambda: any(
                r.run_id == "r-stubborn" and r.state == "RUNNING"
                for r in fake.heartbeats[-1].running
            )
        )

        stop = agent.stop_run(run_id="r-stubborn", token=4, grace_s=0.5, reason="preempt")

        assert stop.result == S.STOPPING
        fake.wait_for(
            lambda: any(
                r.run_id == "r-stubborn" and r.state == "STOPPING"
                for r in fake.heartbeats[-1].running
            )
        )
        report = fake.wait_report("r-stubborn")
        assert fake.observed_at_report["r-stubborn"] == [], "processes alive at report time"
        assert (report.outcome, report.exit_code) == (R.STOPPED, -signal.SIGKILL)
        assert "SIGKILL" in report.message
        assert not pid_alive(grandchild)
        assert pgid != resp.pid  # the shim leads the group; the job is its child
        manifest = Manifest.from_json(store.get_bytes(store.key_of(report.manifest_uri)))
        assert (manifest.outcome, manifest.stop_reason) == ("STOPPED", "preempt")
        assert b"got SIGTERM, ignoring it" in store.get_bytes(log_key)
        assert agent.stop_run(run_id="r-stubborn", token=4).result == S.ALREADY_EXITED

    def test_job_that_exits_on_sigterm_keeps_its_exit_code(self, env) -> None:
        fake, agent, _, _ = env
        code = (
            "import signal, sys, time\n"
            "signal.signal(signal.SIGTERM, lambda *a: sys.exit(42))\n"
            "print('ready', flush=True)\ntime.sleep(30)"
        )
        assert (
            agent.assign(
                run_id="r-polite", job_id="j-polite", token=1, command=python_cmd(code)
            ).result
            == A.STARTED
        )
        log = agent.state_dir / "runs/r-polite/output.log"
        wait_until(lambda: log.exists() and b"ready" in log.read_bytes())
        assert agent.stop_run(run_id="r-polite", token=1, grace_s=10, reason="cancel").result == (
            S.STOPPING
        )
        report = fake.wait_report("r-polite")
        assert (report.outcome, report.exit_code) == (R.STOPPED, 42)

    def test_stop_from_heartbeat_answer(self, env) -> None:
        fake, agent, _, _ = env
        assert (
            agent.assign(
                run_id="r-hb",
                job_id="j-hb",
                token=2,
                command=python_cmd("import time; time.sleep(30)"),
            ).result
            == A.STARTED
        )
        with fake.cond:
            fake.pending_stops.append(
                pb.StopRunRequest(run_id="r-hb", token=2, grace_s=0.2, reason="cancel")
            )
        report = fake.wait_report("r-hb")
        assert (report.outcome, report.exit_code) == (R.STOPPED, -signal.SIGTERM)

    def test_rejected_confirmation_stops_the_attempt(self, env) -> None:
        fake, agent, _, _ = env
        fake.confirm_results["r-rej"] = pb.ConfirmAssignmentResponse.REJECTED
        assert (
            agent.assign(
                run_id="r-rej",
                job_id="j-rej",
                token=2,
                command=python_cmd("import time; time.sleep(30)"),
            ).result
            == A.STARTED
        )
        report = fake.wait_report("r-rej")
        assert report.outcome == R.STOPPED
        manifest_key = "jobs/j-rej/attempts/r-rej/MANIFEST.json"
        assert json.loads(env[2].get_bytes(manifest_key))["stop_reason"] == "stale"

    def test_stop_before_assign_leaves_a_tombstone(self, env) -> None:
        _fake, agent, _, _ = env
        assert agent.stop_run(run_id="r-late", token=1, reason="cancel").result == S.NOT_FOUND
        resp = agent.assign(run_id="r-late", job_id="j-late", token=1, command=["true"])
        assert resp.result == A.REJECTED_STALE

    def test_stale_leader_cannot_stop(self, env) -> None:
        _fake, agent, _, _ = env
        assert (
            agent.assign(
                run_id="r-keep",
                job_id="j-keep",
                token=1,
                command=python_cmd("import time; time.sleep(30)"),
            ).result
            == A.STARTED
        )
        resp = agent.stop_run(run_id="r-keep", token=1, leader_epoch=0, reason="cancel")
        assert resp.result == S.REJECTED_STALE
        runs = {r.run_id: r for r in agent.stub.ListRuns(pb.ListRunsRequest()).runs}
        assert runs["r-keep"].state == "RUNNING"
        assert agent.stop_run(run_id="r-keep", token=1, grace_s=0.1).result == S.STOPPING


def test_list_runs_shows_unreported_attempts_only(env) -> None:
    fake, agent, _, _ = env
    assert (
        agent.assign(run_id="r-list-done", job_id="j-list-done", token=1, command=["true"]).result
        == A.STARTED
    )
    assert (
        agent.assign(
            run_id="r-list-live",
            job_id="j-list-live",
            token=1,
            command=python_cmd("import time; time.sleep(30)"),
        ).result
        == A.STARTED
    )
    fake.wait_report("r-list-done")

    def states() -> dict[str, str]:
        resp = agent.stub.ListRuns(pb.ListRunsRequest())
        assert resp.agent_epoch == 1
        return {r.run_id: r.state for r in resp.runs}

    wait_until(lambda: "r-list-done" not in states())  # once the report was answered
    assert states()["r-list-live"] == "RUNNING"
    agent.stop_run(run_id="r-list-live", token=1, grace_s=0.1)
    fake.wait_report("r-list-live")
    assert not (agent.state_dir / "runs/r-list-done/artifacts").exists(), "cleaned up"
