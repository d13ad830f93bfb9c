"""Command-line entry points: the root app (main.py) and the user-facing client commands."""

import sys


def main() -> None:
    """The ``gpufleet`` executable: ``--version`` is answered here, before Typer, Rich and the
    commands are imported; everything else goes to :func:`gpufleet.cli.main.main`."""
    if sys.argv[1:] == ["--version"]:
        from gpufleet import __version__

        print(f"gpufleet {__version__}")
        return
    from gpufleet.cli.main import main as run

    run()
