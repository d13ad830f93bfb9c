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
from gpufleet.domain.manifest import Manifest, ManifestFile, file_problem
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


def test_a_name_no_manifest_may_list_is_skipped_and_logged_escaped(attempt, caplog) -> None:
    """A control character (a newline) or a backslash in a file or directory name: that
    entry is skipped and logged in escaped form, the rest is uploaded, and the manifest is
    one the controller accepts (once: the whole attempt FAILED, every artifact lost)."""
    rec, paths, store = attempt
    (paths.artifacts / "model.bin").write_bytes(b"weights")
    (paths.artifacts / "ü.txt").write_bytes(b"latin")  # non-ASCII is fine
    (paths.artifacts / "nl\nx.txt").write_bytes(b"b")
    (paths.artifacts / "back\\slash").write_bytes(b"c")
    (paths.artifacts / "tab\tdir").mkdir()
    (paths.artifacts / "tab\tdir" / "inner.txt").write_bytes(b"d")
    (paths.checkpoints / "bell\x07.pt").write_bytes(b"e")
    paths.log.write_text("hello\n")
    with caplog.at_level(logging.WARNING, logger="gpufleet.agent"):
        uri = upload_attempt(store, rec, paths)
    manifest = Manifest.from_json(store.get_bytes(store.key_of(uri)))
    prefix = attempt_prefix(rec.job_id, rec.run_id)
    assert sorted(f.path for f in manifest.files) == ["model.bin", "output.log", "ü.txt"]
    assert all(file_problem(f, prefix) is None for f in manifest.files)
    assert set(uploaded(store, rec)) == {
        "artifacts/model.bin",
        "artifacts/ü.txt",
        "logs/output.log",
        "MANIFEST.json",
    }
    skipped = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    for shown in ("'nl\\nx.txt'", "'back\\\\slash'", "'tab\\tdir'", "'bell\\x07.pt'"):
        assert any(shown in m for m in skipped), (shown, skipped)
    assert not any("\n" in m or "\t" in m or "\x07" in m for m in skipped)  # escaped only
    assert not any("inner.txt" in m for m in skipped)  # the directory was not entered
    # the controller's check stays strict: such a path from a node is still refused
    bad = f"{prefix}/artifacts/nl\nx.txt"
    f = ManifestFile("artifact", "nl\nx.txt", bad, store.uri(bad), "0" * 64, 1)
    assert "control character" in (file_problem(f, prefix) or "")


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
