"""``python -m gpufleet`` runs the same command as the ``gpufleet`` console script (a new
user found it missing: "No module named gpufleet.__main__")."""

from __future__ import annotations

import subprocess
import sys

from gpufleet import __version__


def test_python_m_gpufleet_is_the_cli() -> None:
    version = subprocess.run(
        [sys.executable, "-m", "gpufleet", "--version"], capture_output=True, text=True, timeout=60
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == f"gpufleet {__version__}"
    listed = subprocess.run(
        [sys.executable, "-m", "gpufleet", "sim", "baselines"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert listed.returncode == 0, listed.stderr
    assert "fifo_per_team" in listed.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "gpufleet", "no-such-command"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
