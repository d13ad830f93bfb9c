"""A node whose clock is wrong is told so (issue 24, item 13).

Real processes: one ``gpufleet controller`` and ``gpufleet agent`` processes with mutual TLS,
the agents run under libfaketime. a1's clock is 10 min behind: the controller's certificate
(issued now, valid from 5 min ago) is "not yet valid" by a1's clock, so every TLS handshake
fails; gRPC answers UNAVAILABLE, as for a controller that is down, and a1 must say that the
clock or the certificate's validity is the problem, not "not reachable yet". a2's clock is
2 min behind (within the certificates' 5 min backdating): it registers, and the controller
warns about its skew.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.e2e.liveness_harness import Plane

LIBFAKETIME = next(iter(sorted(Path("/usr/lib").glob("*/faketime/libfaketime.so.1"))), None)
"""The library itself, preloaded into the agent (not the ``faketime`` wrapper, which forks:
a SIGTERM to the wrapper left the agents running after the test)."""

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        shutil.which("faketime") is None or LIBFAKETIME is None, reason="faketime not installed"
    ),
]

# libfaketime 0.9.10 + Python 3.11: with a faked CLOCK_MONOTONIC, timed lock waits hang
# (their absolute deadline is on the real monotonic clock), so it is left real
# (FAKETIME_DONT_FAKE_MONOTONIC); then its clock_nanosleep(TIMER_ABSTIME) wrapper answers
# EINVAL, so time.sleep is given a select()-based body in the agent's processes.
SLEEP_SHIM = """\
import select
import time


def _sleep(seconds):
    if seconds > 0:
        select.select([], [], [], seconds)


time.sleep = _sleep
"""


def _skewed(tmp: Path, offset: str) -> tuple[tuple[str, ...], dict[str, str]]:
    shim = tmp / "faketime-site"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(SLEEP_SHIM)
    env = {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": str(shim),
    }
    return (), env


def test_an_agent_10_minutes_behind_names_the_clock_not_the_network(tmp_path: Path) -> None:
    p = Plane(tmp_path, None, controllers=1, timings={"GPUFLEET_HEARTBEAT_INTERVAL_S": "1"})
    try:
        p.start_controllers()
        wrap, env = _skewed(tmp_path, "-10m")
        p.start_agent("a1", gpus="1xH100-80GB", wait=False, wrap=wrap, env=env)
        wrap, env = _skewed(tmp_path, "-2m")
        p.start_agent("a2", gpus="1xH100-80GB", wait=False, wrap=wrap, env=env)
        agent_log = tmp_path / "agent-a1.log"
        p.wait_for(
            lambda: "clock" in agent_log.read_text(errors="replace"), 30, "a1 to name its clock"
        )
        lines = [
            line
            for line in agent_log.read_text(errors="replace").splitlines()
            if "gpufleet.agent" in line and "controller" in line
        ]
        assert any("not yet valid" in x and "clock is probably behind" in x for x in lines), lines
        assert not any("not reachable yet" in x for x in lines), lines
        assert p.node_status("a1") is None  # never registered
        p.wait_for(lambda: p.node_status("a2") == "HEALTHY", 30, "a2 (2 min behind) registered")
        controller_log = (tmp_path / "c0.log").read_text(errors="replace")
        assert re.search(r"node a2: its clock is 1[12]\d s behind", controller_log), (
            controller_log[-2000:]
        )
    finally:
        p.stop()
