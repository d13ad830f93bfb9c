"""Kept local dirs of reported attempts (issue 24, item 2): bounded by count and bytes,
removed first under disk pressure; a compaction a full disk refuses leaves the log as it was;
an upload whose local log is gone lists the copy mirrored while the attempt ran."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest

from gpufleet.agent import runner as runner_mod
from gpufleet.agent.assignment_log import AssignmentLog, RunRecord, RunStatus
from gpufleet.agent.runner import CLEANED_MARK, LOCAL_RUNS_KEPT, Runner
from gpufleet.agent.uploader import LOG_KEY, upload_attempt
from gpufleet.domain.manifest import Manifest
from gpufleet.objectstore import ObjectStore, attempt_prefix

MIB = 1024 * 1024


def _reported(runner: Runner, run_id: str, log_bytes: int, at: float) -> None:
    paths = runner.paths(run_id)
    paths.root.mkdir(parents=True)
    with open(paths.log, "wb") as f:
        f.write(os.urandom(log_bytes))  # allocated blocks, not a sparse file
    runner.cleanup(RunRecord(run_id=run_id, runtime="process"))
    if (paths.root / CLEANED_MARK).exists():  # else not kept
        os.utime(paths.root / CLEANED_MARK, (at, at))


def _kept(runner: Runner) -> list[str]:
    return [d.name for _, d, _ in runner.kept_runs()]


def test_kept_dirs_are_bounded_by_bytes_and_a_noisy_log_alone_is_not_kept(
    tmp_path: Path,
) -> None:
    runner = Runner(tmp_path / "state", ObjectStore(str(tmp_path / "objects")), kept_runs_mb=1)
    _reported(runner, "r-1", 300_000, 1.0)
    _reported(runner, "r-2", 300_000, 2.0)
    _reported(runner, "r-3", 300_000, 3.0)
    assert _kept(runner) == ["r-1", "r-2", "r-3"]
    _reported(runner, "r-4", 300_000, 4.0)  # 1.2 MB: the oldest goes
    assert _kept(runner) == ["r-2", "r-3", "r-4"]
    _reported(runner, "r-noisy", 2 * MIB, 5.0)  # over the bound alone: not kept
    assert _kept(runner) == ["r-2", "r-3", "r-4"]
    assert not runner.paths("r-noisy").root.exists()


def test_the_count_bound_still_holds(tmp_path: Path) -> None:
    runner = Runner(tmp_path / "state", ObjectStore(str(tmp_path / "objects")))
    for i in range(LOCAL_RUNS_KEPT + 2):
        _reported(runner, f"r-{i:02d}", 10, float(i))
    assert _kept(runner) == [f"r-{i:02d}" for i in range(2, LOCAL_RUNS_KEPT + 2)]


def test_the_default_bound_is_2_percent_of_the_filesystem_at_most_1_gib(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = shutil.disk_usage(tmp_path)
    for total, want in [(10 * 1024 * MIB, 204), (4 * MIB, 0), (10**15, 1024)]:
        monkeypatch.setattr(
            runner_mod.shutil, "disk_usage", lambda _p, t=total: usage._replace(total=t)
        )
        assert runner_mod.default_kept_runs_mb(tmp_path) == want


def test_relieve_removes_the_oldest_kept_dirs_until_the_disk_has_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = Runner(tmp_path / "state", ObjectStore(str(tmp_path / "objects")), kept_runs_mb=10)
    for i in range(4):
        _reported(runner, f"r-{i}", 1000, float(i))
    # a disk with 4 MiB, each kept dir holding 1 MiB of it
    monkeypatch.setattr(runner_mod, "_free_mb", lambda _p: 4 - len(_kept(runner)))
    assert runner.relieve(2)[0] == 2
    assert _kept(runner) == ["r-2", "r-3"]  # the oldest two went, no more
    assert runner.relieve(2) == (0, 0)  # no pressure: nothing removed


def test_a_compaction_the_disk_refuses_leaves_the_log_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = AssignmentLog(tmp_path)
    log.append("assigned", "r-1", job_id="j-1", token=3, leader_epoch=2)
    before = log.path.read_bytes()
    real_fsync = os.fsync

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space"):
        log.compact()
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert log.path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["assignments.jsonl"]
    log.append("start_failed", "r-1", message="x")  # the log still takes appends
    log.close()
    assert AssignmentLog(tmp_path).runs["r-1"].status == RunStatus.FAILED_TO_START


def test_an_upload_whose_local_log_is_gone_lists_the_mirrored_copy(tmp_path: Path) -> None:
    from gpufleet.agent.workdir import RunPaths

    rec = RunRecord(run_id="r-1", job_id="j-1", token=4, outcome="EXITED")
    paths = RunPaths(tmp_path / "runs" / "r-1")  # nothing of it is left locally
    store = ObjectStore(str(tmp_path / "objects"))
    store.put_bytes(f"{attempt_prefix('j-1', 'r-1')}/{LOG_KEY}", b"mirrored while it ran\n")
    uri = upload_attempt(store, rec, paths)
    manifest = Manifest.from_json(store.get_bytes(store.key_of(uri)))
    assert [(f.kind, f.path, f.size) for f in manifest.files] == [("log", "output.log", 22)]
