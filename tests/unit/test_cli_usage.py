"""Client-side helpers of ``gpufleet usage`` and ``gpufleet artifacts``."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpufleet.cli.client import ClientError
from gpufleet.cli.usage import _target, when

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


class TestWhen:
    @pytest.mark.parametrize(
        ("given", "want"),
        [
            ("7d", "2026-11-23T12:00:00Z"),
            ("12h", "2026-11-30T00:00:00Z"),
            ("30m", "2026-11-30T11:30:00Z"),
            ("today", "2026-11-30T00:00:00Z"),
            ("2026-11-01", "2026-11-01"),
            ("2026-11-01T05:00:00Z", "2026-11-01T05:00:00Z"),
        ],
    )
    def test_spans_and_iso_times(self, given: str, want: str) -> None:
        assert when(given, "--since", NOW) == want

    def test_anything_else_names_the_flag(self) -> None:
        with pytest.raises(ClientError) as err:
            when("last tuesday", "--until", NOW)
        assert err.value.field == "--until"


class TestArtifactTarget:
    def test_nested_paths_stay_inside(self, tmp_path: Path) -> None:
        assert _target(tmp_path, "sub/model.bin") == tmp_path / "sub" / "model.bin"

    @pytest.mark.parametrize("bad", ["../x", "/etc/passwd", "a/../../x", "a//b", "./a", ""])
    def test_a_path_that_could_leave_the_directory_is_refused(
        self, tmp_path: Path, bad: str
    ) -> None:
        with pytest.raises(ClientError):
            _target(tmp_path, bad)
