"""The per-attempt shim (``sh shim.sh``) as a real process: exit files, signals, start failures,
the claim, SIGINT left at its default in the command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gpufleet.agent import shim
from tests.integration.test_agent_support import live_group_members, wait_until


def _shim(tmp: Path, command: list[str], **extra: Any) -> subprocess.Popen[bytes]:
    argv = shim.argv(
        exit_file=tmp / "exit.json", log_file=tmp / "out.log", command=command, **extra
    )
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
            pytest.param("import sys; sys.exit(200)", 200, id="own exit 200"),
            pytest.param("import sys; sys.exit(255)", 255, id="own exit 255"),
            pytest.param("import sys; sys.exit(143)", -15, id="exit 143 reads as SIGTERM"),
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
        proc = _shim(tmp_path, [sys.executable, "-c", code])
        wait_until(ready.exists)

        os.killpg(proc.pid, signal.SIGTERM)

        assert proc.wait(timeout=30) == 0  # the shim survived to record the exit
        assert _exit(tmp_path)["exit_code"] == -signal.SIGTERM
        assert live_group_members(proc.pid) == []

    def test_command_not_found_is_a_start_error(self, tmp_path: Path) -> None:
        r, w = os.pipe()
        proc = subprocess.Popen(
            shim.argv(
                exit_file=tmp_path / "e",
                log_file=tmp_path / "l",
                status_fd=1,
                command=["/no/such/cmd"],
            ),
            stdout=w,
        )
        os.close(w)
        assert proc.wait(timeout=30) == 0
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
        proc = _shim(tmp_path, [sys.executable, "-c", code], claim_file=claim)
        assert proc.wait(timeout=30) == 0
        assert not marker.exists()
        assert not (tmp_path / "exit.json").exists()
        assert json.loads(claim.read_text()) == {"abandoned": True}

    def test_the_command_gets_default_signals_and_only_the_given_environment(
        self, tmp_path: Path
    ) -> None:
        code = (
            "import os, signal, sys; "
            "print([int(signal.getsignal(s) == signal.SIG_DFL) "
            "for s in (signal.SIGTERM, signal.SIGQUIT, signal.SIGHUP)], "
            "signal.getsignal(signal.SIGINT) is signal.default_int_handler, "
            "sorted(k for k in os.environ if k != 'LC_CTYPE'), "
            "sorted(os.listdir('/proc/self/fd')))"
        )
        env = {"PATH": os.environ["PATH"], "TOKEN": "x"}
        # as the agent does at start: a test run under nohup or in the background ignores
        # HUP/INT/QUIT, which exec would pass on to the job
        shim.unignore_signals()
        proc = subprocess.Popen(
            shim.argv(
                exit_file=tmp_path / "exit.json",
                log_file=tmp_path / "out.log",
                command=[sys.executable, "-c", code],
            ),
            start_new_session=True,
            env=env,
        )
        assert proc.wait(timeout=30) == 0
        assert _exit(tmp_path)["exit_code"] == 0
        # fds: stdin/stdout/stderr and the one listdir opens; nothing of the shim's
        want = "[1, 1, 1] True ['PATH', 'TOKEN'] ['0', '1', '2', '3']\n"
        assert (tmp_path / "out.log").read_text() == want

    def test_signals_ignored_by_whoever_started_the_agent_reach_the_job_as_default(
        self, tmp_path: Path
    ) -> None:
        """Replays an agent started with nohup / as a background job (HUP, INT and QUIT
        ignored, which exec passes on): after ``unignore_signals`` the job's are default."""
        names = ("SIGHUP", "SIGINT", "SIGQUIT")
        saved = {n: signal.getsignal(getattr(signal, n)) for n in names}
        try:
            for n in names:
                signal.signal(getattr(signal, n), signal.SIG_IGN)
            assert shim.unignore_signals() == list(names)
            code = (
                "import signal; print([int(signal.getsignal(s) == signal.SIG_DFL) "
                "for s in (signal.SIGHUP, signal.SIGQUIT)], "
                "signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
            )
            proc = subprocess.Popen(
                shim.argv(
                    exit_file=tmp_path / "exit.json",
                    log_file=tmp_path / "out.log",
                    command=[sys.executable, "-c", code],
                ),
                start_new_session=True,
                env={"PATH": os.environ["PATH"]},
            )
            assert proc.wait(timeout=30) == 0
            assert (tmp_path / "out.log").read_text() == "[1, 1] True\n"
        finally:
            for n, h in saved.items():
                signal.signal(getattr(signal, n), h)

    def test_a_start_error_naming_quotes_is_valid_json(self, tmp_path: Path) -> None:
        r, w = os.pipe()
        odd = '/no/such/"dir\\'
        proc = subprocess.Popen(
            shim.argv(
                exit_file=tmp_path / "e",
                log_file=tmp_path / "l",
                status_fd=1,
                cwd=Path(odd),
                command=["true"],
            ),
            stdout=w,
        )
        os.close(w)
        assert proc.wait(timeout=30) == 0
        status = json.loads(os.read(r, 4096))
        os.close(r)
        assert odd in status["error"]
        assert odd in json.loads((tmp_path / "e").read_text())["start_error"]


def test_a_finished_attempt_costs_no_scan_of_proc(tmp_path: Path, monkeypatch) -> None:
    """The agent reaps the shim at once, so ``killpg(pgid, 0)`` fails right after the job and
    the host's /proc is never scanned for the group (containment ``none``)."""
    from gpufleet.agent import procfs
    from gpufleet.agent.assignment_log import RunRecord
    from gpufleet.agent.runtime.base import JobUser, Launch
    from gpufleet.agent.runtime.containment import Containment
    from gpufleet.agent.runtime.process import ProcessRuntime
    from gpufleet.agent.workdir import RunPaths

    def no_scan(pgid: int) -> list[procfs.ProcStat]:
        raise AssertionError(f"/proc scanned for group {pgid}")

    monkeypatch.setattr(procfs, "group_members", no_scan)
    paths = RunPaths(tmp_path / "run")
    paths.root.mkdir()
    paths.work.mkdir(parents=True)
    rt = ProcessRuntime(Containment("none", {}, "forced"))
    rec = RunRecord(run_id="r-noscan", command=["true"])
    me = JobUser(uid=os.getuid(), gid=os.getgid(), switch=False)
    launch = Launch(
        paths=paths, command=("true",), env={"PATH": os.environ["PATH"]}, cwd=paths.work, user=me
    )
    h = rt.spawn(rec, launch)
    deadline = time.monotonic() + 30
    info = None
    while info is None and time.monotonic() < deadline:
        info = rt.poll(rec, h, time.monotonic())
        time.sleep(0.01)
    assert info is not None and info.exit_code == 0


def test_the_shim_and_python_agree_on_death_signals() -> None:
    """shim.sh's case list is exactly 128 + DEATH_SIGNALS (the agent's fallback uses those)."""
    import re

    text = shim.SHIM_SH.read_text()
    listed = re.search(r"^\s*((?:1\d\d\|)+1\d\d)\) _gf_code=", text, re.M)
    assert listed is not None
    assert {int(n) - 128 for n in listed.group(1).split("|")} == shim.DEATH_SIGNALS
    assert shim.exit_code_from_status(137) == -9
    assert shim.exit_code_from_status(200) == 200
    assert shim.exit_code_from_status(255) == 255
    assert shim.exit_code_from_status(3) == 3
