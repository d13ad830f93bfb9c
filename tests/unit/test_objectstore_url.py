"""The object store an agent and a controller compare at registration: its URL, and the
probe object the agent writes and the controller reads back from its own store."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from gpufleet.objectstore import (
    PROBE_PREFIX,
    ObjectStore,
    ProbeCheck,
    ProbeReader,
    ProbeVerdict,
    new_probe_nonce,
    probe,
    public_url,
    same_store,
)


@pytest.mark.parametrize(
    ("url", "want"),
    [
        ("file:///srv/objects/", "file:///srv/objects"),
        ("file:///srv//a/../objects", "file:///srv/objects"),
        ("/srv/objects", "file:///srv/objects"),
        ("s3://AKIA:secret@bucket/prefix/", "s3://bucket/prefix"),
        ("S3://Bucket/prefix?endpoint_url=http://x#frag", "s3://bucket/prefix"),
        ("s3://bucket", "s3://bucket"),
        ("gcs://b/p//q", "gcs://b/p/q"),
    ],
)
def test_public_url_is_normalised_and_carries_no_credentials(url: str, want: str) -> None:
    assert public_url(url) == want


def test_same_store() -> None:
    assert same_store("/srv/objects", "file:///srv/objects/")
    assert same_store("s3://k:s@bucket/p", "s3://bucket/p/")
    assert not same_store("file:///srv/objects", "file:///srv/other")
    assert not same_store("s3://bucket/a", "s3://bucket/b")
    assert not same_store("s3://bucket/a", "file:///bucket/a")


def test_probe_writes_under_the_reserved_prefix(tmp_path: Path) -> None:
    assert probe(str(tmp_path / "objects"), "n1") is None
    assert (tmp_path / "objects" / PROBE_PREFIX / "n1").stat().st_size == 32


def test_probe_names_why_a_store_cannot_be_used(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    problem = probe(f"file://{blocker}/objects", "n1")
    assert problem is not None and problem.startswith("NotADirectoryError"), problem
    missing = probe("nosuchproto://bucket/x", "n1")
    assert missing is not None and "nosuchproto" in missing, missing


def _reader(root: Path, timeout_s: float = 3.0) -> ProbeReader:
    return ProbeReader(ObjectStore(str(root)), timeout_s=timeout_s)


def test_the_controller_reads_the_agents_nonce_from_its_own_store(tmp_path: Path) -> None:
    nonce = new_probe_nonce()
    assert len(nonce) == 32 and nonce != new_probe_nonce()
    assert probe(str(tmp_path / "fleet"), "n1", nonce) is None
    got = _reader(tmp_path / "fleet").check("n1", nonce)
    assert got == ProbeCheck(ProbeVerdict.SAME, "")

    # the agent wrote to another store with the same name: absent from ours
    assert probe(str(tmp_path / "other"), "n2", nonce) is None
    absent = _reader(tmp_path / "fleet").check("n2", nonce)
    assert absent.verdict is ProbeVerdict.OTHER
    assert f"file://{tmp_path}/fleet/{PROBE_PREFIX}/n2" in absent.detail
    assert "the agent and the controller use different object stores" in absent.detail
    # ours holds another agent's nonce for that node id (a stale or foreign probe object)
    stale = _reader(tmp_path / "fleet").check("n1", new_probe_nonce())
    assert stale.verdict is ProbeVerdict.OTHER and "another nonce" in stale.detail


def test_a_store_the_controller_cannot_read_in_time_is_unknown_not_a_refusal(
    tmp_path: Path,
) -> None:
    root = tmp_path / "fleet"
    (root / PROBE_PREFIX).mkdir(parents=True)
    os.mkfifo(root / PROBE_PREFIX / "hangs")  # opening it for reading blocks: a hung store
    (root / PROBE_PREFIX / "broken").mkdir()  # reading it fails with another error than absent
    reader = _reader(root, timeout_s=0.3)
    started = time.monotonic()
    hung = reader.check("hangs", new_probe_nonce())
    assert hung.verdict is ProbeVerdict.UNKNOWN and "took over 0.3 s" in hung.detail
    assert time.monotonic() - started < 2.0
    broken = reader.check("broken", new_probe_nonce())
    assert broken.verdict is ProbeVerdict.UNKNOWN and "IsADirectoryError" in broken.detail
    # the hung read still holds its slot; the others are free
    assert probe(str(root), "n1", "abc") is None
    assert reader.check("n1", "abc").verdict is ProbeVerdict.SAME
    with open(root / PROBE_PREFIX / "hangs", "wb"):  # release the hung reader thread
        pass
