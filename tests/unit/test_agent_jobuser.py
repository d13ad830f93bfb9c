"""Choosing an attempt's user and its environment (pure parts of the agent runtime)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from gpufleet.agent.assignment_log import RunRecord
from gpufleet.agent.runtime.jobuser import JobUsers, executable_by_others
from gpufleet.agent.workdir import RunPaths, build_env

USERS = JobUsers("gpufleet-job", 999, 998, per_attempt=True, uid_base=5000, uid_count=4)


class TestPerAttemptUids:
    def test_same_run_same_uid_in_the_range_with_the_job_users_group(self) -> None:
        a, b = USERS.for_run("r-1", home="/h"), USERS.for_run("r-1", home="/h")
        assert a == b
        assert 5000 <= a.uid < 5004
        assert (a.gid, a.switch, a.home) == (998, True, "/h")

    def test_a_uid_held_by_a_live_attempt_is_never_given_again(self) -> None:
        first = USERS.for_run("r-1", home="/h").uid
        taken = {first}
        for _ in range(3):
            uid = USERS.for_run("r-1", home="/h", taken=taken).uid
            assert uid not in taken
            taken.add(uid)
        assert taken == {5000, 5001, 5002, 5003}

    def test_shared_mode_and_no_switch(self) -> None:
        shared = JobUsers("gpufleet-job", 999, 998, per_attempt=False)
        assert shared.for_run("r-1", home="/h").uid == 999
        assert shared.describe() == "gpufleet-job"
        assert USERS.describe() == "gpufleet-job/uid-per-attempt"
        me = JobUsers("me", 0, 0, per_attempt=False, switch=False)
        assert me.describe() == "jobs-as-agent-user"
        assert me.for_run("r-1", home="/h").switch is False


def test_executable_by_others() -> None:
    # not under pytest's tmp: its 0700 root would make every answer False
    root = Path(tempfile.mkdtemp(prefix="gpufleet-exec-"))
    try:
        root.chmod(0o755)
        tool = root / "tool"
        tool.write_text("#!/bin/sh\n")
        tool.chmod(0o755)
        assert executable_by_others(tool)
        tool.chmod(0o750)
        assert not executable_by_others(tool)
        tool.chmod(0o755)
        root.chmod(0o700)
        assert not executable_by_others(tool)
    finally:
        shutil.rmtree(root)


class TestEnvironment:
    def test_built_from_the_allow_list_never_the_agents_environment(self) -> None:
        rec = RunRecord(
            run_id="r-1",
            job_id="j-1",
            token=3,
            attempt=2,
            gpu_ids=[1, 3],
            env={"FOO": "bar", "PATH": "/opt/venv/bin:/usr/bin", "CUDA_VISIBLE_DEVICES": "0"},
        )
        agent_env = {
            "GPUFLEET_DATABASE_URL": "postgresql://secret",
            "AWS_SECRET_ACCESS_KEY": "secret",
            "HOME": "/root",
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "PATH": "/root/.pyenv/shims:/usr/bin",
        }
        env = build_env(
            rec,
            RunPaths(Path("/s/runs/r-1"), Path("/j/r-1")),
            None,
            home="/j/r-1/work",
            agent_env=agent_env,
        )
        assert env["PATH"] == "/opt/venv/bin:/usr/bin"  # as submitted
        assert env["HOME"] == "/j/r-1/work"
        assert (env["LANG"], env["LC_ALL"], env["FOO"]) == ("C.UTF-8", "C.UTF-8", "bar")
        assert env["CUDA_VISIBLE_DEVICES"] == "1,3"  # the job cannot widen its pinning
        assert env["GPUFLEET_ARTIFACTS_DIR"] == "/j/r-1/artifacts"
        assert "AWS_SECRET_ACCESS_KEY" not in env
        assert "GPUFLEET_DATABASE_URL" not in env
        assert env["GPUFLEET_RESUME_FROM"] == ""

    def test_default_path_when_the_job_sends_none(self) -> None:
        env = build_env(
            RunRecord(run_id="r"), RunPaths(Path("/s/r")), None, home="/h", agent_env={}
        )
        assert env["PATH"] == "/usr/local/bin:/usr/bin:/bin"
