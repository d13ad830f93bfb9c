"""The agent's jobs dir: job users must reach it only when jobs run as other users."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpufleet.agent.runner import Runner
from gpufleet.agent.runtime.jobuser import JobUsers
from gpufleet.objectstore import ObjectStore


def _private_jobs_dir(tmp_path: Path) -> Path:
    parent = tmp_path / "private"
    parent.mkdir()
    os.chmod(parent, 0o700)  # nobody else may traverse it
    return parent / "jobs"


def test_jobs_run_as_the_agent_need_no_searchable_parents(tmp_path: Path) -> None:
    """`gpufleet agent --job-uids agent --jobs-dir <under a 0700 dir>` was refused with
    "not searchable by other users", though no other user ever enters it."""
    users = JobUsers("", os.getuid(), os.getgid(), per_attempt=False, switch=False)
    jobs = _private_jobs_dir(tmp_path)
    runner = Runner(
        tmp_path / "state", ObjectStore(str(tmp_path / "obj")), users=users, jobs_dir=jobs
    )
    assert runner.jobs_dir == jobs and jobs.is_dir()


def test_jobs_run_as_other_users_need_searchable_parents(tmp_path: Path) -> None:
    users = JobUsers("gpufleet-job", 4000, 4000, per_attempt=False, switch=True)
    with pytest.raises(ValueError, match="not searchable by other users"):
        Runner(
            tmp_path / "state",
            ObjectStore(str(tmp_path / "obj")),
            users=users,
            jobs_dir=_private_jobs_dir(tmp_path),
        )


def test_a_jobs_dir_that_each_jobs_mount_namespace_would_hide_is_refused() -> None:
    """Jobs get a private /tmp and /var/tmp and an empty /run: a jobs dir under one of them
    would hide the job's own work dir, so the agent refuses to start with it (exit 2)."""
    from gpufleet.agent.main import _check_jobs_dir_visible

    for bad in ("/tmp/jobs", "/var/tmp/x/jobs", "/run/gpufleet/jobs", "/tmp"):
        with pytest.raises(ValueError, match=r"--jobs-dir .* is under"):
            _check_jobs_dir_visible(Path(bad))
    for good in ("/var/lib/gpufleet/jobs", "/srv/jobs", "/tmpfoo/jobs"):
        _check_jobs_dir_visible(Path(good))
