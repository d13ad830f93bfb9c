"""Redis is a hint, against real processes and the real Redis: a poisoned rate-limit bucket
does not lock a team out, each deployment's keys and channels live under its own prefix, a
hung Redis (accepts, never answers) costs a submit one short timeout once and logs once, and
a controller and a server start and work with Redis on a closed port or refusing the
password."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import redis

from gpufleet.processes import open_database
from gpufleet.services import auth
from gpufleet.settings import Settings
from tests.conftest import REDIS_URL
from tests.integration.server_proc import ServerProcess
from tests.ports import free_port, free_port_pair

pytestmark = [pytest.mark.slow, pytest.mark.redis]

JOB = {"command": ["python3", "train.py"], "gpu_count": 1}


def admin_token(data_dir: Path) -> str:
    db = open_database(Settings(data_dir=data_dir))
    token = db.run_write(
        lambda s: auth.create_token(s, "ops", is_admin=True, create_team_if_missing=True)
    )
    db.dispose()
    return token


def submit(url: str, token: str) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = httpx.post(
        f"{url}/v1/jobs",
        json=JOB,
        headers={"Authorization": f"Bearer {token}", "Idempotency-Key": str(uuid.uuid4())},
        timeout=30,
    )
    return r, time.monotonic() - t0


class HungRedis:
    """A TCP server on loopback that accepts connections and never answers (a hung Redis)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port = self.sock.getsockname()[1]
        self.held: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.held.append(conn)

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        for c in self.held:
            c.close()


@pytest.fixture
def hung() -> Iterator[HungRedis]:
    h = HungRedis()
    try:
        yield h
    finally:
        h.close()


def test_a_poisoned_bucket_does_not_lock_a_team_out(tmp_path: Path) -> None:
    prefix = f"gftest-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(REDIS_URL)
    future = time.time() + 1e7
    for bucket in ("submit:ops", "read:ops"):
        # what a job that reached Redis once wrote: an empty bucket dated far in the future
        r.hset(f"{prefix}:rate:{bucket}", mapping={"tokens": "-1e9", "ts": str(future)})
    r.hset(f"{prefix}:rate:submit:other", mapping={"tokens": "nan", "ts": "inf"})
    token = admin_token(tmp_path)
    server = ServerProcess(
        tmp_path, {"GPUFLEET_REDIS_URL": REDIS_URL, "GPUFLEET_REDIS_PREFIX": prefix}
    ).start()
    try:
        resp, _ = submit(server.url, token)
        assert resp.status_code == 201, resp.text
        listed = httpx.get(
            f"{server.url}/v1/jobs", headers={"Authorization": f"Bearer {token}"}, timeout=10
        )
        assert listed.status_code == 200, listed.text
        # the bucket was repaired in place, under this deployment's prefix only
        tokens = float(r.hget(f"{prefix}:rate:submit:ops", "tokens") or b"nan")
        assert 0 <= tokens <= Settings().team_submit_burst
        assert float(r.hget(f"{prefix}:rate:submit:ops", "ts") or b"inf") < future
        assert not r.exists("gpufleet:rate:submit:ops") or prefix == "gpufleet"
    finally:
        server.stop()
        for key in r.scan_iter(f"{prefix}:*"):
            r.delete(key)


def test_wake_ups_stay_inside_their_deployment() -> None:
    from gpufleet.queue import RedisWaker

    mine = RedisWaker(REDIS_URL, listen=True, prefix=f"gftest-a-{uuid.uuid4().hex[:6]}")
    theirs = RedisWaker(REDIS_URL, listen=True, prefix=f"gftest-b-{uuid.uuid4().hex[:6]}")
    try:
        time.sleep(0.5)  # both subscribed
        mine.wait(0.01), theirs.wait(0.01)
        code = (
            "from gpufleet.queue import RedisWaker; import sys;"
            f" w = RedisWaker({REDIS_URL!r}, listen=False, prefix=sys.argv[1]); w.wake()"
        )
        subprocess.run([sys.executable, "-c", code, mine.channel[: -len(":wake")]], check=True)
        assert mine.wait(5.0) is True
        assert theirs.wait(1.0) is False
    finally:
        mine.close()
        theirs.close()


def test_a_hung_redis_costs_one_short_timeout_and_one_log_line(
    tmp_path: Path, hung: HungRedis
) -> None:
    token = admin_token(tmp_path)
    server = ServerProcess(
        tmp_path, {"GPUFLEET_REDIS_URL": f"redis://127.0.0.1:{hung.port}/0"}
    ).start()
    try:
        took = []
        for _ in range(20):
            resp, seconds = submit(server.url, token)
            assert resp.status_code == 201, resp.text
            took.append(seconds)
        print("submit seconds with a hung Redis:", [round(t, 3) for t in took])
        # one timeout (0.25 s) on the first; the breaker skips Redis for the others
        assert took[0] < 1.0 and max(took[1:]) < 0.5, took
        outage_lines = [ln for ln in server.log().splitlines() if "unreachable" in ln]
        assert len(outage_lines) == 1, outage_lines
        assert "Traceback" not in server.log()
    finally:
        server.stop()


@pytest.mark.parametrize(
    "redis_url",
    [
        pytest.param("closed", id="closed port"),
        pytest.param(
            REDIS_URL.replace("redis://", "redis://no-such-user:wrong-password@"), id="bad auth"
        ),
    ],
)
def test_controller_and_server_start_and_work_without_redis(
    tmp_path: Path, redis_url: str
) -> None:
    if redis_url == "closed":
        redis_url = f"redis://127.0.0.1:{free_port()}/0"
    token = admin_token(tmp_path)
    port = free_port_pair()
    env = {
        **os.environ,
        "GPUFLEET_DATA_DIR": str(tmp_path),
        "GPUFLEET_REDIS_URL": redis_url,
        "GPUFLEET_CONTROLLER_ADDRESS": f"127.0.0.1:{port}",
        "GPUFLEET_SCHEDULER_TICK_S": "0.5",
    }
    ctl_log = tmp_path / "controller.log"
    gpufleet = Path(sys.executable).parent / "gpufleet"
    ctl = subprocess.Popen(
        [str(gpufleet), "controller", "--insecure"],
        env=env,
        stdout=open(ctl_log, "ab"),  # noqa: SIM115 - owned by the child
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    server = ServerProcess(tmp_path, {"GPUFLEET_REDIS_URL": redis_url}).start()
    try:
        resp, _ = submit(server.url, token)
        assert resp.status_code == 201, resp.text
        job_id = resp.json()["job_id"]
        # the controller's scheduler (by tick, no wake-ups) looks at the job: it gets a reason
        deadline = time.monotonic() + 60
        while True:
            job = httpx.get(
                f"{server.url}/v1/jobs/{job_id}",
                headers={"Authorization": f"Bearer {token}"},
                timeout=10,
            ).json()
            if job.get("pending_reason"):
                break
            assert ctl.poll() is None, ctl_log.read_text()[-3000:]
            assert time.monotonic() < deadline, ctl_log.read_text()[-3000:]
            time.sleep(0.5)
        assert ctl.poll() is None
        text = ctl_log.read_text()
        assert "Traceback" not in text and "Traceback" not in server.log(), text[-3000:]
        assert "wake listener" in text  # the one line that says why wake-ups are off
    finally:
        server.stop()
        ctl.terminate()
        try:
            ctl.wait(timeout=15)
        except subprocess.TimeoutExpired:
            ctl.kill()
            ctl.wait()


def test_up_runs_a_job_with_redis_on_a_closed_port(tmp_path: Path) -> None:
    """``gpufleet up`` (controller, API and a local agent) with Redis unreachable: it starts,
    and a submitted job runs to SUCCEEDED (the scheduler by its tick)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_") or k == "PATH"}
    env |= {
        "GPUFLEET_DATA_DIR": str(tmp_path),
        "GPUFLEET_HEARTBEAT_INTERVAL_S": "1",
        "GPUFLEET_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
    }
    api, ctl = free_port_pair(), free_port_pair()
    out = tmp_path / "up.out"
    with open(out, "wb") as so:
        up = subprocess.Popen(
            [sys.executable, "-m", "gpufleet.cli.main", "up", "--port", str(api),
             "--controller-port", str(ctl), "--job-uids", "agent"],
            env=env, stdout=so, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while "gpufleet is up" not in out.read_text():
            assert up.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.3)
        done = subprocess.run(
            [sys.executable, "-m", "gpufleet.cli.main", "submit", "--gpus", "1", "--wait",
             "--", "python3", "-c", "print('ran without redis')"],
            env=env, text=True, capture_output=True, timeout=120, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stdout + done.stderr
        assert "Traceback" not in out.read_text()
    finally:
        up.terminate()
        try:
            up.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait()
