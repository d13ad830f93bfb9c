"""Per-attempt cost of the process jobs' isolation: the shim around ``/bin/true`` without and
with the isolation prefix (``setpriv --no-new-privs``, ``unshare --mount``, the shim's mounts:
private /tmp and /var/tmp, /dev/shm, hidepid /proc), and a scratch filesystem made and removed
(``agent.scratch``: sparse image, mkfs.ext4, loop mount; umount, delete).

Wall time and CPU (this process's children: ``ru_utime + ru_stime`` of ``RUSAGE_CHILDREN``) per
run, median and p90 of the wall times. Needs root (mount namespace, loop devices).

Usage::

    sudo .venv/bin/python benchmarks/job_isolation.py --samples 100
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from gpufleet.agent import shim
from gpufleet.agent.runtime import jobns
from gpufleet.agent.scratch import ScratchDisks


def measure(samples: int, run: Callable[[int], None]) -> tuple[float, float, float]:
    """(median wall ms, p90 wall ms, CPU ms per run)."""
    walls = []
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    for i in range(samples):
        t0 = time.perf_counter()
        run(i)
        walls.append((time.perf_counter() - t0) * 1000)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime) * 1000
    walls.sort()
    return statistics.median(walls), walls[int(0.9 * (len(walls) - 1))], cpu / samples


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--disk-mb", type=int, nargs="+", default=[48, 10240])
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("needs root")
    iso = jobns.detect()
    print(f"isolation: {iso.describe()}; problems: {list(iso.problems) or 'none'}")
    with tempfile.TemporaryDirectory(dir="/var/lib") as tmp:
        root = Path(tmp)
        (root / "tmp").mkdir(mode=0o1777)

        def shim_run(prefix: list[str], options: dict[str, object]) -> Callable[[int], None]:
            def run(i: int) -> None:
                argv = shim.argv(
                    exit_file=root / f"exit-{i}",
                    log_file=root / "log",
                    command=["/bin/true"],
                    **options,  # type: ignore[arg-type]
                )
                subprocess.run([*prefix, *argv], check=True, env={"PATH": "/usr/bin:/bin"})

            return run

        rows = [
            ("shim alone", shim_run([], {})),
            ("shim + no_new_privs", shim_run(iso.shim_prefix(namespace=False), {})),
            (
                "shim + no_new_privs + mount ns + mounts",
                shim_run(
                    iso.shim_prefix(namespace=True),
                    iso.shim_options(namespace=True, tmp_dir=str(root / "tmp")),
                ),
            ),
        ]
        disks = ScratchDisks(root / "images", default_mb=48)
        creates: dict[int, list[float]] = {}
        (root / "images").mkdir()
        for size in args.disk_mb:

            def scratch(i: int, size: int = size) -> None:
                point = root / f"m-{size}-{i}"
                point.mkdir()
                t0 = time.perf_counter()
                disks.create(point.name, point, size, 1234, 1234)
                creates.setdefault(size, []).append((time.perf_counter() - t0) * 1000)
                disks.remove(point.name, point)
                point.rmdir()

            rows.append((f"scratch {size} MiB: create + remove", scratch))
        print(f"{'what':<44} {'median ms':>10} {'p90 ms':>8} {'CPU ms/run':>11}")
        for name, run in rows:
            med, p90, cpu = measure(args.samples, run)
            print(f"{name:<44} {med:>10.1f} {p90:>8.1f} {cpu:>11.1f}")
        for size, walls in creates.items():
            print(f"{f'  of which create ({size} MiB)':<44} {statistics.median(walls):>10.1f}")


if __name__ == "__main__":
    main()
