"""``workdir.newest_checkpoint_mtime``: the newest file time in an attempt's checkpoint
directory, as heartbeats report it; a directory the job owns may hold anything, and nothing in
it may crash the heartbeat or lead the agent outside it."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from gpufleet.agent import workdir
from gpufleet.agent.workdir import newest_checkpoint_mtime


def touch(path: Path, mtime: float) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x")
    os.utime(path, (mtime, mtime))
    return path


def test_an_empty_or_missing_directory_has_none(tmp_path: Path) -> None:
    (tmp_path / "ckpt" / "empty-sub").mkdir(parents=True)
    assert newest_checkpoint_mtime(tmp_path / "ckpt") is None
    assert newest_checkpoint_mtime(tmp_path / "missing") is None


def test_the_newest_regular_file_at_any_depth(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    touch(ckpt / "step-1" / "model.bin", 1_000.5)
    touch(ckpt / "step-2" / "shard" / "deep" / "model.bin", 3_000.25)
    touch(ckpt / "latest.txt", 2_000.0)
    os.utime(ckpt / "step-1", (9_000.0, 9_000.0))  # a directory's own time is not a file's
    os.mkfifo(ckpt / "fifo")  # not a regular file: ignored
    assert newest_checkpoint_mtime(ckpt) == 3_000.25


def test_symlinks_are_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    touch(outside / "newer.bin", 9_000.0)
    ckpt = tmp_path / "ckpt"
    touch(ckpt / "model.bin", 1_000.0)
    (ckpt / "to-dir").symlink_to(outside)
    (ckpt / "to-file").symlink_to(outside / "newer.bin")
    (ckpt / "dangling").symlink_to(tmp_path / "nothing")
    assert newest_checkpoint_mtime(ckpt) == 1_000.0
    # the checkpoint directory itself replaced by a symlink: nothing is read through it
    link = tmp_path / "link"
    link.symlink_to(outside)
    assert newest_checkpoint_mtime(link) is None


def test_an_unreadable_directory_or_a_vanished_file_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = tmp_path / "ckpt"
    touch(ckpt / "ok.bin", 1_000.0)
    touch(ckpt / "locked" / "newer.bin", 5_000.0)
    touch(ckpt / "gone.bin", 6_000.0)
    os.chmod(ckpt / "locked", 0)  # enough when the tests do not run as root
    real_open, real_scandir = os.open, os.scandir

    def refusing_open(path: Any, flags: int, *args: Any, **kw: Any) -> int:
        if os.fspath(path) == "locked":
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *args, **kw)

    class Vanishing:
        """An entry removed between the listing and its stat."""

        def __init__(self, entry: os.DirEntry[str]) -> None:
            self.entry, self.name = entry, entry.name

        def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
            if self.name == "gone.bin":
                raise FileNotFoundError(2, "No such file or directory", self.name)
            return self.entry.stat(follow_symlinks=follow_symlinks)

    @contextmanager
    def scandir(fd: Any) -> Iterator[list[Vanishing]]:
        with real_scandir(fd) as entries:
            yield [Vanishing(e) for e in entries]

    monkeypatch.setattr(workdir.os, "open", refusing_open)
    monkeypatch.setattr(workdir.os, "scandir", scandir)
    try:
        assert newest_checkpoint_mtime(ckpt) == 1_000.0
    finally:
        monkeypatch.undo()
        os.chmod(ckpt / "locked", 0o700)
    assert newest_checkpoint_mtime(ckpt) == 6_000.0


def test_a_listing_that_fails_gives_none_and_never_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    touch(tmp_path / "ckpt" / "model.bin", 1_000.0)

    def failing(fd: Any) -> Any:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(workdir.os, "scandir", failing)
    assert newest_checkpoint_mtime(tmp_path / "ckpt") is None


def test_the_walk_stops_after_max_entries_and_max_depth(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    for i in range(50):
        touch(ckpt / f"f{i:02d}", 1_000.0 + i)
    got = newest_checkpoint_mtime(ckpt, max_entries=10)
    assert got is not None and 1_000.0 <= got <= 1_049.0
    deep = tmp_path / "deep"
    touch(deep / "top.bin", 1_000.0)
    touch(deep / "a" / "b" / "c" / "bottom.bin", 2_000.0)
    assert newest_checkpoint_mtime(deep, max_depth=2) == 1_000.0
    assert newest_checkpoint_mtime(deep, max_depth=3) == 2_000.0
    assert workdir.CHECKPOINT_SCAN_MAX_ENTRIES == 10_000


def test_no_descriptor_is_left_open(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    for i in range(20):
        touch(ckpt / f"d{i}" / "e" / "m.bin", 1_000.0 + i)
    before = len(os.listdir("/proc/self/fd"))
    for cap in (1, 5, 30, 10_000):
        newest_checkpoint_mtime(ckpt, max_entries=cap)
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_file_dated_in_the_future_does_not_hide_the_real_checkpoints(tmp_path: Path) -> None:
    """A new user's run: a restored file dated a day ahead made the agent report that time,
    which the controller ignores, so every real checkpoint after it went unreported."""
    ckpt = tmp_path / "checkpoints"
    now = time.time()
    touch(ckpt / "restored", now + 86_400.0)
    touch(ckpt / "step-1", now - 10.0)
    assert newest_checkpoint_mtime(ckpt) == pytest.approx(now - 10.0)
    # within the allowed clock skew it still counts
    touch(ckpt / "step-2", now + workdir.CHECKPOINT_FUTURE_SKEW_S / 2)
    assert newest_checkpoint_mtime(ckpt) == pytest.approx(
        now + workdir.CHECKPOINT_FUTURE_SKEW_S / 2
    )
    assert newest_checkpoint_mtime(ckpt, not_after=now) == pytest.approx(now - 10.0)
