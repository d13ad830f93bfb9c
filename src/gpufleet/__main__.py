"""``python -m gpufleet``: the ``gpufleet`` command, for environments where the console script
is not on PATH."""

from gpufleet.cli import main

if __name__ == "__main__":
    main()
