#!/usr/bin/env python3
"""Run seeds of the chaos harness (tests/chaos/harness.py) and print a table.

    .venv/bin/python scripts/chaos.py --seeds 1-20 --duration 60

Needs root (a tmpfs is mounted), PostgreSQL (GPUFLEET_TEST_POSTGRES_URL) and Redis
(GPUFLEET_TEST_REDIS_URL). Exit status 1 when any seed found a violation."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.chaos.harness import run_chaos


def seeds(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        a, _, b = part.partition("-")
        out += list(range(int(a), int(b or a) + 1))
    return out


def main() -> int:
    import signal

    # SIGTERM cleans up like Ctrl-C: processes stopped, tmpfs unmounted, database dropped
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="1-20")
    ap.add_argument("--duration", type=float, default=60.0, help="nemesis seconds per seed")
    ap.add_argument("--drain", type=float, default=120.0)
    ap.add_argument("--fault-rpc", default="drop=0.1,delay_ms=200")
    ap.add_argument("--keep", action="store_true", help="keep each seed's logs dir")
    args = ap.parse_args()
    pg = os.environ.get(
        "GPUFLEET_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
    )
    redis = os.environ.get("GPUFLEET_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")
    print(f"{'seed':>4} {'jobs':>5} {'viol':>4} {'max_rec':>7} faults", flush=True)
    bad = 0
    for seed in seeds(args.seeds):
        tmp = Path(tempfile.mkdtemp(prefix=f"chaos-{seed}-"))
        report = run_chaos(
            seed, args.duration, tmp, pg, redis, fault_rpc=args.fault_rpc, drain_s=args.drain
        )
        print(report.row(), flush=True)
        for v in report.violations:
            print(f"     ! {v}", flush=True)
        if report.violations:
            bad += 1
            print(f"     logs: {tmp}", flush=True)
        elif not args.keep:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
