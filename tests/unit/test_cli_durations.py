"""Duration flags of the CLI (``submit --time 2h``, ``--default-runtime 4h``, ``--max-runtime
1w``, ``--ttl``): units, combinations, Slurm's ``--time`` forms, and a one-line ClientError
naming the flag for anything else."""

from __future__ import annotations

import pytest

from gpufleet.cli.admin_api import _runtime
from gpufleet.cli.options import ClientError, duration_s


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
        # Slurm's --time forms (sbatch(1)): MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS
        ("30:00", 1800),
        ("1:30:00", 5400),
        ("2-12", 216000),
        ("2-12:30", 217800),
        ("1-00:00:01", 86401),
    ],
)
def test_units(text: str, seconds: float) -> None:
    assert duration_s(text, "--max-runtime") == seconds


@pytest.mark.parametrize(
    "text", ["nan", "inf", "-1", "abc", "", "1x", "0", "h", "1:2:3:4", "1-", "-1:00", "0:00"]
)
def test_refused_with_the_flag_named(text: str) -> None:
    with pytest.raises(ClientError, match="--max-runtime"):
        duration_s(text, "--max-runtime")


@pytest.mark.parametrize("text", ["0", "0h", "0s", "none", "NONE"])
def test_zero_or_none_removes_a_team_setting(text: str) -> None:
    assert _runtime(text, "--default-runtime") == 0.0
