"""The user-facing commands against a real platform, and the README's first command."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.harness import Fleet
from tests.ports import free_port_pair

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def cli(
    fleet: Fleet, *args: str, team: str = "vision", timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        GPUFLEET_URL=fleet.api.url,
        GPUFLEET_TOKEN=fleet.tokens[team],
        GPUFLEET_CONFIG=str(fleet.tmp / "none.yaml"),
    )
    return subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", *args],
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_submit_wait_logs_status_list_through_the_cli(fleet: Fleet) -> None:
    fleet.start_agent("a1")
    sub = cli(
        fleet,
        "submit",
        "--gpus",
        "2",
        "--name",
        "hello",
        "--wait",
        "--",
        sys.executable,
        "-c",
        "[print('line', i) for i in range(1500)];"
        "print('hello from', __import__('os').environ['CUDA_VISIBLE_DEVICES'])",
    )
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.strip().splitlines()[0]
    logs = cli(fleet, "logs", job_id)  # the last 1,000 lines by default
    assert logs.returncode == 0 and logs.stdout.splitlines()[-1] == "hello from 0,1"
    assert len(logs.stdout.splitlines()) == 1000
    whole = cli(fleet, "logs", job_id, "--all")
    assert whole.stdout.splitlines()[0] == "line 0" and len(whole.stdout.splitlines()) == 1501
    status = json.loads(cli(fleet, "status", job_id, "--output", "json").stdout)
    assert status["status"] == "SUCCEEDED" and status["attempts"][0]["gpu_ids"] == [0, 1]
    listed = cli(fleet, "list", "--output", "json")
    assert job_id in listed.stdout
    other = cli(fleet, "status", job_id, team="nlp")
    assert other.returncode == 2 and "Traceback" not in other.stderr


@pytest.mark.parametrize("fleet", ["sqlite"], indirect=True)
def test_why_explains_a_waiting_job_and_submit_rejects_what_never_fits(fleet: Fleet) -> None:
    fleet.start_agent("a1", gpus="2xA100-40GB")
    blocker = fleet.submit(
        {"command": [sys.executable, "-c", "import time; time.sleep(60)"], "gpu_count": 2}
    )
    fleet.wait_status(blocker, {"RUNNING"})
    waiting = fleet.submit({"command": ["true"], "gpu_count": 1})
    fleet.wait_for(
        lambda: fleet.job(waiting)["pending_reason"]["code"] != "queued", 10, "a scheduler reason"
    )
    why = cli(fleet, "why", waiting, "--output", "json")
    assert why.returncode == 0, why.stderr
    reason = json.loads(why.stdout)
    reason = reason.get("pending_reason", reason)
    assert reason["code"] != "queued" and reason["message"]
    assert fleet.job(waiting)["pending_reason"]["position"] == 1
    events = fleet.get(f"/v1/jobs/{waiting}/events")["items"]
    assert any(e["kind"] == "waiting" and e["details"]["code"] == reason["code"] for e in events)
    bad = cli(fleet, "submit", "--gpus", "4", "--", "true")
    assert bad.returncode == 2 and "gpu_count" in bad.stderr and "Traceback" not in bad.stderr
    assert cli(fleet, "cancel", blocker).returncode == 0
    assert fleet.wait_status(blocker, {"CANCELLED"})["status"] == "CANCELLED"
    assert fleet.wait_status(waiting, {"SUCCEEDED"})["status"] == "SUCCEEDED"


def test_readme_demo_command_passes(tmp_path: Path) -> None:
    """`gpufleet demo` (what `make demo` runs): all SUCCEEDED, manifests verified, logs shown."""
    done = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", "demo", "--data-dir", str(tmp_path)],
        cwd=REPO,
        text=True,
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "demo passed" in done.stdout
    assert done.stdout.count("SUCCEEDED  manifest: ok") == 6
    assert "final test_acc=" in done.stdout
    assert "0 violations" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1].startswith("dashboard: http://")
    # no terminal: progress as plain lines while it runs (a job's states, with its GPUs)
    assert re.search(r"digits-8gpu\s+RUNNING on \S+ GPUs \[0, 1, 2", done.stdout), done.stdout


def test_a_second_demo_refuses_and_deletes_nothing_of_a_running_one(tmp_path: Path) -> None:
    """Issue 24, item 14: a second `gpufleet demo` on the data dir of one still running
    (what a second `make demo` does) refuses, naming the running one's pid, exit 1, and
    deletes nothing: the first's database is the same file and its API still answers."""
    import signal

    import httpx

    out = tmp_path / "first.stdout"
    demo = [sys.executable, "-m", "gpufleet.cli.main", "demo", "--data-dir", str(tmp_path)]
    with open(out, "wb") as so:
        first = subprocess.Popen(demo, cwd=REPO, stdout=so, stderr=subprocess.STDOUT)
    try:
        _wait_for(lambda: "API http" in out.read_text() or first.poll() is not None, 60, "demo")
        assert first.poll() is None, out.read_text()[-3000:]
        url = re.search(r"API (http://\S+);", out.read_text())
        assert url is not None, out.read_text()
        db = tmp_path / "demo" / "gpufleet.db"
        inode = db.stat().st_ino
        second = subprocess.Popen(
            demo, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        try:
            _, err = second.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # it runs a demo of its own: stop its platform too
            second.send_signal(signal.SIGTERM)
            second.communicate(timeout=30)
            raise AssertionError("the second demo did not refuse") from None
        assert second.returncode == 1, err[-3000:]
        assert f"in use by gpufleet demo (pid {first.pid})" in err, err
        assert "nothing was deleted" in err and "Traceback" not in err
        assert db.stat().st_ino == inode  # not deleted and made again
        assert httpx.get(f"{url.group(1)}/healthz", timeout=10).status_code == 200
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)  # the demo stops its platform (agent included)
        first.wait(timeout=30)


def _up_env(data_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_") or k == "PATH"}
    env["GPUFLEET_DATA_DIR"] = str(data_dir)
    env["GPUFLEET_HEARTBEAT_INTERVAL_S"] = "1"
    # the README's `python3` is this interpreter (as in an activated venv)
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    return env


def _wait_for(cond: Any, timeout_s: float, what: str) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def test_readme_quickstart_up_submit_and_a_killed_agent_is_restarted(tmp_path: Path) -> None:
    """`gpufleet up` as the README's Quickstart runs it: the README's submit succeeds (as root
    with a Python job users cannot run, jobs run as the agent's user and `up` says so); a
    second `up` on the same ports and bad options are one clear line, exit 1/2; `kill -9` of
    the local agent is logged and the agent restarted, adopting the running job."""
    import signal

    from gpufleet.agent.main import state_dir_holder
    from gpufleet.agent.runtime.jobuser import executable_by_others

    env = _up_env(tmp_path)
    api, ctl = free_port_pair(), free_port_pair()
    stderr_path = tmp_path / "up.stderr"
    with open(tmp_path / "up.stdout", "wb") as so, open(stderr_path, "wb") as se:
        up = subprocess.Popen(
            [sys.executable, "-m", "gpufleet.cli.main", "up", "--port", str(api),
             "--controller-port", str(ctl)],
            cwd=REPO, env=env, stdout=so, stderr=se,
        )  # fmt: skip
    try:
        _wait_for(
            lambda: (
                "gpufleet is up" in (tmp_path / "up.stdout").read_text() or up.poll() is not None
            ),
            60,
            "gpufleet up",
        )
        assert up.poll() is None, stderr_path.read_text()[-3000:]
        expects_note = os.geteuid() == 0 and not executable_by_others(sys.executable)
        assert ("--job-uids agent" in stderr_path.read_text()) == expects_note

        def gpufleet(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "gpufleet.cli.main", *args],
                cwd=REPO, env=env, text=True, capture_output=True, timeout=timeout, check=False,
            )  # fmt: skip

        sub = gpufleet(
            "submit", "--gpus", "2", "--wait", "--", "python3", "examples/train_digits.py"
        )
        assert sub.returncode == 0, sub.stdout + sub.stderr
        job_id = sub.stdout.strip().splitlines()[0]
        logs = gpufleet("logs", job_id)
        assert "final test_acc=" in logs.stdout, logs.stdout[-2000:]

        # a second `up` on the same ports: one line naming the port and what to change
        again = subprocess.run(
            [sys.executable, "-m", "gpufleet.cli.main", "up", "--data-dir",
             str(tmp_path / "second"), "--port", str(api), "--controller-port", str(ctl)],
            env=env, text=True, capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        assert again.returncode == 1 and "Traceback" not in again.stderr
        assert f"127.0.0.1:{api}" in again.stderr and "--port" in again.stderr
        other = subprocess.run(
            [sys.executable, "-m", "gpufleet.cli.main", "up", "--data-dir",
             str(tmp_path / "third"), "--controller-port", str(ctl)],
            env={**env, "GPUFLEET_SERVER_PORT": str(free_port_pair())},
            text=True, capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        assert other.returncode == 1 and "Traceback" not in other.stderr
        assert f"127.0.0.1:{ctl}" in other.stderr and "GPUFLEET_CONTROLLER_ADDRESS" in other.stderr

        # kill -9 the local agent while a job runs: logged, restarted, the job adopted
        long = gpufleet(
            "submit", "--gpus", "1", "--", "python3", "-c",
            "import time; [print('tick', i, flush=True) or time.sleep(0.2) for i in range(50)]",
        )  # fmt: skip
        assert long.returncode == 0, long.stderr
        long_id = long.stdout.strip().splitlines()[0]
        _wait_for(
            lambda: "tick 3" in gpufleet("logs", long_id).stdout, 60, "the job to be running"
        )
        state_dir = tmp_path / "agents" / "local-0"
        old = state_dir_holder(state_dir)
        assert old is not None
        os.kill(old, signal.SIGKILL)
        _wait_for(lambda: state_dir_holder(state_dir) not in (None, old), 60, "a restarted agent")
        assert "exited (exit code -9); restarting" in stderr_path.read_text()
        _wait_for(
            lambda: (
                json.loads(gpufleet("status", long_id, "--output", "json").stdout)["status"]
                in {"SUCCEEDED", "FAILED", "CANCELLED"}
            ),
            120,
            "the adopted job to end",
        )
        status = json.loads(gpufleet("status", long_id, "--output", "json").stdout)
        assert status["status"] == "SUCCEEDED" and len(status["attempts"]) == 1, status
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(timeout=60)
    assert up.returncode == 0
    assert state_dir_holder(tmp_path / "agents" / "local-0") is None  # no agent left behind
    # the node row of this `up` is no sign of life for the next one, whose agent dies at once
    # (its labels, read by the agent alone, are bad)
    dead = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", "up",
         "--port", str(free_port_pair()), "--controller-port", str(free_port_pair())],
        env={**env, "GPUFLEET_AGENT_LABELS": "rack"}, text=True, capture_output=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert dead.returncode == 1 and "did not register" in dead.stderr, dead.stdout + dead.stderr


def test_an_agent_reused_after_up_was_killed_hard_is_stopped_with_the_next_up(
    tmp_path: Path,
) -> None:
    """`kill -9` of `gpufleet up` leaves its agent running (it keeps the jobs); the next `up`
    on the same data dir reuses that agent, and stopping this `up` (Ctrl-C, SIGTERM) stops
    it too, as it stops an agent it started: no agent is left behind. With a --data-dir the
    shell's GPUFLEET_DATA_DIR does not name, `up` says how other shells find its config."""
    import signal

    from gpufleet.agent.main import state_dir_holder

    env = _up_env(tmp_path)
    data = tmp_path / "elsewhere"
    api, ctl = free_port_pair(), free_port_pair()
    state_dir = data / "agents" / "local-0"
    cmd = [sys.executable, "-m", "gpufleet.cli.main", "up", "--data-dir", str(data),
           "--port", str(api), "--controller-port", str(ctl)]  # fmt: skip
    started: list[subprocess.Popen[bytes]] = []  # stopped in the end whatever the outcome

    def start(name: str) -> subprocess.Popen[bytes]:
        out, err = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        with open(out, "wb") as so, open(err, "wb") as se:
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=so, stderr=se)
        started.append(proc)
        _wait_for(
            lambda: (
                "gpufleet is up" in (tmp_path / f"{name}.out").read_text()
                or proc.poll() is not None
            ),
            60,
            f"gpufleet up ({name})",
        )
        assert proc.poll() is None, (tmp_path / f"{name}.err").read_text()[-3000:]
        return proc

    try:
        first = start("first")
        agent = state_dir_holder(state_dir)
        assert agent is not None and agent > 0
        first.kill()
        first.wait(timeout=30)
        assert state_dir_holder(state_dir) == agent  # the agent outlived `up`
        second = start("second")
        assert "reusing it" in (tmp_path / "second.err").read_text()
        hint = f"export GPUFLEET_CONFIG={data / 'client.yaml'}"
        assert hint in (tmp_path / "second.out").read_text()
        listed = subprocess.run(
            [sys.executable, "-m", "gpufleet.cli.main", "list"],
            env={**env, "GPUFLEET_CONFIG": str(data / "client.yaml")},
            text=True, capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        assert listed.returncode == 0, listed.stderr
        assert state_dir_holder(state_dir) == agent
        second.send_signal(signal.SIGINT)
        assert second.wait(timeout=60) == 0, (tmp_path / "second.err").read_text()[-3000:]
        assert state_dir_holder(state_dir) is None  # the reused agent was stopped too
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
        left = state_dir_holder(state_dir)
        if left is not None and left > 0:
            os.kill(left, signal.SIGKILL)


def test_up_reports_an_agent_that_dies_at_once_and_refuses_bad_options(tmp_path: Path) -> None:
    env = _up_env(tmp_path)
    # an agent that dies at once: its labels (GPUFLEET_AGENT_LABELS, read by the agent alone)
    dead = subprocess.run(
        [sys.executable, "-m", "gpufleet.cli.main", "up",
         "--port", str(free_port_pair()), "--controller-port", str(free_port_pair())],
        env={**env, "GPUFLEET_AGENT_LABELS": "rack"}, text=True, capture_output=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert dead.returncode == 1, dead.stdout + dead.stderr
    assert "gpufleet is up" not in dead.stdout
    assert "did not register" in dead.stderr and "label 'rack': use key=value" in dead.stderr
    for args, word in (
        (["--gpus", "bogus"], "--gpus"),  # checked before anything starts
        (["--port", "99999"], "--port"),
        (["--port", "-1"], "--port"),
        (["--controller-port", "0"], "--controller-port"),
        (["--job-uids", "nope"], "--job-uids"),
    ):
        bad = subprocess.run(
            [sys.executable, "-m", "gpufleet.cli.main", "up", *args],
            env=env, text=True, capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        assert bad.returncode == 2 and word in bad.stderr, (args, bad.stderr)
        assert "Traceback" not in bad.stderr


def test_a_demo_stops_the_agent_a_killed_demo_left_before_it_empties_the_dir(
    tmp_path: Path,
) -> None:
    """A demo killed with SIGKILL leaves its agent running, holding files in the demo's data
    dir; the next demo deleted them from under it (the agent went on with deleted files,
    retrying a dead controller for ever). The demo now stops such an agent first. Replayed with
    a real agent process on the demo's state dir (its controller gone, as after the kill)."""
    import time

    from gpufleet.agent.main import state_dir_holder
    from gpufleet.cli.demo import _stop_left_agents

    state = tmp_path / "demo" / "agents" / "local-0"
    state.mkdir(parents=True)
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpufleet.cli.main",
            "agent",
            "--insecure",
            "--controller",
            "127.0.0.1:1",  # the killed demo's controller: nothing answers
            "--node-id",
            "local-0",
            "--gpus",
            "1xH100-80GB",
            "--state-dir",
            str(state),
            "--job-uids",
            "agent",
        ],
        env={**os.environ, "GPUFLEET_DATA_DIR": str(tmp_path)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while state_dir_holder(state) != agent.pid and time.monotonic() < deadline:
            time.sleep(0.2)
        assert state_dir_holder(state) == agent.pid
        assert _stop_left_agents(tmp_path / "demo") == []
        assert agent.wait(timeout=5) is not None  # stopped (SIGTERM), so the dir may go
        assert state_dir_holder(state) is None
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
