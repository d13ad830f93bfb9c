"""The per-attempt shim as a real process: exit files, signals, start failures, the claim."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_agent_support import live_group_members, wait_until


def _shim(tmp: Path, command: list[str], *extra: str) -> subprocess.Popen[bytes]:
    argv = [
        sys.executable,
        "-m",
        "gpufleet.agent.shim",
        "--exit-file",
        str(tmp / "exit.json"),
        "--log-file",
        str(tmp / "out.log"),
        *extra,
        "--",
        *command,
    ]
    return subprocess.Popen(argv, start_new_session=True)


def _exit(tmp: Path) -> dict[str, object]:
    return json.loads((tmp / "exit.json").read_text())


class TestShim:
    @pytest.mark.parametrize(
        ("code", "want_exit_code"),
        [
            pytest.param("print('out'); import sys; print('err', file=sys.stderr)", 0, id="ok"),
            pytest.param("import sys; sys.exit(3)", 3, id="non-zero exit"),
            pytest.param("import os; os.kill(os.getpid(), 9)", -9, id="killed by a signal"),
        ],
    )
    def test_writes_the_exit_code_and_appends_output(self, tmp_path, code, want_exit_code):
        (tmp_path / "out.log").write_bytes(b"earlier\n")
        assert _shim(tmp_path, [sys.executable, "-c", code]).wait(timeout=30) == 0
        assert _exit(tmp_path)["exit_code"] == want_exit_code
        log = (tmp_path / "out.log").read_bytes()
        assert log.startswith(b"earlier\n")
        if want_exit_code == 0:
            assert b"out\n" in log
            assert b"err\n" in log

    def test_group_sigterm_reaches_the_command_but_not_the_shim(self, tmp_path: Path) -> None:
        ready = tmp_path / "ready"
        code = f"import time, pathlib; pathlib.Path({str(ready)!r}).touch(); time.sleep(30)"
        shim = _shim(tmp_path, [sys.executable, "-c", code])
        wait_until(ready.exists)

        os.killpg(shim.pid, signal.SIGTERM)

        assert shim.wait(timeout=30) == 0  # the shim survived to record the exit
        assert _exit(tmp_path)["exit_code"] == -signal.SIGTERM
        assert live_group_members(shim.pid) == []

    def test_command_not_found_is_a_start_error(self, tmp_path: Path) -> None:
        r, w = os.pipe()
        shim = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "gpufleet.agent.shim",
                "--exit-file",
                str(tmp_path / "e"),
                "--log-file",
                str(tmp_path / "l"),
                "--status-fd",
                str(w),
                "--",
                "/no/such/cmd",
            ],
            pass_fds=(w,),
        )
        os.close(w)
        assert shim.wait(timeout=30) == 0
        status = json.loads(os.read(r, 4096))
        os.close(r)
        assert "No such file" in status["error"]
        exit_info = json.loads((tmp_path / "e").read_text())
        assert exit_info["exit_code"] == 127
        assert "No such file" in exit_info["start_error"]

    def test_a_taken_claim_means_the_command_never_starts(self, tmp_path: Path) -> None:
        claim = tmp_path / "claim.json"
        claim.write_text('{"abandoned": true}')
        marker = tmp_path / "ran"
        code = f"import pathlib; pathlib.Path({str(marker)!r}).touch()"
        shim = _shim(tmp_path, [sys.executable, "-c", code], "--claim-file", str(claim))
        assert shim.wait(timeout=30) == 0
        assert not marker.exists()
        assert not (tmp_path / "exit.json").exists()
        assert json.loads(claim.read_text()) == {"abandoned": True}
