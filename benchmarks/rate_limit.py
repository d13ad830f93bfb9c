"""Per-team submit rate limits under abuse: one team floods ``POST /v1/jobs`` far over its
submit rate while another team keeps submitting at a steady pace.

The script starts a real ``gpufleet server`` (SQLite, or PostgreSQL with ``--db postgres``;
the token buckets in Redis with ``--redis-url``, in process otherwise), creates two teams with
``gpufleet admin``: ``noisy`` limited to ``--noisy-rate``/s (burst ``--noisy-burst``) and
``quiet`` with the server's defaults. Then, for ``--seconds``:

- ``--noisy-clients`` threads submit for ``noisy`` as fast as they can; every answer must be
  201 or 429, and every 429 must carry ``Retry-After`` and name the limit;
- one client submits for ``quiet`` every ``1/--quiet-rate`` s; each must be 201, and its latency
  is recorded.

A baseline phase first times ``quiet`` alone with the same pace. Printed: noisy's answers
(201/429, admitted rate vs its limit), and quiet's p50/p95/p99/max latency alone and under the
flood. Exit code 1 when quiet saw a non-201, noisy was never refused, or a 429 lacked
``Retry-After``.

Usage::

    .venv/bin/python benchmarks/rate_limit.py
    .venv/bin/python benchmarks/rate_limit.py --db postgres --redis-url redis://127.0.0.1:6379/14
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from _common import (
    DEFAULT_POSTGRES_URL,
    child_env,
    console,
    free_port,
    fresh_postgres_database,
    machine,
    percentile,
    stop_processes,
    table_console,
)
from rich.table import Table

JOB = {"command": ["python3", "-c", "pass"], "gpu_count": 1}


class Server:
    """``gpufleet server`` on a free port with its own data dir; a context manager."""

    def __init__(self, gpufleet: str, data_dir: Path, env: dict[str, str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.gpufleet = gpufleet
        self.log_path = data_dir / "server.log"
        self.env = child_env({"GPUFLEET_DATA_DIR": str(data_dir), **env})
        self.proc: subprocess.Popen[bytes] | None = None

    def admin(self, *args: str, token: str | None = None) -> str:
        """``gpufleet admin ARGS``: over REST with ``token`` (an admin token), else written to
        the database directly (``--db``: the first token, before any exists)."""
        env = self.env if token is None else {
            **self.env, "GPUFLEET_URL": self.url, "GPUFLEET_TOKEN": token,
        }  # fmt: skip
        out = subprocess.run(
            [self.gpufleet, "admin", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if out.returncode != 0:
            sys.exit(f"gpufleet admin {' '.join(args)} failed: {out.stderr[-2000:]}")
        return out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""

    def __enter__(self) -> Server:
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [self.gpufleet, "server", "--migrate", "--port", str(self.port)],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        sys.exit(
            f"server did not start; see {self.log_path}:\n{self.log_path.read_text()[-2000:]}"
        )

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_processes([self.proc], group=True)


def quiet_loop(
    url: str, token: str, rate: float, stop: threading.Event
) -> tuple[list[float], int]:
    """Submit every 1/rate s until ``stop``; (latencies in ms, non-201 answers)."""
    latencies, bad = [], 0
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as c:
        nxt = time.perf_counter()
        while not stop.is_set():
            t0 = time.perf_counter()
            r = c.post("/v1/jobs", json=JOB, headers={"Idempotency-Key": uuid.uuid4().hex})
            latencies.append((time.perf_counter() - t0) * 1000)
            if r.status_code != 201:
                bad += 1
                console.print(f"[red]quiet got {r.status_code}: {r.text[:200]}")
            nxt += 1 / rate
            time.sleep(max(0.0, nxt - time.perf_counter()))
    return latencies, bad


def noisy_loop(url: str, token: str, rate: float, stop: Any, results: Any) -> None:
    """One flooding client, in its own process (so it does not share the quiet client's GIL):
    submit ``rate`` times a second (0: as fast as it can) until ``stop``; put a Counter of
    the answers on ``results``."""
    seen: Counter[str] = Counter()
    nxt = time.perf_counter()
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {token}"}) as c:
        while not stop.is_set():
            if rate:
                nxt += 1 / rate
                time.sleep(max(0.0, nxt - time.perf_counter()))
            r = c.post("/v1/jobs", json=JOB, headers={"Idempotency-Key": uuid.uuid4().hex})
            seen[str(r.status_code)] += 1
            if r.status_code == 429:
                if "Retry-After" not in r.headers:
                    seen["429 without Retry-After"] += 1
                if r.json().get("field") != "submit_rate_per_s":
                    seen["429 not naming the limit"] += 1
    results.put(seen)


def timed(
    seconds: float,
    quiet: Callable[[], tuple[list[float], int]],
    noisy: list[Any],
    stop: Any,
) -> tuple[list[float], int]:
    """Run the quiet client (a thread) and the noisy ones (processes) for ``seconds``."""
    result: dict[str, tuple[list[float], int]] = {}
    q = threading.Thread(target=lambda: result.setdefault("q", quiet()))
    for p in noisy:
        p.start()
    time.sleep(0.5 if noisy else 0)  # the flood is under way before quiet starts
    q.start()
    time.sleep(seconds)
    stop.set()
    q.join()
    return result["q"]


def stats(lat: list[float]) -> tuple[float, float, float, float]:
    s = sorted(lat)
    return percentile(s, 50), percentile(s, 95), percentile(s, 99), s[-1] if s else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    ap.add_argument("--redis-url", default=None, help="shared token buckets (else in process)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--noisy-clients", type=int, default=4)
    ap.add_argument(
        "--flood-rate",
        type=float,
        default=400.0,
        help="submits per second offered by all noisy clients together (0: as fast as they "
        "can; on a small machine the clients then compete with the server for CPUs)",
    )
    ap.add_argument("--noisy-rate", type=float, default=5.0)
    ap.add_argument("--noisy-burst", type=int, default=10)
    ap.add_argument("--quiet-rate", type=float, default=20.0, help="quiet submits per second")
    ap.add_argument(
        "--gpufleet",
        default=str(Path(sys.executable).parent / "gpufleet")
        if (Path(sys.executable).parent / "gpufleet").exists()
        else shutil.which("gpufleet") or "gpufleet",
    )
    args = ap.parse_args()

    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="gpufleet-rl-")))
        env: dict[str, str] = {}
        if args.db == "postgres":
            env["GPUFLEET_DATABASE_URL"] = stack.enter_context(
                fresh_postgres_database(args.postgres_url, "gpufleet_bench_rl")
            )
        if args.redis_url:
            env["GPUFLEET_REDIS_URL"] = args.redis_url
            import redis

            r = redis.Redis.from_url(args.redis_url)
            for key in r.scan_iter("gpufleet:rate:*"):
                r.delete(key)
        server = stack.enter_context(Server(args.gpufleet, tmp, env))
        admin = server.admin(
            "token", "create", "--team", "ops", "--admin", "--create-team", "--db"
        )  # fmt: skip
        tokens = {
            t: server.admin("token", "create", "--team", t, "--create-team", token=admin)
            for t in ("noisy", "quiet")
        }
        server.admin(
            "team", "set", "noisy", "--submit-rate", f"{args.noisy_rate}/s",
            "--submit-burst", str(args.noisy_burst), token=admin,
        )  # fmt: skip
        server.admin("team", "set", "quiet", "--max-outstanding", "0", token=admin)

        console.print(f"baseline: quiet alone for {args.seconds:g} s")
        stop = mp.Event()
        base_lat, base_bad = timed(
            args.seconds, lambda: quiet_loop(server.url, tokens["quiet"], args.quiet_rate, stop),
            [], stop,
        )  # fmt: skip
        console.print(f"flood: {args.noisy_clients} noisy clients + quiet for {args.seconds:g} s")
        stop = mp.Event()
        results: Any = mp.Queue()
        per_client = args.flood_rate / args.noisy_clients
        noisy = [
            mp.Process(
                target=noisy_loop,
                args=(server.url, tokens["noisy"], per_client, stop, results),
            )
            for _ in range(args.noisy_clients)
        ]
        t0 = time.perf_counter()
        flood_lat, flood_bad = timed(
            args.seconds, lambda: quiet_loop(server.url, tokens["quiet"], args.quiet_rate, stop),
            noisy, stop,
        )  # fmt: skip
        wall = time.perf_counter() - t0
        seen: Counter[str] = Counter()
        for _ in noisy:
            seen.update(results.get(timeout=60))
        for p in noisy:
            p.join(timeout=30)

    table = Table(
        title=f"Submit rate limits ({args.db}, buckets in "
        f"{'Redis' if args.redis_url else 'process'}; {machine()})"
    )
    for col in ("phase", "quiet n", "p50 ms", "p95 ms", "p99 ms", "max ms", "quiet non-201"):
        table.add_column(col, justify="right")
    for name, lat, bad in (("alone", base_lat, base_bad), ("under flood", flood_lat, flood_bad)):
        p50, p95, p99, mx = stats(lat)
        table.add_row(
            name, str(len(lat)), f"{p50:.1f}", f"{p95:.1f}", f"{p99:.1f}", f"{mx:.1f}", str(bad)
        )
    out = table_console(110)
    out.print(table)
    admitted = seen["201"]
    other = {k: v for k, v in seen.items() if k not in ("201", "429")}
    offered = f"{args.flood_rate:g}/s offered" if args.flood_rate else "as fast as they can"
    out.print(
        f"noisy ({args.noisy_rate:g}/s, burst {args.noisy_burst}; {args.noisy_clients} clients, "
        f"{offered}): "
        f"{seen['201'] + seen['429']} answers in {wall:.1f} s: {admitted} x 201 "
        f"({admitted / wall:.1f}/s admitted; the limit allows "
        f"{args.noisy_burst + args.noisy_rate * wall:.0f}), {seen['429']} x 429 "
        f"({seen['429'] / wall:.0f}/s); other answers: {other or 'none'}"
    )
    ok = (
        base_bad == 0
        and flood_bad == 0
        and seen["429"] > 0
        and set(seen) <= {"201", "429"}
        and admitted <= args.noisy_burst + args.noisy_rate * wall + 1
    )
    out.print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
