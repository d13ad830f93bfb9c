"""The object store URL an agent and a controller compare at registration."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.objectstore import PROBE_PREFIX, probe, public_url, same_store


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
