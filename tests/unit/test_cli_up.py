"""`gpufleet up`'s checks before anything starts: the job uid mode it picks when none is
given, and the one-line message for a local port that is taken."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from gpufleet.processes import default_job_uids, port_clash
from gpufleet.settings import Settings


def _python_in(dir_mode: int, tmp_path: Path) -> str:
    home = tmp_path / "home"
    home.mkdir()
    exe = home / "python3"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    home.chmod(dir_mode)
    tmp_path.chmod(0o755)
    return str(exe)


@pytest.mark.skipif(os.geteuid() != 0, reason="the fallback applies to root only")
def test_root_with_a_python_job_users_cannot_run_gets_agent_uids_and_a_note(
    tmp_path: Path,
) -> None:
    uids, note = default_job_uids(_python_in(0o700, tmp_path))
    assert uids == "agent" and note is not None and "--job-uids agent" in note
    assert stat.S_IMODE((tmp_path / "home").stat().st_mode) == 0o700


def test_a_python_everyone_can_run_keeps_the_agent_default(tmp_path: Path) -> None:
    if not all(os.stat(p).st_mode & 0o001 for p in tmp_path.parents):
        pytest.skip("the temp dir's parents are not searchable by others here")
    assert default_job_uids(_python_in(0o755, tmp_path)) == (None, None)


def test_a_taken_port_is_named_with_the_option_that_moves_it() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        s = Settings(controller_address=f"127.0.0.1:{port}", join_address="127.0.0.1:0")
        msg = port_clash(s, 0)
        assert msg is not None and f"127.0.0.1:{port}" in msg
        assert "--controller-port" in msg and "GPUFLEET_CONTROLLER_ADDRESS" in msg
        api = Settings(controller_address="127.0.0.1:0", join_address="127.0.0.1:0")
        msg = port_clash(api, port)
        assert msg is not None and "API port" in msg and "--port" in msg
        join = Settings(controller_address="127.0.0.1:0", join_address=f"127.0.0.1:{port}")
        msg = port_clash(join, 0)
        assert msg is not None and "GPUFLEET_JOIN_ADDRESS" in msg
    assert (
        port_clash(Settings(controller_address="127.0.0.1:0", join_address="127.0.0.1:0"), 0)
        is None
    )


def test_one_up_per_data_dir_and_a_stale_lock_is_taken_over(tmp_path: Path) -> None:
    from gpufleet.cli import uplock

    first = uplock.claim(tmp_path)
    first.set_url("http://127.0.0.1:8420")
    with pytest.raises(uplock.DataDirInUse) as info:
        uplock.claim(tmp_path)
    assert str(info.value) == (
        f"data dir {tmp_path} is in use by gpufleet up (pid {os.getpid()}) at "
        "http://127.0.0.1:8420"
    )
    first.release()
    # a file left by a dead `up` (no lock held): taken over, whatever pid it names
    (tmp_path / uplock.LOCK_NAME).write_text('{"pid": 999999999, "url": "http://x"}\n')
    again = uplock.claim(tmp_path)
    again.release()


def test_a_second_up_refuses_in_one_line_and_keeps_client_yaml(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gpufleet.cli import uplock
    from gpufleet.cli.config import client_config_path
    from gpufleet.cli.main import app

    cfg = client_config_path(tmp_path)
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text("url: http://127.0.0.1:8420\ntoken: first\n")
    held = uplock.claim(tmp_path)
    held.set_url("http://127.0.0.1:8420")
    try:
        result = CliRunner().invoke(
            app, ["up", "--data-dir", str(tmp_path), "--port", "18431"], env={"COLUMNS": "300"}
        )
    finally:
        held.release()
    assert result.exit_code == 1, result.output
    line = f"data dir {tmp_path} is in use by gpufleet up (pid {os.getpid()}) at http://127.0.0.1:8420"
    assert line in result.stderr and result.stderr.count("\n") == 1, result.stderr
    assert cfg.read_text() == "url: http://127.0.0.1:8420\ntoken: first\n"


def test_a_bad_gpu_spec_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from gpufleet.cli.main import app

    result = CliRunner().invoke(
        app,
        ["up", "--data-dir", str(tmp_path), "--port", "18432", "--gpus", "bogus"],
        env={"COLUMNS": "300"},
    )
    assert result.exit_code == 2, result.output
    assert "--gpus" in result.stderr and "invalid GPU spec 'bogus'" in result.stderr
    assert "Traceback" not in result.output
    # nothing started: no lock, database or agent log in the data dir
    assert list(tmp_path.iterdir()) == []


def test_the_agent_log_shown_is_only_what_this_run_wrote(tmp_path: Path) -> None:
    from gpufleet.cli.serve import log_tail_since

    log = tmp_path / "agent.log"
    log.write_text("error: invalid GPU spec 'old': from an earlier run\n")
    start = log.stat().st_size
    with open(log, "a") as f:
        f.write("starting\nerror: the controller refused\n")
    assert log_tail_since(log, start) == ["starting", "error: the controller refused"]
    assert log_tail_since(log, log.stat().st_size) == []
    assert log_tail_since(tmp_path / "none.log", 0) == []


def test_down_stops_the_up_holding_the_data_dir(tmp_path: Path) -> None:
    """A real process holds up.lock and waits for a signal as `up` does; `gpufleet down`
    finds it by the lock, signals it and returns once it ended; a second `down` finds none."""
    import subprocess
    import sys

    from typer.testing import CliRunner

    from gpufleet.cli import uplock
    from gpufleet.cli.main import app

    code = (
        "import sys; from pathlib import Path; from gpufleet.cli import uplock;"
        "from gpufleet.cli.common import wait_for_signal;"
        "lock = uplock.claim(Path(sys.argv[1])); print('held', flush=True); wait_for_signal();"
        "lock.release()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        assert (uplock.holder(tmp_path) or {}).get("pid") == proc.pid
        env = {"GPUFLEET_DATA_DIR": str(tmp_path)}
        r = CliRunner().invoke(app, ["down", "--data-dir", str(tmp_path)], env=env)
        assert r.exit_code == 0, r.output
        assert f"stopped gpufleet up (pid {proc.pid})" in r.output
        assert proc.wait(timeout=30) == 0
        assert uplock.holder(tmp_path) is None  # the file stays, stale: nobody holds it
        again = CliRunner().invoke(app, ["down", "--data-dir", str(tmp_path)], env=env)
        assert again.exit_code == 0 and "no gpufleet up runs" in again.output
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
