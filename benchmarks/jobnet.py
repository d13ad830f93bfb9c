"""What a job network namespace costs per attempt: create (netns, veth, /30, route) and
remove, and the extra exec of ``nsenter`` before the shim. Needs root, ``ip`` and ``nft``.

    sudo .venv/bin/python benchmarks/jobnet.py [--attempts 50]

Prints a table of milliseconds (median, p90, max).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import time

from gpufleet.agent.runtime.jobnet import JobNet, NetPolicy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--attempts", type=int, default=50)
    args = ap.parse_args()
    net = JobNet("netns", f"bench-{time.time_ns()}", NetPolicy())
    rows: dict[str, list[float]] = {"create": [], "nsenter + true": [], "true": [], "remove": []}
    try:
        for i in range(args.attempts):
            t = time.perf_counter()
            ns = net.create(f"r{i}")
            rows["create"].append(time.perf_counter() - t)
            t = time.perf_counter()
            subprocess.run([*net.enter_prefix(ns), "true"], check=True)
            rows["nsenter + true"].append(time.perf_counter() - t)
            t = time.perf_counter()
            subprocess.run(["true"], check=True)
            rows["true"].append(time.perf_counter() - t)
            t = time.perf_counter()
            net.remove(f"r{i}")
            rows["remove"].append(time.perf_counter() - t)
    finally:
        net.prune(keep=())
    head = f"{'step':<16} {'median ms':>10} {'p90 ms':>8} {'max ms':>8}"
    print(f"{head}   ({args.attempts} attempts)")
    for name, values in rows.items():
        values.sort()
        p90 = values[int(0.9 * (len(values) - 1))]
        print(
            f"{name:<16} {statistics.median(values) * 1e3:>10.1f} {p90 * 1e3:>8.1f}"
            f" {values[-1] * 1e3:>8.1f}"
        )


if __name__ == "__main__":
    main()
