"""A stopping agent does not wait on a controller that never answers.

The controller here is a TCP listener that accepts connections and never says a word (a hung
controller process, or a partition behind a proxy that still accepts): the agent's
RegisterNode call then sits in gRPC's connection handshake until its 10 s deadline. Once an
agent in a scenario test outlived the harness's 10 s after SIGTERM that way under load; a stop
now waits at most ``STOP_THREADS_S`` for such a thread after the gRPC server's 1 s grace.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from gpufleet.agent.main import STOP_THREADS_S
from gpufleet.agent.service import CALL_TIMEOUT_S

pytestmark = pytest.mark.slow


def test_sigterm_stops_an_agent_whose_controller_never_answers(tmp_path: Path) -> None:
    mute = socket.socket()
    mute.bind(("127.0.0.1", 0))
    mute.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:  # accept and hold every connection, never write
        while True:
            try:
                conn, _ = mute.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    log = tmp_path / "agent.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    env["GPUFLEET_DATA_DIR"] = str(tmp_path)
    cmd = [sys.executable, "-m", "gpufleet.cli.main", "agent", "--node-id", "mute-1"]
    cmd += ["--gpus", "1xH100-80GB", "--state-dir", str(tmp_path / "state"), "--insecure"]
    cmd += ["--controller", f"127.0.0.1:{mute.getsockname()[1]}", "--job-uids", "agent"]
    with open(log, "wb") as out:
        agent = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "serving on" not in log.read_text():
            assert agent.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        time.sleep(0.5)  # RegisterNode is now waiting on the mute controller
        assert held, "the agent never connected to the controller"
        agent.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        # the stuck call alone would hold it CALL_TIMEOUT_S (10 s); the bound is grace + 4 s
        assert agent.wait(timeout=CALL_TIMEOUT_S + 20) == 0, log.read_text()
        took = time.monotonic() - stopped
        # the call either still hangs (the stop waits STOP_THREADS_S for it and says
        # "agent-heartbeat still busy") or has already failed on the channel's 2 s connect
        # timeout (rpc.channel_options): either way the stop is bounded
        assert took < CALL_TIMEOUT_S, f"stop took {took:.1f} s (bound {1 + STOP_THREADS_S} s)"
    finally:
        if agent.poll() is None:
            agent.kill()
        mute.close()
        for c in held:
            c.close()
