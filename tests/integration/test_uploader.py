"""The agent's uploader publishes only the attempt's own regular files: symbolic links (to
/etc/passwd, to directories, an output directory that is a link, a linked log) and FIFOs are
skipped and logged, never followed or waited on. Real files and directories."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from gpufleet.agent.assignment_log import RunRecord
from gpufleet.agent.uploader import LogStreamer, upload_attempt
from gpufleet.agent.workdir import RunPaths
from gpufleet.domain.manifest import Manifest, file_problem
from gpufleet.objectstore import ObjectStore, attempt_prefix


@pytest.fixture
def attempt(tmp_path: Path) -> tuple[RunRecord, RunPaths, ObjectStore]:
    rec = RunRecord(run_id="r-1", job_id="j-1", token=4, outcome="EXITED", exit_code=0)
    paths = RunPaths(tmp_path / "runs" / "r-1")
    for d in (paths.work, paths.artifacts, paths.checkpoints):
        d.mkdir(parents=True)
    return rec, paths, ObjectStore(str(tmp_path / "objects"))


def uploaded(store: ObjectStore, rec: RunRecord) -> dict[str, bytes]:
    prefix = attempt_prefix(rec.job_id, rec.run_id)
    return {k[len(prefix) + 1 :]: store.get_bytes(k) for k in store.list(prefix)}


def test_links_and_fifos_are_skipped_and_logged(attempt, caplog, tmp_path) -> None:
    rec, paths, store = attempt
    (paths.artifacts / "model.bin").write_bytes(b"weights")
    (paths.artifacts / "sub").mkdir()
    (paths.artifacts / "sub" / "metrics.json").write_text("{}")
    os.symlink("/etc/passwd", paths.artifacts / "passwd")
    os.symlink("/etc", paths.artifacts / "etc")
    os.symlink("../../../objects", paths.artifacts / "sub" / "up")
    os.mkfifo(paths.artifacts / "fifo")
    paths.log.write_text("hello\n")
    with caplog.at_level(logging.WARNING, logger="gpufleet.agent"):
        uri = upload_attempt(store, rec, paths)
    got = uploaded(store, rec)
    assert set(got) == {
        "artifacts/model.bin",
        "artifacts/sub/metrics.json",
        "logs/output.log",
        "MANIFEST.json",
    }
    assert b"root:" not in b"".join(got.values())
    manifest = Manifest.from_json(store.get_bytes(store.key_of(uri)))
    prefix = attempt_prefix(rec.job_id, rec.run_id)
    assert sorted(f.path for f in manifest.files) == [
        "model.bin",
        "output.log",
        "sub/metrics.json",
    ]
    assert all(file_problem(f, prefix) is None for f in manifest.files)
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    for name in ("artifacts/passwd", "artifacts/etc", "artifacts/sub/up", "artifacts/fifo"):
        assert any(name in m for m in skipped), (name, skipped)


def test_an_output_directory_that_is_a_link_is_not_walked(attempt, caplog) -> None:
    rec, paths, store = attempt
    paths.checkpoints.rmdir()
    os.symlink("/etc", paths.checkpoints)
    paths.log.unlink(missing_ok=True)
    os.symlink("/etc/passwd", paths.log)
    with caplog.at_level(logging.WARNING, logger="gpufleet.agent"):
        upload_attempt(store, rec, paths)
    assert set(uploaded(store, rec)) == {"MANIFEST.json"}
    text = " ".join(r.getMessage() for r in caplog.records)
    assert "checkpoints: skipped" in text and "output.log skipped" in text


def test_the_live_log_streamer_does_not_follow_a_linked_log(attempt) -> None:
    import threading

    rec, paths, store = attempt
    os.symlink("/etc/passwd", paths.log)
    streamer = LogStreamer(store, 1.0, threading.Event())
    streamer.watch(rec, paths.log)
    streamer.sync_once()
    assert uploaded(store, rec) == {}
