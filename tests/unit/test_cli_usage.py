"""Client-side helpers of ``gpufleet usage`` and ``gpufleet artifacts``."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from gpufleet.cli.options import ClientError
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


def test_usage_csv_by_team_has_no_duplicate_team_column() -> None:
    import csv
    import io

    from gpufleet.api.reports import UsageLineOut, UsageOut, usage_csv

    line = UsageLineOut(
        key="vision", team="vision", gpu_seconds=15.0, gpu_hours=15 / 3600, attempts=1, jobs=1
    )
    out = UsageOut(
        since=None,
        until="2026-11-30T00:00:00Z",
        by="team",
        team=None,
        items=[line],
        total_gpu_seconds=15.0,
        total_gpu_hours=15 / 3600,
    )
    header = usage_csv(out).splitlines()[0].split(",")
    assert header == ["team", "gpu_hours", "gpu_seconds", "attempts", "jobs"]
    by_job = usage_csv(out.model_copy(update={"by": "job"}))
    assert next(csv.DictReader(io.StringIO(by_job)))["team"] == "vision"


@pytest.mark.parametrize(
    ("hours", "want"),
    [(0.0, "0"), (15 / 3600, "0.00417"), (0.02, "0.0200"), (1.25, "1.25"), (1234.5, "1234.50")],
)
def test_gpu_hours_keep_three_significant_digits(hours: float, want: str) -> None:
    from gpufleet.cli.usage import gpu_hours

    assert gpu_hours(hours) == want
