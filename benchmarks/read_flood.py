"""Per-team read limits under abuse: team A floods ``GET /v1/jobs?limit=500`` from many
connections while team B lists and submits at a steady pace.

The script starts a real ``gpufleet server`` (SQLite, or PostgreSQL with ``--db postgres``;
buckets in Redis with ``--redis-url``), creates teams ``a`` and ``b`` and gives each
``--jobs`` pending jobs. Then three phases of ``--seconds`` each:

1. ``alone``: B alone: every ``1/--quiet-rate`` s one ``GET /v1/jobs?limit=50`` and one
   submit; latencies recorded.
2. ``flood, no read limit``: the same while ``--flood-procs`` x ``--flood-threads`` clients
   of A list 500 jobs as fast as they can, A's read rate set to 0 (no limit): the behaviour
   before read limits.
3. ``flood, read limit``: the same with A's read bucket at ``--read-rate``/s (burst
   ``--read-burst``; a 500-row page costs 25 tokens). A's clients ignore Retry-After.

Printed: B's GET and submit p50/p99 per phase, the p99 ratio to ``alone``, and A's answers
(200/429 per second). Exit code 1 when B saw an error, or A's flood was never refused in
phase 3, or a 429 did not name ``read_rate_per_s``.

Usage::

    .venv/bin/python benchmarks/read_flood.py
    .venv/bin/python benchmarks/read_flood.py --db postgres --seconds 20
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from _common import (
    DEFAULT_POSTGRES_URL,
    console,
    fresh_postgres_database,
    machine,
    percentile,
    table_console,
)
from rate_limit import Server
from rich.table import Table

JOB = {"command": ["python3", "-c", "pass"], "gpu_count": 1}


def quiet_loop(
    url: str, token: str, rate: float, stop: threading.Event
) -> tuple[list[float], list[float], int]:
    """B: a list and a submit every 1/rate s until ``stop``; (GET ms, submit ms, errors)."""
    gets, posts, bad = [], [], 0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60) as c:
        nxt = time.perf_counter()
        while not stop.is_set():
            t0 = time.perf_counter()
            r = c.get("/v1/jobs", params={"limit": 50})
            gets.append((time.perf_counter() - t0) * 1000)
            bad += r.status_code != 200
            t0 = time.perf_counter()
            r = c.post("/v1/jobs", json=JOB, headers={"Idempotency-Key": uuid.uuid4().hex})
            posts.append((time.perf_counter() - t0) * 1000)
            bad += r.status_code != 201
            nxt += 1 / rate
            time.sleep(max(0.0, nxt - time.perf_counter()))
    return gets, posts, bad


def flood_proc(url: str, token: str, threads: int, stop: Any, results: Any) -> None:
    """A: ``threads`` clients listing 500 jobs as fast as they can (Retry-After ignored)."""
    seen: Counter[str] = Counter()
    lock = threading.Lock()

    def one() -> None:
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {token}"}, timeout=60
        ) as c:
            while not stop.is_set():
                r = c.get("/v1/jobs", params={"limit": 500})
                with lock:
                    seen[str(r.status_code)] += 1
                    if r.status_code == 429 and r.json().get("field") != "read_rate_per_s":
                        seen["429 not naming the limit"] += 1

    ts = [threading.Thread(target=one) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    results.put(seen)


def phase(
    server: Server, tokens: dict[str, str], args: argparse.Namespace, flood: bool
) -> tuple[list[float], list[float], int, Counter[str], float]:
    stop = mp.Event()
    results: Any = mp.Queue()
    procs = [
        mp.Process(
            target=flood_proc, args=(server.url, tokens["a"], args.flood_threads, stop, results)
        )
        for _ in range(args.flood_procs if flood else 0)
    ]
    for p in procs:
        p.start()
    if procs:
        time.sleep(3.0)  # the flood is under way (its processes started, the burst spent)
    out: dict[str, Any] = {}
    q = threading.Thread(
        target=lambda: out.setdefault(
            "q", quiet_loop(server.url, tokens["b"], args.quiet_rate, stop)
        )
    )
    t0 = time.perf_counter()
    q.start()
    time.sleep(args.seconds)
    stop.set()
    q.join()
    wall = time.perf_counter() - t0
    seen: Counter[str] = Counter()
    for _ in procs:
        seen.update(results.get(timeout=120))
    for p in procs:
        p.join(timeout=60)
    gets, posts, bad = out["q"]
    return gets, posts, bad, seen, wall


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    ap.add_argument("--redis-url", default=None)
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--jobs", type=int, default=500, help="pending jobs per team")
    ap.add_argument("--flood-procs", type=int, default=4)
    ap.add_argument("--flood-threads", type=int, default=4, help="per flooding process")
    ap.add_argument("--quiet-rate", type=float, default=5.0, help="B's GET+submit pairs per s")
    ap.add_argument("--read-rate", type=float, default=20.0, help="A's read tokens per s")
    ap.add_argument("--read-burst", type=int, default=100)
    ap.add_argument(
        "--gpufleet",
        default=str(Path(sys.executable).parent / "gpufleet")
        if (Path(sys.executable).parent / "gpufleet").exists()
        else shutil.which("gpufleet") or "gpufleet",
    )
    args = ap.parse_args()

    rows = []
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpufleet-rf-")))
        env: dict[str, str] = {"GPUFLEET_REDIS_PREFIX": f"bench-{uuid.uuid4().hex[:8]}"}
        if args.db == "postgres":
            env["GPUFLEET_DATABASE_URL"] = stack.enter_context(
                fresh_postgres_database(args.postgres_url, "gpufleet_bench_rf")
            )
        if args.redis_url:
            env["GPUFLEET_REDIS_URL"] = args.redis_url
        server = stack.enter_context(Server(args.gpufleet, tmp, env))
        admin = server.admin(
            "token", "create", "--team", "ops", "--admin", "--create-team", "--db"
        )  # fmt: skip
        tokens = {
            t: server.admin("token", "create", "--team", t, "--create-team", token=admin)
            for t in ("a", "b")
        }
        for t in ("a", "b"):
            server.admin(
                "team", "set", t, "--max-outstanding", "0", "--submit-rate", "0", token=admin
            )  # fmt: skip
        console.print(f"filling: {args.jobs} pending jobs per team")
        for t in ("a", "b"):
            with httpx.Client(
                base_url=server.url, headers={"Authorization": f"Bearer {tokens[t]}"}
            ) as c:
                for _ in range(args.jobs):
                    c.post("/v1/jobs", json=JOB, headers={"Idempotency-Key": uuid.uuid4().hex})
        time.sleep(1.5)  # the team limits' cache (1 s) has the new values
        plan = [
            ("alone", False, None),
            ("flood, no read limit", True, "0"),
            ("flood, read limit", True, f"{args.read_rate}/s"),
        ]
        for name, flood, rate in plan:
            if rate is not None:
                server.admin(
                    "team", "set", "a", "--read-rate", rate,
                    "--read-burst", str(args.read_burst), token=admin,
                )  # fmt: skip
                time.sleep(1.5)
            console.print(f"phase: {name} ({args.seconds:g} s)")
            rows.append((name, *phase(server, tokens, args, flood)))

    table = Table(title=f"B's latency while A floods reads ({args.db}; {machine()})")
    for col in (
        "phase", "B GET p50 ms", "B GET p99 ms", "x alone", "B submit p50 ms",
        "B submit p99 ms", "x alone", "B errors", "A 200/s", "A 429/s",
    ):  # fmt: skip
        table.add_column(col, justify="right")
    base_get = percentile(sorted(rows[0][1]), 99)
    base_post = percentile(sorted(rows[0][2]), 99)
    ok = True
    for name, gets, posts, bad, seen, wall in rows:
        g, p = sorted(gets), sorted(posts)
        table.add_row(
            name,
            f"{percentile(g, 50):.1f}",
            f"{percentile(g, 99):.1f}",
            f"{percentile(g, 99) / base_get:.1f}",
            f"{percentile(p, 50):.1f}",
            f"{percentile(p, 99):.1f}",
            f"{percentile(p, 99) / base_post:.1f}",
            str(bad),
            f"{seen['200'] / wall:.0f}" if seen else "",
            f"{seen['429'] / wall:.0f}" if seen else "",
        )
        ok = ok and bad == 0 and seen["429 not naming the limit"] == 0
    ok = ok and rows[2][4]["429"] > 0
    out = table_console(140)
    out.print(table)
    out.print(
        f"A: {args.flood_procs * args.flood_threads} connections; read limit "
        f"{args.read_rate:g} tokens/s, burst {args.read_burst} (a 500-row page = 25 tokens)"
    )
    out.print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
