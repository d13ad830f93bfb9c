"""Duration flags of the admin CLI (``--default-runtime 4h``, ``--max-runtime 1w``, ``--ttl``):
units, combinations, and a one-line ClientError naming the flag for anything else."""

from __future__ import annotations

import pytest

from gpufleet.cli.admin_api import _runtime, duration_s
from gpufleet.cli.client import ClientError


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("90", 90),
        ("90s", 90),
        ("15m", 900),
        ("2h", 7200),
        ("4H", 14400),
        ("1d", 86400),
        ("1w", 604800),
        ("1d12h", 129600),
        ("0.5h", 1800),
    ],
)
def test_units(text: str, seconds: float) -> None:
    assert duration_s(text, "--max-runtime") == seconds


@pytest.mark.parametrize("text", ["nan", "inf", "-1", "abc", "", "1x", "0", "h"])
def test_refused_with_the_flag_named(text: str) -> None:
    with pytest.raises(ClientError, match="--max-runtime"):
        duration_s(text, "--max-runtime")


@pytest.mark.parametrize("text", ["0", "0h", "0s", "none", "NONE"])
def test_zero_or_none_removes_a_team_setting(text: str) -> None:
    assert _runtime(text, "--default-runtime") == 0.0
